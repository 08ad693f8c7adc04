"""The gated delta rule in plain PyTorch: a chunked form for training and a token-by-token recurrence as its check.

Per value head, with a state S [k, v] (zeros unless ``initial_state``), for t = 1..T:

    S <- e^{g_t} S;    S <- S + k_t beta_t (v_t - S^T k_t)^T;    o_t = S^T (scale q_t)

The signatures follow flash-linear-attention's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``
(time-major tensors, ``g`` in log space, ``scale`` defaulting to k^-0.5, fp32 final state): these are the torch
references of DeltaNet's delta-rule kernel slots, and ``kernels/registry.py`` can put FLA's kernels
(``kernels/linear_attention/fla.py``) in their place. ``cu_seqlens`` (packed variable-length sequences in a batch of
one, as FLA takes them): the chunked rule pads each sequence to whole chunks and runs them all in one pass, the state
restarting at each sequence's first chunk (no call per sequence); the recurrence runs each sequence on its own.

Letters as in DEVELOPERS.md (T the time steps; H value heads, a multiple of the h query/key heads: q/k head i
serves value heads i*H/h .. (i+1)*H/h - 1, as in FLA and transformers; k, v the key and value head dims; C the chunk
length, Q chunks).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, TypeVar

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
R = TypeVar("R")


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dim, as FLA's kernels (and transformers) normalise q and k."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _head_major_fp32(q_BThk: Tensor, k_BThk: Tensor, v_BTHv: Tensor, g_BTH: Tensor, beta_BTH: Tensor,
                     scale: float | None, use_qk_l2norm: bool) -> tuple[Tensor, ...]:
    """[B, H, T, .] fp32 tensors, q and k normalised (if asked) and repeated over their value heads, q scaled."""
    num_qk_heads, num_v_heads = q_BThk.shape[2], v_BTHv.shape[2]
    if num_v_heads % num_qk_heads:
        raise ValueError(f"{num_v_heads} value heads must be a multiple of {num_qk_heads} query/key heads")
    q_BThk, k_BThk = q_BThk.float(), k_BThk.float()
    if use_qk_l2norm:
        q_BThk, k_BThk = l2norm(q_BThk), l2norm(k_BThk)
    q_BThk = q_BThk * (q_BThk.shape[-1] ** -0.5 if scale is None else scale)
    q_BTHk, k_BTHk = (x.repeat_interleave(num_v_heads // num_qk_heads, dim=2) for x in (q_BThk, k_BThk))
    return tuple(x.float().transpose(1, 2) for x in (q_BTHk, k_BTHk, v_BTHv, g_BTH, beta_BTH))


def _fp32(rule: Callable[..., R]) -> Callable[..., R]:
    """Run ``rule`` with autocast off: its products and triangular solves must stay in fp32 (FLA's kernels
    accumulate in fp32 too), and autocast would put them in bf16."""

    @functools.wraps(rule)
    def wrapper(q: Tensor, *args: Any, **kwargs: Any) -> R:
        with torch.autocast(q.device.type, enabled=False):
            return rule(q, *args, **kwargs)

    return wrapper


def _per_sequence(rule: Callable[..., tuple[Tensor, Tensor | None]]) -> Callable[..., tuple[Tensor, Tensor | None]]:
    """Add FLA's ``cu_seqlens`` (the n + 1 offsets of n sequences): with a batch of one, tokens [cu_seqlens[i],
    cu_seqlens[i + 1]) are sequence i, starting from ``initial_state[i]`` (or zeros); final states [n, H, k, v]."""

    @functools.wraps(rule)
    def wrapper(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *args: Any,
                cu_seqlens: Tensor | None = None, initial_state: Tensor | None = None,
                output_final_state: bool = False, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        if cu_seqlens is None:
            return rule(q, k, v, g, beta, *args, initial_state=initial_state, output_final_state=output_final_state,
                        **kwargs)
        if q.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs the sequences concatenated into a batch of 1, got batch {q.shape[0]}")
        bounds = cu_seqlens.tolist()
        outputs, states = [], []
        for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
            o, state = rule(*(x[:, start:end] for x in (q, k, v, g, beta)), *args,
                            initial_state=None if initial_state is None else initial_state[i:i + 1],
                            output_final_state=output_final_state, **kwargs)
            outputs.append(o)
            states.append(state)
        return torch.cat(outputs, dim=1), torch.cat(states) if output_final_state else None

    return wrapper


def _initial_state(initial_state_BHkv: Tensor | None, v_BHTv: Tensor, k_dim: int) -> Tensor:
    if initial_state_BHkv is not None:
        return initial_state_BHkv.float()
    B, H, _, v_dim = v_BHTv.shape
    return v_BHTv.new_zeros(B, H, k_dim, v_dim)


class _Lanes(NamedTuple):
    """Packed sequences laid out in parallel lanes of whole chunks (first-fit decreasing into lanes as long as the
    longest sequence): no chunk holds two sequences, and the chunk loop runs max-chunks steps for all of them."""

    source_LP: Tensor  # each slot's token index, or T (a zero row: inert padding)
    slot_T: Tensor  # each token's slot in the flattened [L * P] layout
    keep_QL: Tensor  # 0 where a sequence starts at chunk q of lane l (the state restarts there), else 1
    start_QL: Tensor  # the sequence starting there (its initial state), or n (none: zeros)
    restarts: list[bool]  # per chunk: whether a sequence starts there in some lane
    last: list[tuple[int, int]]  # per sequence: the (chunk, lane) where it ends, or (-1, -1) if it is empty


def _pack_lanes(cu_seqlens: Tensor, total: int, chunk_size: int) -> _Lanes:
    bounds = cu_seqlens.tolist()  # the one host read: the layout depends on it
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to the {total} tokens, got {bounds[0]} .. {bounds[-1]}")
    n, C = len(bounds) - 1, chunk_size
    chunks = [-(-(end - start) // C) for start, end in zip(bounds, bounds[1:])]
    Q = max(chunks, default=0)
    fill: list[int] = []  # chunks used per lane
    place: dict[int, tuple[int, int]] = {}  # sequence -> (lane, first chunk)
    for d in sorted(range(n), key=lambda d: -chunks[d]):
        if chunks[d]:
            lane = next((lane for lane, used in enumerate(fill) if used + chunks[d] <= Q), len(fill))
            fill += [0] * (lane == len(fill))
            place[d], fill[lane] = (lane, fill[lane]), fill[lane] + chunks[d]
    L, P = max(len(fill), 1), Q * C
    source_LP = torch.full((L, P), total)
    slot_T = torch.empty(total, dtype=torch.long)
    keep_QL, start_QL = torch.ones(Q, L), torch.full((Q, L), n)
    last = [(-1, -1)] * n
    for d, (lane, first) in place.items():
        start, end = bounds[d], bounds[d + 1]
        source_LP[lane, first * C:first * C + end - start] = torch.arange(start, end)
        slot_T[start:end] = torch.arange(end - start) + lane * P + first * C
        keep_QL[first, lane], start_QL[first, lane] = 0, d
        last[d] = (first + chunks[d] - 1, lane)
    device = cu_seqlens.device
    return _Lanes(source_LP.to(device), slot_T.to(device), keep_QL.to(device), start_QL.to(device),
                  (keep_QL == 0).any(1).tolist(), last)


@_fp32
def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64, cu_seqlens: Tensor | None = None, cu_seqlens_cpu: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """q, k [B, T, h, k]; v [B, T, H, v]; g (log decay, <= 0), beta [B, T, H]; initial_state [B, H, k, v].
    Returns o [B, T, H, v] in v's dtype and the final state [B, H, k, v] in fp32 (or None). With ``cu_seqlens``
    (n + 1 offsets into the flattened B x T tokens, every row starting a sequence; FLA takes a batch of one): n
    sequences, initial_state and the final states [n, H, k, v]; ``cu_seqlens_cpu``: the same offsets on the host,
    where the caller knows them (FLA's argument): then nothing is read back.

    Within a chunk, with gamma_i the cumulative log decay from the chunk start, the deltas
    ``delta_i = beta_i (v_i - S_{i-1}^T k_i e^{g_i})`` solve the unit lower-triangular system
    ``(I + L) delta = beta v - (beta e^gamma k) S_0`` with ``L_ij = beta_i e^{gamma_i - gamma_j} k_i.k_j`` (i > j):
    two triangular solves per chunk, then one sequential step per chunk instead of per token.
    """
    B, T = q.shape[:2]
    if cu_seqlens is not None and B > 1:  # rows of packed documents: the same sequences, the rows flattened
        bounds = set((cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist())
        if not bounds >= set(range(0, B * T, T)):
            raise ValueError(f"cu_seqlens over {B} rows of {T} tokens must start a sequence at every row start")
        o, state = chunk_gated_delta_rule(*(x.flatten(0, 1)[None] for x in (q, k, v, g, beta)), scale=scale,
                                          initial_state=initial_state, output_final_state=output_final_state,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
                                          cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        return o.view(B, T, *o.shape[2:]), state
    q_BHTk, k_BHTk, v_BHTv, g_BHT, beta_BHT = _head_major_fp32(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    C, k_dim, lanes = chunk_size, k_BHTk.shape[-1], None
    if cu_seqlens is None:
        state_BHkv = _initial_state(initial_state, v_BHTv, k_dim)
    else:
        if q.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs the sequences concatenated into a batch of 1, got batch {q.shape[0]}")
        # The sequences as the rows of a batch (B = L lanes), each padded to whole chunks: zero padding is inert
        # (g = 0 and beta = 0 leave the state as it is, its outputs are dropped), so one pass runs them all.
        lanes = _pack_lanes(cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu, T, C)
        q_BHTk, k_BHTk, v_BHTv, g_BHT, beta_BHT = (
            torch.cat([x[0], x.new_zeros(x.shape[1], 1, *x.shape[3:])], dim=1)[:, lanes.source_LP].transpose(0, 1)
            for x in (q_BHTk, k_BHTk, v_BHTv, g_BHT, beta_BHT))
        state_BHkv = v_BHTv.new_zeros(q_BHTk.shape[0], v_BHTv.shape[1], k_dim, v_BHTv.shape[-1])
        starts_NHkv = None if initial_state is None else torch.cat([initial_state.float(), state_BHkv[:1]])
    # Zero padding at the end is inert too; its outputs are cut off.
    pad = -q_BHTk.shape[2] % C
    q_BHQCk, k_BHQCk, v_BHQCv = (F.pad(x, (0, 0, 0, pad)).unflatten(2, (-1, C)) for x in (q_BHTk, k_BHTk, v_BHTv))
    g_BHQC, beta_BHQC = (F.pad(x, (0, pad)).unflatten(2, (-1, C)) for x in (g_BHT, beta_BHT))

    gamma_BHQC = g_BHQC.cumsum(dim=-1)
    # e^{gamma_i - gamma_j} for j <= i; masked before exp, where the difference is positive and could overflow.
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay_BHQCC = (gamma_BHQC[..., :, None] - gamma_BHQC[..., None, :]).masked_fill(~causal_CC, -torch.inf).exp()
    kbeta_BHQCk = k_BHQCk * beta_BHQC[..., None]
    # I + L: the solver reads only the strictly lower triangle of this product.
    system_BHQCC = (kbeta_BHQCk @ k_BHQCk.transpose(-1, -2)) * decay_BHQCC
    solve = functools.partial(torch.linalg.solve_triangular, system_BHQCC, upper=False, unitriangular=True)
    u_BHQCv = solve(v_BHQCv * beta_BHQC[..., None])  # the deltas if the chunk started from S = 0
    w_BHQCk = solve(kbeta_BHQCk * gamma_BHQC.exp()[..., None])  # how the chunk's initial state enters them
    scores_BHQCC = (q_BHQCk @ k_BHQCk.transpose(-1, -2)) * decay_BHQCC  # diagonal included: o_t sees its own update
    q_read_BHQCk = q_BHQCk * gamma_BHQC.exp()[..., None]  # reads the initial state, decayed up to each token
    k_write_BHQCk = k_BHQCk * (gamma_BHQC[..., -1:] - gamma_BHQC).exp()[..., None]  # decayed to the chunk end
    chunk_decay_BHQ = gamma_BHQC[..., -1].exp()

    # Packed sequences end in different chunks: keep each chunk's states only where final states are returned.
    outputs, history, keep_history = [], [], lanes is not None and output_final_state
    for i in range(q_BHQCk.shape[2]):
        if lanes is not None and lanes.restarts[i]:  # a sequence starts here in some lane: its state restarts
            state_BHkv = state_BHkv * lanes.keep_QL[i, :, None, None, None]
            if starts_NHkv is not None:
                state_BHkv = state_BHkv + starts_NHkv[lanes.start_QL[i]]
        delta_BHCv = u_BHQCv[:, :, i] - w_BHQCk[:, :, i] @ state_BHkv
        outputs.append(q_read_BHQCk[:, :, i] @ state_BHkv + scores_BHQCC[:, :, i] @ delta_BHCv)
        state_BHkv = (state_BHkv * chunk_decay_BHQ[:, :, i, None, None]
                      + k_write_BHQCk[:, :, i].transpose(-1, -2) @ delta_BHCv)
        if keep_history:
            history.append(state_BHkv)
    o_BHTv = torch.cat(outputs, dim=2)
    if lanes is None:
        return o_BHTv[:, :, :T].transpose(1, 2).to(v.dtype), state_BHkv if output_final_state else None
    o_BTHv = o_BHTv.transpose(1, 2).flatten(0, 1)[lanes.slot_T][None]
    if not output_final_state:
        return o_BTHv.to(v.dtype), None

    def final_state(d: int, chunk: int, lane: int) -> Tensor:  # an empty sequence keeps its initial state
        if chunk >= 0:
            return history[chunk][lane]
        return state_BHkv.new_zeros(state_BHkv.shape[1:]) if initial_state is None else initial_state[d].float()

    return o_BTHv.to(v.dtype), torch.stack([final_state(d, *end) for d, end in enumerate(lanes.last)])


@_per_sequence
@_fp32
def recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The recurrence token by token: same arguments and results as ``chunk_gated_delta_rule`` (no chunk_size)."""
    q_BHTk, k_BHTk, v_BHTv, g_BHT, beta_BHT = _head_major_fp32(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    state_BHkv = _initial_state(initial_state, v_BHTv, k_BHTk.shape[-1])
    outputs = []
    for t in range(q_BHTk.shape[2]):
        k_BHk = k_BHTk[:, :, t]
        state_BHkv = state_BHkv * g_BHT[:, :, t].exp()[..., None, None]
        delta_BHv = beta_BHT[:, :, t, None] * (v_BHTv[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_BHk, state_BHkv))
        state_BHkv = state_BHkv + k_BHk[..., :, None] * delta_BHv[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_BHTk[:, :, t], state_BHkv))
    o_BHTv = torch.stack(outputs, dim=2)
    return o_BHTv.transpose(1, 2).to(v.dtype), state_BHkv if output_final_state else None
