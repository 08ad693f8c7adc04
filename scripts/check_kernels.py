"""Check every selected device kernel against its torch reference on real model shapes, forward and backward.

    python scripts/check_kernels.py [--kernels auto,flash-linear-attention] [--chunk-size 64] [--device auto]

Packed-document attention: every implementation that can run (cudnn_attention, varlen_attn, flex_attention), not
only the chosen one, against the dense-mask reference on 4096-token rows of mixed-length documents (1 to 1500,
one-token ones among them; Qwen3's heads of 128 and Qwen3.5's of 256), then one timing line per implementation on one
32,768-token window of 2,048-token documents (32 query / 4 kv heads of 128, bf16, forward + backward; the documents
built outside the timed region, as the decoder builds them once per batch), beside causal SDPA on the same window
as one sequence (16x the attended pairs).

Shapes: Qwen3.5-35B-A3B (hidden 2048, DeltaNet 16 k-heads x 128 and 32 v-heads x 128, attention heads of 256 with
64 rotary channels, shared expert 512) and Qwen3-30B-A3B (heads of 128; 128 experts top-8 of intermediate 768,
16 local under ep8), 4 x 4096 tokens (2 x 4096 for the delta rule), bf16 activations and weights as under FSDP
mixed precision. The dispatch path's ops too: the permutes' K-to-one steps, the token permutes, the grouped GEMM;
and the optimizer's update with bf16 moments (optim.state_dtype=bfloat16).

Error: ``|out - ref| / |ref|`` (norm-wise) of every output and input gradient, where ``ref`` is the torch
reference run in fp32 on the same inputs; the torch reference's own bf16 error is printed beside it as the
yardstick. A kernel fails when its error exceeds the case's tolerance (stated with each case). Timings: device
events around 20 back-to-back runs after 3 warm-ups, forward and forward + backward, kernel vs the torch
reference in bf16. Exits 1 on any failure; on a CPU-only machine there is nothing to check (the references are
what runs there).
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.attention.attention import DenseMaskAttention, Documents, causal_sdpa  # noqa: E402
from kernels.config import (CUDNN_ATTENTION, FLA_OPS, FLEX_ATTENTION, VARLEN_ATTN, KernelConfig,  # noqa: E402
                            validate_kernel_config)
from kernels.registry import OPS, select_kernels  # noqa: E402
from core import device  # noqa: E402

Inputs = dict[str, torch.Tensor]
# Elementwise ops and norms round once more than the fp32 reference, ~2^-9 relative per element (bf16):
# a norm-wise error of ~3e-3; 1e-2 leaves room without letting a wrong formula through (those are O(1)).
TOL_ELEMENTWISE = 1e-2
# The chunked delta rule runs bf16 tile products (fp32 accumulation) through a 4096-step recurrence; FLA's forward
# measured 3.8e-3 on an H200 (the torch reference in bf16, i.e. its output rounding, ~1.7e-3): 2e-2 leaves room
# for the backward's longer chains.
TOL_DELTA_RULE = 2e-2


@dataclass(frozen=True)
class Case:
    name: str
    # The tensors; gradients are checked for every floating-point one (integer maps and counts are constants).
    make: Callable[[torch.Generator, torch.device], Inputs]
    call: Callable[[Callable, Inputs], torch.Tensor]  # how the model calls the op; returns the output checked
    tol: float
    backward: bool = True
    constants: tuple[str, ...] = ()  # inputs the model never differentiates (rotary tables): no gradient checked


def _randn(gen: torch.Generator, dev: torch.device, *shape: int, scale: float = 1.0, shift: float = 0.0,
           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=dev) * scale + shift).to(dtype)


def _norm_case(name: str, shape: tuple[int, ...], w_shift: float, gated: bool = False) -> Case:
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        inputs = {"x": _randn(gen, dev, *shape), "weight": _randn(gen, dev, shape[-1], scale=0.1, shift=w_shift)}
        if gated:
            inputs["z"] = _randn(gen, dev, *shape)
        return inputs

    call = ((lambda fn, t: fn(t["x"], t["z"], t["weight"], 1e-6)) if gated
            else (lambda fn, t: fn(t["x"], t["weight"], 1e-6)))
    return Case(name, make, call, TOL_ELEMENTWISE)


def _rotary_case(name: str, B: int, H: int, T: int, head_dim: int, rotary_dim: int) -> Case:
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        angle_BTr = torch.rand(B, T, rotary_dim, generator=gen, device=dev) * 6.3
        # q / k as the model passes them: [B, T, H, d] projections viewed as [B, H, T, d]
        return {"x": _randn(gen, dev, B, T, H, head_dim).transpose(1, 2), "cos": angle_BTr.cos().bfloat16(),
                "sin": angle_BTr.sin().bfloat16()}

    return Case(name, make, lambda fn, t: fn(t["x"], t["cos"], t["sin"]), TOL_ELEMENTWISE, constants=("cos", "sin"))


def _delta_inputs(gen: torch.Generator, dev: torch.device, B: int, T: int) -> Inputs:
    h, H, dk, dv = 16, 32, 128, 128  # Qwen3.5-35B-A3B DeltaNet
    a = torch.randn(B, T, H, generator=gen, device=dev)
    return {"q": _randn(gen, dev, B, T, h, dk), "k": _randn(gen, dev, B, T, h, dk), "v": _randn(gen, dev, B, T, H, dv),
            # as the model: g = -exp(A_log) * softplus(a + dt_bias) in fp32, A = U(0.01, 16) per head
            "g": -torch.empty(H, device=dev).uniform_(0.01, 16, generator=gen) * F.softplus(a + 1.0),
            "beta": torch.rand(B, T, H, generator=gen, device=dev).bfloat16()}


def _packed_delta_inputs(gen: torch.Generator, dev: torch.device, B: int, T: int, longest: int) -> Inputs:
    """Documents of 1 to ``longest`` tokens packed into B rows of T, as the loader packs real text; cu_seqlens over
    the flattened rows, every row starting a document (FLA's variable-length launch for one row,
    kernels/linear_attention/fla.py's decay reset for more)."""
    ends = torch.randint(1, longest, (B * T,), generator=gen, device=dev).cumsum(0)
    starts = torch.cat([ends.new_zeros(1), ends[ends < B * T], torch.arange(T, B * T, T, device=dev)]).unique()
    return {**_delta_inputs(gen, dev, B, T), "cu_seqlens": torch.cat([starts, starts.new_full((1,), B * T)])}


def _delta_call(fn: Callable, t: Inputs) -> torch.Tensor:
    return fn(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], use_qk_l2norm_in_kernel=True,
              cu_seqlens=t.get("cu_seqlens"))[0]


def _conv_inputs(gen: torch.Generator, dev: torch.device, B: int, T: int, packed: bool) -> Inputs:
    """DeltaNet's conv input [B, T, F] (F = 2 x 16 x 128 + 32 x 128 channels [q | k | v]) and taps [F, 4]; packed:
    documents of 1 to 1500 tokens in rows of T, with their ids and the flattened batch's cu_seqlens."""
    t = {"x": _randn(gen, dev, B, T, 8192), "w": _randn(gen, dev, 8192, 4, scale=0.5)}
    if packed:
        ends = torch.randint(1, 1500, (B * T,), generator=gen, device=dev).cumsum(0)
        starts = torch.cat([ends.new_zeros(1), ends[ends < B * T], torch.arange(T, B * T, T, device=dev)]).unique()
        t["cu_seqlens"] = torch.cat([starts, starts.new_full((1,), B * T)])
        t["ids"] = torch.zeros(B * T, dtype=torch.long, device=dev).index_fill_(0, starts, 1).cumsum(0).view(B, T)
    return t


def _conv_call(fn: Callable, t: Inputs) -> torch.Tensor:
    docs = Documents(t["ids"], t["cu_seqlens"]) if "ids" in t else None
    return fn(t["x"], t["w"], docs)


def _ce_labels(logits: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    labels = torch.arange(rows, device=logits.device) * 7919 % vocab
    return labels.masked_fill(labels % 10 == 0, -100)  # some ignored rows


def _ce_loss(fn: Callable, t: Inputs) -> torch.Tensor:
    return fn(t["logits"].clone(), _ce_labels(t["logits"]))


def _ce_grad(fn: Callable, t: Inputs) -> torch.Tensor:
    buffer = t["logits"].clone()
    fn(buffer, _ce_labels(buffer))
    return buffer


def _ce_case(name: str, call: Callable[[Callable, Inputs], torch.Tensor]) -> Case:
    # No autograd: the op returns the loss and writes the logit gradient in place (both checked as outputs).
    return Case(name, lambda gen, dev: {"logits": _randn(gen, dev, 2048, 151936, scale=4.0)}, call, TOL_ELEMENTWISE,
                backward=False)


N_TOKENS, K_TOP, G_LOCAL, D_HIDDEN, I_EXPERT = 4 * 4096, 8, 16, 2048, 768  # Qwen3-30B-A3B, one rank's tokens


def _routing(gen: torch.Generator, dev: torch.device, N: int, K: int, E: int) -> torch.Tensor:
    """experts_NK: K distinct experts per token, as top-k gives."""
    return torch.rand(N, E, generator=gen, device=dev).topk(K, dim=-1).indices


def _maps(gen: torch.Generator, dev: torch.device) -> Inputs:
    order = torch.argsort(_routing(gen, dev, N_TOKENS, K_TOP, 128).flatten(), stable=True)
    return {"order": order, "inv": torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=dev))}


def _gather_case(name: str, weighted: bool) -> Case:
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        inputs = {"src": _randn(gen, dev, N_TOKENS * K_TOP, D_HIDDEN), **_maps(gen, dev)}
        if weighted:
            inputs["weights"] = torch.rand(N_TOKENS, K_TOP, generator=gen, device=dev).bfloat16()
        return inputs

    # Not autograd functions: the outputs are compared (the unpermute forward / the permute backward).
    return Case(name, make, lambda fn, t: fn(t["src"], t["inv"], N_TOKENS, K_TOP, t.get("weights")),
                TOL_ELEMENTWISE, backward=False)


def _gather_quantize_case(name: str) -> Case:
    """train.float8's dispatch gather: the routed rows of N_TOKENS x K_TOP in expert order, 16 rows of padding
    (-1) after each 1024, as e4m3 rows and scales; compared dequantised (data / scale)."""
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        rows = (_maps(gen, dev)["order"] // K_TOP).view(-1, 1024)
        pad = torch.full((rows.shape[0], 16), -1, device=dev, dtype=rows.dtype)
        return {"src": _randn(gen, dev, N_TOKENS, D_HIDDEN), "index": torch.cat([rows, pad], 1).flatten()}

    def call(fn: Callable, t: Inputs) -> torch.Tensor:
        data, scale = fn(t["src"], t["index"])
        return data.float() / scale

    return Case(name, make, call, TOL_ELEMENTWISE, backward=False)


def _unpermute_backward_case(name: str, output: int) -> Case:
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        return {"grad": _randn(gen, dev, N_TOKENS, D_HIDDEN), "y": _randn(gen, dev, N_TOKENS * K_TOP, D_HIDDEN),
                "weights": torch.rand(N_TOKENS, K_TOP, generator=gen, device=dev).bfloat16(), **_maps(gen, dev)}

    return Case(name, make, lambda fn, t: fn(t["grad"], t["y"], t["weights"], t["order"], t["inv"])[output],
                TOL_ELEMENTWISE, backward=False)


def _grouped_mm_case(name: str, rows: int, o_features: int, i_features: int, empty_expert: bool = False) -> Case:
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        share = torch.rand(G_LOCAL, generator=gen, device=dev) + 0.5
        share[3] = 0 if empty_expert else share[3]
        counts = (share / share.sum() * rows).long()
        counts[0] += rows - counts.sum()
        # x [M, i] rows by local expert; w [G, o, i] as the experts store it (the model passes its transpose).
        x = _randn(gen, dev, rows, i_features)
        return {"x": x, "w": _randn(gen, dev, G_LOCAL, o_features, i_features, scale=0.02), "counts": counts}

    return Case(name, make, lambda fn, t: fn(t["x"], t["w"].transpose(-2, -1), t["counts"]), TOL_ELEMENTWISE)


def _token_inputs(gen: torch.Generator, dev: torch.device) -> Inputs:
    return {"x": _randn(gen, dev, N_TOKENS, D_HIDDEN), "experts": _routing(gen, dev, N_TOKENS, K_TOP, 128),
            "weights": torch.rand(N_TOKENS, K_TOP, generator=gen, device=dev).bfloat16()}


def _round_trip(permute: Callable, unpermute: Callable) -> Callable:
    """An unpermute reads its own permute's state, so the two are checked together: x -> K rows -> weighted sum."""
    def fn(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        x_MD, state = permute(x, experts)
        return unpermute(x_MD, weights, state)

    return fn


PAIRED = {"moe_token_unpermute": "moe_token_permute"}  # op -> the op whose state it reads

ATTENTION_HEADS, ATTENTION_KV_HEADS, ATTENTION_DIM = 32, 4, 128  # Qwen3-30B-A3B


def _document_ids(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """[T] document index of each token, for documents of ``lengths`` (cut at T)."""
    ends = lengths.cumsum(0)
    return torch.searchsorted(ends[ends < T], torch.arange(T, device=lengths.device), right=True)


def _attention_inputs(gen: torch.Generator, dev: torch.device, B: int, T: int, mixed: bool,
                      heads: tuple[int, int, int] = (ATTENTION_HEADS, ATTENTION_KV_HEADS, ATTENTION_DIM)) -> Inputs:
    """q [B, H, T, d], k and v [B, h, T, d] for ``heads`` (H, h, d); documents of 1 to 1500 tokens (every 7th of
    one token) or of 2,048."""
    if mixed:
        lengths = torch.randint(1, 1500, (B, T), generator=gen, device=dev)
        lengths[:, ::7] = 1
        ids_BT = torch.stack([_document_ids(row, T) for row in lengths])
    else:
        ids_BT = (torch.arange(T, device=dev) // 2048).expand(B, T)
    H, h, d = heads
    return {"q": _randn(gen, dev, B, H, T, d), "k": _randn(gen, dev, B, h, T, d), "v": _randn(gen, dev, B, h, T, d),
            "ids": ids_BT}


def _attention_call(fn: Callable, t: Inputs) -> torch.Tensor:
    return fn(t["q"], t["k"], t["v"], fn.documents(t["ids"]), t["q"].shape[-1]**-0.5)


ATTENTION_CASES = [
    Case("qwen3 32/4 x 128, 2 x 4096 mixed docs", lambda gen, dev: _attention_inputs(gen, dev, 2, 4096, mixed=True),
         _attention_call, TOL_ELEMENTWISE),
    # Qwen3.5-35B-A3B's full-attention heads of 256 (the kernels' largest head dim)
    Case("qwen3.5 16/2 x 256, 4096 mixed docs",
         lambda gen, dev: _attention_inputs(gen, dev, 1, 4096, mixed=True, heads=(16, 2, 256)), _attention_call,
         TOL_ELEMENTWISE),
]


def check_attention(dev: torch.device, cfg: KernelConfig) -> list[str]:
    """Every document-attention implementation that runs here against the dense mask, then one timing line each on
    a 32k window of 2,048-token documents. Returns the failures."""
    failed, timed = [], {"torch dense mask": DenseMaskAttention()}
    for name in (CUDNN_ATTENTION, VARLEN_ATTN, FLEX_ATTENTION):
        try:
            kernel = select_kernels(replace(cfg, attention=name), dev.type).get("document_attention")
        except ValueError as error:
            print(f"  document_attention {name}: skipped: {error}")
            continue
        for case in ATTENTION_CASES:
            if not check_case(f"document_attention {name}", kernel, DenseMaskAttention(), case, dev):
                failed.append(f"document_attention {name} [{case.name}]")
            device.module(dev.type).empty_cache()
        timed[name] = kernel
    gen = torch.Generator(device=dev).manual_seed(0)
    t = _attention_inputs(gen, dev, 1, 32768, mixed=False)
    q, k, v = (t[x].requires_grad_() for x in "qkv")
    grad_out = torch.randn_like(q)
    scale = ATTENTION_DIM**-0.5
    steps = {name: functools.partial(fn, q, k, v, fn.documents(t["ids"]), scale) for name, fn in timed.items()}
    steps["causal sdpa, one 32k sequence"] = functools.partial(causal_sdpa, q, k, v, scale)
    for name, call in steps.items():
        fwd = device.time_ms(dev.type, call)
        bwd = device.time_ms(dev.type, lambda call=call: torch.autograd.grad(call(), (q, k, v), grad_out))
        print(f"  document_attention 32k window, 2,048-token docs: {name:30s} fwd {fwd:8.2f} ms  fwd+bwd {bwd:8.2f} ms")
        device.module(dev.type).empty_cache()
    return failed


def _adamw_case(name: str, output: int, moments: torch.dtype = torch.bfloat16) -> Case:
    """A 4M-parameter update at step 10 with ``moments`` (fp32 p and g) on a step that clips (the gradient scaled by
    0.5 inside the update) and writes p's bf16 compute copy; ``output``: 0 the change of p, 1 exp_avg, 2 exp_avg_sq
    (each checked on its own: the moments are ~1e-4 of p), 3 the copy."""
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        n = 1 << 22
        return {"p": _randn(gen, dev, n, dtype=torch.float32), "g": _randn(gen, dev, n, scale=1e-2, dtype=torch.float32),
                "m": _randn(gen, dev, n, scale=1e-2, dtype=moments),
                "v": _randn(gen, dev, n, scale=1e-2, dtype=moments).square()}

    def call(fn: Callable, t: Inputs) -> torch.Tensor:
        p, m, v = t["p"].clone(), t["m"].clone(), t["v"].clone()
        p_copy = torch.empty_like(p, dtype=torch.bfloat16)
        fn(p, t["g"], m, v, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=10.0, grad_scale=0.5,
           p_copy=p_copy)
        return (p - t["p"], m, v, p_copy)[output].float()

    return Case(name, make, call, TOL_ELEMENTWISE, backward=False)


def _cast_case(name: str, divide_by: float) -> Case:
    """A 4M-element bf16 gradient to fp32, divided by ``divide_by``: exact (tolerance 0), as the reference."""
    return Case(name, lambda gen, dev: {"g": _randn(gen, dev, 1024, 4096)},
                lambda fn, t: fn(t["g"], torch.float32, (4096, 1), divide_by), 0.0, backward=False)


CASES: dict[str, list[Case]] = {
    "rms_norm": [_norm_case("qwen3 hidden 2048", (4 * 4096, 2048), 1.0),
                 _norm_case("qwen3 q_norm 32 x 128", (4, 4096, 32, 128), 1.0)],
    "offset_rms_norm": [_norm_case("qwen3.5 hidden 2048", (4 * 4096, 2048), 0.0),
                        _norm_case("qwen3.5 q_norm 16 x 256", (4, 4096, 16, 256), 0.0)],
    "gated_rms_norm": [_norm_case("qwen3.5 deltanet 32 x 128", (4, 4096, 32, 128), 1.0, gated=True)],
    "swiglu": [Case("qwen3.5 shared expert 512",
                    lambda gen, dev: {"gate": _randn(gen, dev, 4 * 4096, 512), "up": _randn(gen, dev, 4 * 4096, 512)},
                    lambda fn, t: fn(t["gate"], t["up"]), TOL_ELEMENTWISE)],
    "softmax_cross_entropy": [_ce_case("qwen3 vocab 151936, loss", _ce_loss),
                              _ce_case("qwen3 vocab 151936, grad", _ce_grad)],
    "packed_swiglu": [Case("qwen3 experts 65536 rows x 2 x 768",
                           lambda gen, dev: {"gate_up": _randn(gen, dev, 65536, 2 * 768)},
                           lambda fn, t: fn(t["gate_up"]), TOL_ELEMENTWISE)],
    "apply_rotary": [_rotary_case("qwen3.5 16 x 256, 64 rotary", 4, 16, 4096, 256, 64),
                     _rotary_case("qwen3 32 x 128, full", 4, 32, 4096, 128, 128)],
    "chunk_gated_delta_rule": [Case("qwen3.5 2 x 4096", lambda gen, dev: _delta_inputs(gen, dev, 2, 4096),
                                    _delta_call, TOL_DELTA_RULE),
                               Case("qwen3.5 packed docs 8192",
                                    lambda gen, dev: _packed_delta_inputs(gen, dev, 1, 8192, 1500), _delta_call,
                                    TOL_DELTA_RULE),
                               Case("qwen3.5 packed chat 4 x 4096",
                                    lambda gen, dev: _packed_delta_inputs(gen, dev, 4, 4096, 400), _delta_call,
                                    TOL_DELTA_RULE)],
    "causal_conv1d_silu": [Case("qwen3.5 4 x 4096", lambda gen, dev: _conv_inputs(gen, dev, 4, 4096, False),
                                _conv_call, TOL_ELEMENTWISE),
                           Case("qwen3.5 packed docs 4 x 4096", lambda gen, dev: _conv_inputs(gen, dev, 4, 4096, True),
                                _conv_call, TOL_ELEMENTWISE)],
    # FLA's recurrent kernel has no backward; the model uses it only without autograd, on short sequences.
    "fused_recurrent_gated_delta_rule": [Case("qwen3.5 8 x 64", lambda gen, dev: _delta_inputs(gen, dev, 8, 64),
                                              _delta_call, TOL_DELTA_RULE, backward=False)],
    "gather_sum": [_gather_case("qwen3 16k tokens top-8, weighted", True),
                   _gather_case("qwen3 16k tokens top-8", False)],
    "gather_quantize_rows": [_gather_quantize_case("qwen3 16k tokens top-8, e4m3 rows")],
    "unpermute_backward": [_unpermute_backward_case("qwen3 16k tokens top-8, grad_y", 0),
                           _unpermute_backward_case("qwen3 16k tokens top-8, grad_w", 1)],
    "moe_token_permute": [Case("qwen3 16k tokens top-8", _token_inputs,
                               lambda fn, t: fn(t["x"], t["experts"])[0], TOL_ELEMENTWISE, constants=("weights",))],
    "moe_token_unpermute": [Case("qwen3 16k tokens top-8, round trip", _token_inputs,
                                 lambda fn, t: fn(t["x"], t["experts"], t["weights"]), TOL_ELEMENTWISE)],
    # Local experts' GEMMs under ep8: gate_up [M, D] x [16, 2I, D]^T, down [M, I] x [16, D, I]^T.
    "grouped_mm": [_grouped_mm_case("qwen3 ep8 gate_up, 64k rows", 65536, 2 * I_EXPERT, D_HIDDEN),
                   _grouped_mm_case("qwen3 ep8 down, 64k rows", 65536, D_HIDDEN, I_EXPERT),
                   _grouped_mm_case("qwen3 ep8 gate_up, an idle expert", 65536, 2 * I_EXPERT, D_HIDDEN, True)],
    "cast_gradient": [_cast_case("4M bf16 -> fp32", 1.0), _cast_case("4M bf16 -> fp32, divided by 3", 3.0)],
    "adamw_step": [*(_adamw_case(f"4M params, {label} moments, {what}", i, dtype)
                     for label, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))
                     for i, what in enumerate(("dp", "m", "v"))),
                   _adamw_case("4M params, bf16 moments, bf16 copy of p", 3)],
}


def _checked(t: torch.Tensor, name: str, case: Case) -> bool:
    return t.is_floating_point() and name not in case.constants


def _run(fn: Callable, case: Case, inputs: Inputs, grad_out: torch.Tensor | None) -> list[torch.Tensor]:
    """The output and (if ``grad_out``) every input's gradient, in fp32."""
    leaves = {name: t.detach().clone().requires_grad_(grad_out is not None and _checked(t, name, case))
              for name, t in inputs.items()}
    out = case.call(fn, leaves)
    if grad_out is None:
        return [out.detach().float()]
    out.backward(grad_out.to(out.dtype))
    return [out.detach().float(), *(leaf.grad.float() for name, leaf in leaves.items() if _checked(leaf, name, case))]


def _time_ms(dev_type: str, fn: Callable, case: Case, inputs: Inputs, grad_out: torch.Tensor | None) -> float:
    """Mean time of one call (and backward, with ``grad_out``) over 20 back-to-back runs, as a training step issues
    them: the host is not synchronised in between, so a kernel's launch overhead counts only where it exceeds the
    device time."""
    leaves = [t.detach().requires_grad_(grad_out is not None and _checked(t, name, case))
              for name, t in inputs.items()]
    named = dict(zip(inputs, leaves))

    def step() -> None:
        out = case.call(fn, named)
        if grad_out is not None:
            torch.autograd.grad(out, [leaf for leaf in leaves if leaf.requires_grad], grad_out.to(out.dtype))

    return device.time_ms(dev_type, step)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_case(op: str, kernel: Callable, reference: Callable, case: Case, dev: torch.device) -> bool:
    gen = torch.Generator(device=dev).manual_seed(0)
    inputs = case.make(gen, dev)
    probe = case.call(reference, inputs)
    grad_out = torch.randn(probe.shape, generator=gen, device=dev) if case.backward else None
    ref32 = _run(reference, case, {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}, grad_out)
    ref16 = _run(reference, case, inputs, grad_out)
    got = _run(kernel, case, inputs, grad_out)
    grads = [f"d{name}" for name, t in inputs.items() if _checked(t, name, case)] if case.backward else []
    names = ["out", *grads]
    ok = True
    for name, g, r16, r32 in zip(names, got, ref16, ref32):
        err, err16 = _rel(g, r32), _rel(r16, r32)
        max_abs = (g - r32).abs().max().item()
        status = "ok" if err <= case.tol else "FAIL"
        ok &= err <= case.tol
        print(f"  {op:34s} {case.name:28s} {name:8s} rel {err:.2e} (torch bf16 {err16:.2e}, tol {case.tol:.0e}) "
              f"max|diff| {max_abs:.2e}  {status}")

    for mode, backward in [("fwd", False), ("fwd+bwd", True)] if case.backward else [("fwd", False)]:
        g = grad_out if backward else None
        print(f"  {op:34s} {case.name:28s} {mode:8s} kernel {_time_ms(dev.type, kernel, case, inputs, g):8.3f} ms   "
              f"torch bf16 {_time_ms(dev.type, reference, case, inputs, g):8.3f} ms")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default="auto,flash-linear-attention", help="kernel_config.name")
    parser.add_argument("--chunk-size", type=int, default=64, help="kernel_config.chunk_size")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or npu")
    parser.add_argument("--ops", default="", help="comma-separated ops to check (default: every selected one)")
    args = parser.parse_args(argv)
    cfg = KernelConfig(name=args.kernels, include_kernels=list(FLA_OPS), chunk_size=args.chunk_size)
    validate_kernel_config(cfg)
    dev_type = device.device_type(args.device)
    if dev_type == "cpu":
        print("cpu: nothing to check (the torch references are the cpu kernels)")
        return 0
    dev = device.local_device(dev_type)
    kernels = select_kernels(cfg, dev_type)
    for line in kernels.lines():
        print(f"kernel {line}")
    failed = []
    only = {op for op in args.ops.split(",") if op}
    unknown = only - set(OPS)
    if unknown:
        parser.error(f"--ops: unknown {sorted(unknown)}; valid: {', '.join(OPS)}")
    for op, choice in kernels.choices.items():
        if op == "document_attention" or choice.impl == "torch" or (only and op not in only):
            continue
        kernel, reference = kernels.get(op), OPS[op].reference(cfg)
        if op in PAIRED:
            kernel = _round_trip(kernels.get(PAIRED[op]), kernel)
            reference = _round_trip(OPS[PAIRED[op]].reference(cfg), reference)
        for case in CASES[op]:
            if not check_case(op, kernel, reference, case, dev):
                failed.append(f"{op} [{case.name}]")
            device.module(dev_type).empty_cache()
    if not only or "document_attention" in only:
        failed += check_attention(dev, cfg)
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    print("all selected kernels match their torch references")
    return 0


if __name__ == "__main__":
    sys.exit(main())
