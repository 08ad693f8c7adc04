"""The flash-linear-attention (FLA) plugin: FLA's Triton gated delta rule kernels, imported only when chosen.

FLA's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` take the same arguments as the torch
references in ``kernels/linear_attention/delta_rule.py``, so they drop into ``GatedDeltaNet``'s kernel slots as
they are.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Callable

import torch

from core.device import queued_copy

# On NPU, FLA's Triton kernels compile with triton-ascend, which no extra of ours installs (.[gpu] is for CUDA).
PIP_HINTS = {"cuda": "pip install '.[gpu]'",
             "npu": "pip install 'flash-linear-attention>=0.6,<0.7' triton-ascend (the release for your CANN)"}
# FLA #640: these Triton versions miscompile the gated chunk_bwd_dqkwg kernel on Hopper (sm_90) GPUs, so the
# chunked delta rule's backward is wrong there (FLA >= 0.6 raises instead; older FLA returned wrong gradients).
_BAD_TRITON = ((3, 4, 0), (3, 7, 1))  # [first bad, first fixed)


def missing_error(device_type: str) -> ImportError:
    hint = PIP_HINTS.get(device_type, PIP_HINTS["cuda"])
    return ImportError(f"kernel_config.name includes flash-linear-attention, but the package is not installed: "
                       f"{hint} (or drop flash-linear-attention from kernel_config.name)")


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def chunk_backward_broken(triton_version: str | None, capability: tuple[int, int] | None) -> str | None:
    """Why FLA's chunked delta rule must not run with this Triton on this GPU (None: it may)."""
    if triton_version is None or capability is None or capability[0] != 9:
        return None
    first_bad, first_fixed = _BAD_TRITON
    if not first_bad <= _version_tuple(triton_version) < first_fixed:
        return None
    return (f"triton {triton_version} on a Hopper GPU (sm_{capability[0]}{capability[1]}) computes FLA's gated "
            "chunk backward (chunk_bwd_dqkwg) wrongly (FLA #640: triton >= 3.4.0 and < 3.7.1); "
            "upgrade triton to >= 3.7.1 to use the FLA kernel")


def first_call_note() -> str:
    """What a run that chose FLA should expect of its first step, and where the cost is cached."""
    cache = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    return ("flash-linear-attention compiles and autotunes its Triton kernels at their first call, so the first "
            "step can take minutes (2 to 4 on an H200 with packed documents); Triton keeps the kernels and the "
            f"autotune results in {cache} (TRITON_CACHE_DIR), and later runs that find them start in seconds")


# FLA's causal_conv1d tiles packed rows in chunks of 64 (its default; the wrapper below passes no other).
CONV_CHUNK = 64


@functools.lru_cache(maxsize=4)  # keyed on the host tensor itself: one forward's layers share one build
def host_chunk_indices(cu_seqlens_cpu: torch.Tensor, chunk_size: int, dev: torch.device) -> torch.Tensor:
    """FLA's ``chunk_indices`` (each chunk's sequence and its index within it, as ``prepare_chunk_indices`` builds
    them) from the offsets as the host knows them, queued to ``dev``. FLA would otherwise read ``cu_seqlens`` back,
    or, given ``cu_seqlens_cpu``, copy its result from pageable memory: a host sync either way."""
    counts_n = (cu_seqlens_cpu.diff() + chunk_size - 1) // chunk_size
    sequence_N = torch.repeat_interleave(torch.arange(len(counts_n)), counts_n)
    first_N = torch.repeat_interleave(counts_n.cumsum(0) - counts_n, counts_n)
    indices_N2 = torch.stack([sequence_N, torch.arange(len(sequence_N)) - first_N], 1).to(cu_seqlens_cpu.dtype)
    return queued_copy(indices_N2, dev)


# A document's first token gets this log decay in place of its own. The gated rule's decay is g <= 0 at every token
# (the model's -exp(A) softplus(.)), so the state carried into the document, and every pair of tokens across its
# start, is scaled by at most exp(-128), which is 0 in fp32 (below its smallest subnormal, e^-103): the document
# starts from an empty state, as in a sequence of its own. That token's own g only ever scales that empty state, so
# its gradient is 0 either way (index_fill gives it none). 128 rather than more: the decays of the tokens after it
# in its chunk are differences of cumulative sums about 128 lower, and 128 costs them ~1e-5 of fp32 precision.
DOCUMENT_RESET_G = -128.0
# The reset launch runs each row as one sequence: FLA's state pass is sequential over a row's chunks and parallel
# over rows x value heads, so it pays only with enough rows to fill the GPU (measured on an H200, Qwen3.5's 32
# value heads: docs/results.md#kernels-alone, row 32); fewer rows take FLA's variable-length launch.
RESET_MIN_ROWS = 2


def documents_as_decay_reset(g_BTH: torch.Tensor, cu_seqlens_n1: torch.Tensor) -> torch.Tensor:
    """The gate ``g`` of packed documents with every document's first token reset (``cu_seqlens`` over the
    flattened B x T tokens)."""
    return g_BTH.flatten(0, 1).index_fill(0, cu_seqlens_n1[:-1], DOCUMENT_RESET_G).view_as(g_BTH)


def chunk_gated_delta_rule(chunk_size: int) -> Callable:
    """FLA's chunked rule, taking packed documents as the torch reference does: ``cu_seqlens`` over the flattened
    B x T tokens, every row starting a document.

    With at least ``RESET_MIN_ROWS`` rows, FLA's launch for B sequences, each document's start reset through the
    decay (``documents_as_decay_reset``): FLA's variable-length launch tiles every document in chunks of its own,
    and a document's last chunk is partial (4k chat windows: 15% more chunks). Else that variable-length launch,
    with ``chunk_indices`` from ``host_chunk_indices`` where the host knows the offsets (``cu_seqlens_cpu``)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    def rule(q, k, v, g, beta, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        kwargs["chunk_size"] = chunk_size
        if cu_seqlens is None:
            return fla_chunk(q, k, v, g=g, beta=beta, **kwargs)
        if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            raise NotImplementedError("FLA's chunked delta rule over packed documents (cu_seqlens) takes no "
                                      "initial_state or output_final_state here (only training runs it so)")
        if q.shape[0] >= RESET_MIN_ROWS:
            return fla_chunk(q, k, v, g=documents_as_decay_reset(g, cu_seqlens), beta=beta, **kwargs)
        if cu_seqlens_cpu is not None:
            kwargs["chunk_indices"] = host_chunk_indices(cu_seqlens_cpu, chunk_size, cu_seqlens.device)
        o_1NHv, _ = fla_chunk(*(x.flatten(0, 1)[None] for x in (q, k, v)), g=g.flatten(0, 1)[None],
                              beta=beta.flatten(0, 1)[None], cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                              **kwargs)
        return o_1NHv.view(*v.shape[:2], *o_1NHv.shape[2:]), None

    return rule


def wide_dqkwg_tiles(head_k: int, head_v: int) -> bool:
    """Whether FLA's Hopper launch of ``chunk_bwd_dqkwg`` tiles both head dims 128 wide (it tiles ``min(2^ceil(log2
    d), 128)``): FLA #640's bisection on Hopper with the bad Tritons found only 64-wide tiles wrong (32 and 128
    right), and FLA's own kernel at 128 matched the torch step on an H200 with triton 3.6 (docs/kernels.md)."""
    return head_k > 64 and head_v > 64


def chunk_gated_delta_rule_hopper_safe(chunk_size: int) -> Callable:
    """FLA's chunked delta rule on Hopper with the Tritons of FLA #640, which miscompile its ``chunk_bwd_dqkwg``
    backward step at 64-wide tiles: that step runs FLA's own kernel where both head dims tile 128 wide, else
    ``kernels/linear_attention/fla_dqkwg.py`` in torch.

    FLA refuses its kernel on these Tritons whatever the tile, so the step goes through FLA's backend registry
    (``fla.backends``, as FLA's TileLang replacement of this very step does): a backend of ours swaps that step
    alone, in this process, and every other FLA kernel, forward and backward, still runs as FLA's."""
    register_hopper_dqkwg()
    return chunk_gated_delta_rule(chunk_size)


def _launch_wide_dqkwg(q, k, v, do, h, dh, w, g, dv, scale, cu_seqlens, chunk_size, chunk_indices):
    """The launch FLA's ``chunk_bwd_dqkwg`` (fla/ops/common/chunk_o.py) makes on Hopper, less its #640 refusal:
    tiles of 128. Only for head dims that ``wide_dqkwg_tiles`` accepts."""
    import triton
    from fla.ops.common.chunk_o import chunk_bwd_kernel_dqkwg

    B, T, H, K, V, J = *k.shape, v.shape[-1], v.shape[2]
    num_chunks = triton.cdiv(T, chunk_size) if cu_seqlens is None else len(chunk_indices)
    BK = BV = 128
    NK = triton.cdiv(K, BK)
    dq, dk = q.new_empty(B, T, J, K), k.new_empty(B, T, J, K)
    dg = torch.empty(NK, *g.shape, dtype=torch.float32, device=g.device)
    dw = torch.empty_like(w)
    chunk_bwd_kernel_dqkwg[(NK * num_chunks, B * J)](
        q=q, k=k, v=v, g=g, g_gamma=None, h=h, do=do, dh=dh, dq=dq, dk=dk, dw=dw, dv=dv, dg=dg,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, B=B, T=T, H=H, HV=J, K=K, V=V,
        BT=chunk_size, BK=BK, BV=BV, STATE_V_FIRST=False)
    if H != J:  # a q/k head's gradient sums over the value heads it serves
        dq, dk = dq.view(B, T, H, J // H, K).sum(3), dk.view(B, T, H, J // H, K).sum(3)
    return dq, dk, dw, dg.sum(0)


@functools.cache
def register_hopper_dqkwg() -> None:
    """Register, once per process, the FLA backend that runs the gated ``chunk_bwd_dqkwg`` #640-safe (any caller of
    FLA's chunked delta rule in this process then gets it: ours, and scripts/bench_vlm.py's transformers row)."""
    from fla.backends import BaseBackend, register
    from fla.ops.utils.index import prepare_chunk_indices

    from kernels.linear_attention import fla_dqkwg

    class HopperDqkwgBackend(BaseBackend):
        backend_type = "qwen_moe_hopper_dqkwg"
        priority = 0  # before FLA's own choices (TileLang, where installed): this is what the registry chose

        def chunk_bwd_dqkwg_verifier(self, q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None,
                                     state_v_first=False, **kwargs) -> tuple[bool, str | None]:
            if g is None or g_gamma is not None or w is None or dv is None or state_v_first:
                return False, "only the gated delta rule's step (g, w, dv; state_v_first=False) is handled here"
            return True, None

        def chunk_bwd_dqkwg(self, q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                            state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None):
            if cu_seqlens is not None and chunk_indices is None:
                chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
            step = (_launch_wide_dqkwg if wide_dqkwg_tiles(k.shape[-1], v.shape[-1])
                    else fla_dqkwg.chunk_bwd_dqkwg)
            return step(q, k, v, do, h, dh, w, g, dv, k.shape[-1] ** -0.5 if scale is None else scale,
                        cu_seqlens, chunk_size, chunk_indices)

    register("common")(HopperDqkwgBackend)


def causal_conv1d_silu() -> Callable:
    """FLA's Triton short convolution with its silu fused (``kernels/linear_attention/short_conv.py``'s signature):
    packed documents run as FLA's variable-length sequences of a batch of one (``cu_seqlens``), as the delta rule takes
    them."""
    from fla.modules.causal_conv1d import causal_conv1d

    def conv(x_BTF, w_FW, docs):
        if docs is None:
            return causal_conv1d(x_BTF, w_FW, activation="silu")[0]
        host = docs.host_cu_seqlens_n1
        indices = None if host is None else host_chunk_indices(host, CONV_CHUNK, x_BTF.device)
        y_1NF, _ = causal_conv1d(x_BTF.flatten(0, 1)[None], w_FW, activation="silu", cu_seqlens=docs.cu_seqlens_n1,
                                 chunk_indices=indices)
        return y_1NF.view_as(x_BTF)

    return conv


def fused_recurrent_gated_delta_rule() -> Callable:
    """Forward only: FLA's recurrent kernel has no backward (the model uses it only without autograd)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

    return fla_recurrent
