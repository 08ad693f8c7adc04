"""Check every device kernel against its torch reference on this GPU (or NPU), forward and backward.

    python scripts/check_kernels.py [--full] [--list] [--ops rms_norm,...] [--kernels auto,flash-linear-attention]
                                    [--chunk-size 64] [--device auto]

--kernels: the kernel_config.name whose kernels are checked; by default ``auto``, what the training default
(kernel_config=auto) can run: about 53 s from cold caches on an H100 (docs/results.md, "The house"). The Qwen3.5
rows' FLA delta rule (kernel_config=auto_fla) is ``--kernels auto,flash-linear-attention``: 246 s from cold caches,
192 s of it FLA's own first autotune of its chunked rule and short convolution, which the first training step with
FLA pays the same; 39 s once Triton's cache holds it.

What is checked: every implementation that kernels/registry.py can choose on this device under --kernels, not only
the one it prefers (DeltaNet's short convolution: FLA's and ours; packed-document attention: cudnn_attention,
varlen_attn and flex_attention, against the dense-mask reference); one that cannot run here is named with why.

Default (the quickstart's check; no timings): each op and implementation on small, awkward shapes: odd token
counts and sizes that are no power of two (999 rows of 1,500 channels, 5 heads of 100, 77 rows of Qwen3's 151,936-word
vocabulary, 2 x 1,000 tokens of packed documents, one-token ones among them, for the delta rule, the short convolution
and attention), ragged expert counts with an idle expert; bf16, and fp32 too where the kernel takes it
(train.mixed_precision=fp32: the norms, SwiGLUs, rotary, the cross-entropy step, the dispatch path's gathers, AdamW's
moments). The delta rule has one case, so FLA compiles and autotunes its chunked kernels once (--full adds its
variable-length launch, autotuned again). Each check prints its wall time, its kernels' first compile and autotune
included, and the run its total and slowest checks: a cold run is mostly FLA's first autotune (about 120
configurations for the chunked rule's forward and backward); Triton keeps the kernels and autotune results in its cache
(TRITON_CACHE_DIR) for the next run.

--full adds the model shapes, with timing lines: Qwen3.5-35B-A3B (hidden 2048, DeltaNet 16 k-heads x 128 and 32
v-heads x 128, attention heads of 256 with 64 rotary channels, shared expert 512) and Qwen3-30B-A3B (heads of 128;
128 experts top-8 of intermediate 768, 16 local under ep8), 4 x 4096 tokens (2 x 4096 for the delta rule), bf16
activations and weights as under FSDP mixed precision; the dispatch path's ops (the permutes' K-to-one steps, the
token permutes, the grouped GEMM) and the optimizer's update with bf16 moments (optim.state_dtype=bfloat16).
Packed-document attention on 4096-token rows of mixed-length documents (1 to 1500, one-token ones among them; Qwen3's
heads of 128 and Qwen3.5's of 256), then one timing line per implementation on one 32,768-token window of 2,048-token
documents (32 query / 4 kv heads of 128, bf16, forward + backward; the documents built outside the timed region, as
the decoder builds them once per batch), beside causal SDPA on the same window as one sequence (16x the attended
pairs). Minutes: FLA autotunes again for its variable-length launch, FlexAttention compiles per shape.

--list prints the checks that would run (op, implementation, case) and exits; on a machine without an accelerator,
those of an H100 with triton, flash-linear-attention and cudnn-frontend installed.

Error: ``|out - ref| / |ref|`` (norm-wise) of every output and input gradient, where ``ref`` is the torch
reference run in fp32 on the same inputs; the torch reference's own error on the inputs' dtype is printed beside it
as the yardstick. A kernel fails when its error exceeds the case's tolerance (stated with each case). Timings
(--full): device events around 20 back-to-back runs after 3 warm-ups, forward and forward + backward, kernel vs the
torch reference on the same inputs. Exits 1 on any failure; on a CPU-only machine there is nothing to check (the
references are what runs there).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

STARTED = time.perf_counter()  # before torch's import: the start-up line counts it

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.attention.attention import Documents, causal_sdpa  # noqa: E402
from kernels.config import FLA, FLA_OPS, KernelConfig, plugin_names, validate_kernel_config  # noqa: E402
from kernels.registry import OPS, Env, Impl, select_kernels  # noqa: E402
from core import device  # noqa: E402

Inputs = dict[str, torch.Tensor]
# Elementwise ops and norms round once more than the fp32 reference, ~2^-9 relative per element (bf16):
# a norm-wise error of ~3e-3; 1e-2 leaves room without letting a wrong formula through (those are O(1)).
TOL_ELEMENTWISE = 1e-2
# The chunked delta rule runs bf16 tile products (fp32 accumulation) through a 4096-step recurrence; FLA's forward
# measured 3.8e-3 on an H200 (the torch reference in bf16, i.e. its output rounding, ~1.7e-3): 2e-2 leaves room
# for the backward's longer chains.
TOL_DELTA_RULE = 2e-2
BF16, FP32 = torch.bfloat16, torch.float32
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
# What --list lists on a machine without an accelerator: an H100 with the .[gpu] extra (triton, FLA, cudnn-frontend).
ASSUMED_CUDA = Env("cuda", triton_version="3.7.1", capability=(9, 0), fla_version="0.6.0",
                   cudnn_frontend_version="1.14.0", cudnn_version=91900)


@dataclass(frozen=True)
class Case:
    name: str
    # The tensors; gradients are checked for every floating-point one (integer maps and counts are constants).
    make: Callable[[torch.Generator, torch.device], Inputs]
    call: Callable[[Callable, Inputs], torch.Tensor]  # how the model calls the op; returns the output checked
    tol: float
    backward: bool = True
    constants: tuple[str, ...] = ()  # inputs the model never differentiates (rotary tables): no gradient checked
    default: bool = False  # in the default run (small, awkward shapes); --full runs every case


def _randn(gen: torch.Generator, dev: torch.device, *shape: int, scale: float = 1.0, shift: float = 0.0,
           dtype: torch.dtype = BF16) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=dev) * scale + shift).to(dtype)


def _norm_case(name: str, shape: tuple[int, ...], w_shift: float, gated: bool = False, dtype: torch.dtype = BF16,
               default: bool = False) -> Case:
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        inputs = {"x": _randn(gen, dev, *shape, dtype=dtype),
                  "weight": _randn(gen, dev, shape[-1], scale=0.1, shift=w_shift, dtype=dtype)}
        if gated:
            inputs["z"] = _randn(gen, dev, *shape, dtype=dtype)
        return inputs

    call = ((lambda fn, t: fn(t["x"], t["z"], t["weight"], 1e-6)) if gated
            else (lambda fn, t: fn(t["x"], t["weight"], 1e-6)))
    return Case(name, make, call, TOL_ELEMENTWISE, default=default)


def _swiglu_case(name: str, rows: int, width: int, dtype: torch.dtype = BF16, default: bool = False) -> Case:
    return Case(name, lambda gen, dev: {"gate": _randn(gen, dev, rows, width, dtype=dtype),
                                        "up": _randn(gen, dev, rows, width, dtype=dtype)},
                lambda fn, t: fn(t["gate"], t["up"]), TOL_ELEMENTWISE, default=default)


def _packed_swiglu_case(name: str, rows: int, width: int, dtype: torch.dtype = BF16, default: bool = False) -> Case:
    return Case(name, lambda gen, dev: {"gate_up": _randn(gen, dev, rows, 2 * width, dtype=dtype)},
                lambda fn, t: fn(t["gate_up"]), TOL_ELEMENTWISE, default=default)


def _rotary_case(name: str, B: int, H: int, T: int, head_dim: int, rotary_dim: int, dtype: torch.dtype = BF16,
                 default: bool = False) -> Case:
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        angle_BTr = torch.rand(B, T, rotary_dim, generator=gen, device=dev) * 6.3
        # q / k as the model passes them: [B, T, H, d] projections viewed as [B, H, T, d]
        return {"x": _randn(gen, dev, B, T, H, head_dim, dtype=dtype).transpose(1, 2),
                "cos": angle_BTr.cos().to(dtype), "sin": angle_BTr.sin().to(dtype)}

    return Case(name, make, lambda fn, t: fn(t["x"], t["cos"], t["sin"]), TOL_ELEMENTWISE, constants=("cos", "sin"),
                default=default)


def _delta_inputs(gen: torch.Generator, dev: torch.device, B: int, T: int) -> Inputs:
    h, H, dk, dv = 16, 32, 128, 128  # Qwen3.5-35B-A3B DeltaNet
    a = torch.randn(B, T, H, generator=gen, device=dev)
    return {"q": _randn(gen, dev, B, T, h, dk), "k": _randn(gen, dev, B, T, h, dk), "v": _randn(gen, dev, B, T, H, dv),
            # as the model: g = -exp(A_log) * softplus(a + dt_bias) in fp32, A = U(0.01, 16) per head
            "g": -torch.empty(H, device=dev).uniform_(0.01, 16, generator=gen) * F.softplus(a + 1.0),
            "beta": torch.rand(B, T, H, generator=gen, device=dev).bfloat16()}


def _document_starts(gen: torch.Generator, dev: torch.device, B: int, T: int, longest: int) -> torch.Tensor:
    """The first token of every document of 1 to ``longest`` tokens packed into B rows of T (flattened), every row
    starting one, as the loader packs real text."""
    ends = torch.randint(1, longest, (B * T,), generator=gen, device=dev).cumsum(0)
    return torch.cat([ends.new_zeros(1), ends[ends < B * T], torch.arange(T, B * T, T, device=dev)]).unique()


def _packed_delta_inputs(gen: torch.Generator, dev: torch.device, B: int, T: int, longest: int) -> Inputs:
    """Documents of 1 to ``longest`` tokens packed into B rows of T; cu_seqlens over the flattened rows (FLA's
    variable-length launch for one row, kernels/linear_attention/fla.py's decay reset for more)."""
    starts = _document_starts(gen, dev, B, T, longest)
    return {**_delta_inputs(gen, dev, B, T), "cu_seqlens": torch.cat([starts, starts.new_full((1,), B * T)])}


def _delta_call(fn: Callable, t: Inputs) -> torch.Tensor:
    return fn(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], use_qk_l2norm_in_kernel=True,
              cu_seqlens=t.get("cu_seqlens"))[0]


def _conv_inputs(gen: torch.Generator, dev: torch.device, B: int, T: int, packed: bool, longest: int = 1500) -> Inputs:
    """DeltaNet's conv input [B, T, F] (F = 2 x 16 x 128 + 32 x 128 channels [q | k | v]) and taps [F, 4]; packed:
    documents of 1 to ``longest`` tokens in rows of T, with their ids and the flattened batch's cu_seqlens."""
    t = {"x": _randn(gen, dev, B, T, 8192), "w": _randn(gen, dev, 8192, 4, scale=0.5)}
    if packed:
        starts = _document_starts(gen, dev, B, T, longest)
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


def _ce_case(name: str, call: Callable[[Callable, Inputs], torch.Tensor], rows: int = 2048,
             dtype: torch.dtype = BF16, default: bool = False) -> Case:
    # No autograd: the op returns the loss and writes the logit gradient in place (both checked as outputs).
    return Case(name, lambda gen, dev: {"logits": _randn(gen, dev, rows, 151936, scale=4.0, dtype=dtype)}, call,
                TOL_ELEMENTWISE, backward=False, default=default)


N_TOKENS, K_TOP, G_LOCAL, D_HIDDEN, I_EXPERT = 4 * 4096, 8, 16, 2048, 768  # Qwen3-30B-A3B, one rank's tokens
# The default run's awkward token count and width: an odd number of rows, and channels that are no power of two,
# span two 1,024-wide tiles (the gathers') and leave rows 8 bytes apart from 16-byte alignment (bf16).
N_ODD, D_ODD = 999, 1500


def _routing(gen: torch.Generator, dev: torch.device, N: int, K: int, E: int) -> torch.Tensor:
    """experts_NK: K distinct experts per token, as top-k gives."""
    return torch.rand(N, E, generator=gen, device=dev).topk(K, dim=-1).indices


def _maps(gen: torch.Generator, dev: torch.device, N: int = N_TOKENS) -> Inputs:
    order = torch.argsort(_routing(gen, dev, N, K_TOP, 128).flatten(), stable=True)
    return {"order": order, "inv": torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=dev))}


def _gather_case(name: str, weighted: bool, N: int = N_TOKENS, D: int = D_HIDDEN, dtype: torch.dtype = BF16,
                 default: bool = False) -> Case:
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        inputs = {"src": _randn(gen, dev, N * K_TOP, D, dtype=dtype), **_maps(gen, dev, N)}
        if weighted:
            inputs["weights"] = torch.rand(N, K_TOP, generator=gen, device=dev).to(dtype)
        return inputs

    # Not autograd functions: the outputs are compared (the unpermute forward / the permute backward).
    return Case(name, make, lambda fn, t: fn(t["src"], t["inv"], N, K_TOP, t.get("weights")),
                TOL_ELEMENTWISE, backward=False, default=default)


def _gather_quantize_case(name: str, N: int = N_TOKENS, group: int = 1024, default: bool = False) -> Case:
    """train.float8's dispatch gather: the routed rows of N x K_TOP in expert order, 16 rows of padding (-1) after
    each ``group`` (the last may be shorter), as e4m3 rows and scales; compared dequantised (data / scale)."""
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        rows = _maps(gen, dev, N)["order"] // K_TOP
        pad = torch.full((16,), -1, device=dev, dtype=rows.dtype)
        index = torch.cat([part for chunk in rows.split(group) for part in (chunk, pad)])
        return {"src": _randn(gen, dev, N, D_HIDDEN), "index": index}

    def call(fn: Callable, t: Inputs) -> torch.Tensor:
        data, scale = fn(t["src"], t["index"])
        return data.float() / scale

    return Case(name, make, call, TOL_ELEMENTWISE, backward=False, default=default)


def _unpermute_backward_case(name: str, output: int, N: int = N_TOKENS, D: int = D_HIDDEN, dtype: torch.dtype = BF16,
                             default: bool = False) -> Case:
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        return {"grad": _randn(gen, dev, N, D, dtype=dtype), "y": _randn(gen, dev, N * K_TOP, D, dtype=dtype),
                "weights": torch.rand(N, K_TOP, generator=gen, device=dev).to(dtype), **_maps(gen, dev, N)}

    return Case(name, make, lambda fn, t: fn(t["grad"], t["y"], t["weights"], t["order"], t["inv"])[output],
                TOL_ELEMENTWISE, backward=False, default=default)


def _grouped_mm_case(name: str, rows: int, o_features: int, i_features: int, empty_expert: bool = False,
                     default: bool = False) -> Case:
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        share = torch.rand(G_LOCAL, generator=gen, device=dev) + 0.5
        share[3] = 0 if empty_expert else share[3]
        counts = (share / share.sum() * rows).long()
        counts[0] += rows - counts.sum()
        # x [M, i] rows by local expert; w [G, o, i] as the experts store it (the model passes its transpose).
        x = _randn(gen, dev, rows, i_features)
        return {"x": x, "w": _randn(gen, dev, G_LOCAL, o_features, i_features, scale=0.02), "counts": counts}

    return Case(name, make, lambda fn, t: fn(t["x"], t["w"].transpose(-2, -1), t["counts"]), TOL_ELEMENTWISE,
                default=default)


def _token_case(name: str, call: Callable[[Callable, Inputs], torch.Tensor], N: int = N_TOKENS, D: int = D_HIDDEN,
                default: bool = False, **kwargs) -> Case:
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        return {"x": _randn(gen, dev, N, D), "experts": _routing(gen, dev, N, K_TOP, 128),
                "weights": torch.rand(N, K_TOP, generator=gen, device=dev).bfloat16()}

    return Case(name, make, call, TOL_ELEMENTWISE, default=default, **kwargs)


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
                      heads: tuple[int, int, int] = (ATTENTION_HEADS, ATTENTION_KV_HEADS, ATTENTION_DIM),
                      longest: int = 1500) -> Inputs:
    """q [B, H, T, d], k and v [B, h, T, d] for ``heads`` (H, h, d); documents of 1 to ``longest`` tokens (every
    7th of one token) or of 2,048."""
    if mixed:
        lengths = torch.randint(1, longest, (B, T), generator=gen, device=dev)
        lengths[:, ::7] = 1
        ids_BT = torch.stack([_document_ids(row, T) for row in lengths])
    else:
        ids_BT = (torch.arange(T, device=dev) // 2048).expand(B, T)
    H, h, d = heads
    return {"q": _randn(gen, dev, B, H, T, d), "k": _randn(gen, dev, B, h, T, d), "v": _randn(gen, dev, B, h, T, d),
            "ids": ids_BT}


def _attention_call(fn: Callable, t: Inputs) -> torch.Tensor:
    return fn(t["q"], t["k"], t["v"], fn.documents(t["ids"]), t["q"].shape[-1]**-0.5)


def time_attention_window(dev: torch.device, kernels: dict[str, Callable], reference: Callable) -> None:
    """One timing line per document-attention implementation on a 32k window of 2,048-token documents, beside the
    dense mask and causal SDPA on the window as one sequence (--full)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    t = _attention_inputs(gen, dev, 1, 32768, mixed=False)
    q, k, v = (t[x].requires_grad_() for x in "qkv")
    grad_out = torch.randn_like(q)
    scale = ATTENTION_DIM**-0.5
    timed = {"torch dense mask": reference, **kernels}
    steps = {name: functools.partial(fn, q, k, v, fn.documents(t["ids"]), scale) for name, fn in timed.items()}
    steps["causal sdpa, one 32k sequence"] = functools.partial(causal_sdpa, q, k, v, scale)
    for name, call in steps.items():
        fwd = device.time_ms(dev.type, call)
        bwd = device.time_ms(dev.type, lambda call=call: torch.autograd.grad(call(), (q, k, v), grad_out))
        print(f"  document_attention 32k window, 2,048-token docs: {name:30s} fwd {fwd:8.2f} ms  fwd+bwd {bwd:8.2f} ms")
        device.module(dev.type).empty_cache()


def _adamw_case(name: str, output: int, moments: torch.dtype = BF16, n: int = 1 << 22, default: bool = False) -> Case:
    """An ``n``-parameter update at step 10 with ``moments`` (fp32 p and g) on a step that clips (the gradient
    scaled by 0.5 inside the update) and writes p's bf16 compute copy; ``output``: 0 the change of p, 1 exp_avg,
    2 exp_avg_sq (each checked on its own: the moments are ~1e-4 of p), 3 the copy."""
    def make(gen: torch.Generator, dev: torch.device) -> Inputs:
        return {"p": _randn(gen, dev, n, dtype=FP32), "g": _randn(gen, dev, n, scale=1e-2, dtype=FP32),
                "m": _randn(gen, dev, n, scale=1e-2, dtype=moments),
                "v": _randn(gen, dev, n, scale=1e-2, dtype=moments).square()}

    def call(fn: Callable, t: Inputs) -> torch.Tensor:
        p, m, v = t["p"].clone(), t["m"].clone(), t["v"].clone()
        p_copy = torch.empty_like(p, dtype=BF16)
        fn(p, t["g"], m, v, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=10.0, grad_scale=0.5,
           p_copy=p_copy)
        return (p - t["p"], m, v, p_copy)[output].float()

    return Case(name, make, call, TOL_ELEMENTWISE, backward=False, default=default)


def _adamw_cases(label: str, n: int, default: bool = False) -> list[Case]:
    return [*(_adamw_case(f"{label}, {moments} moments, {what}", i, dtype, n, default)
              for moments, dtype in (("bf16", BF16), ("fp32", FP32)) for i, what in enumerate(("dp", "m", "v"))),
            _adamw_case(f"{label}, bf16 moments, bf16 copy of p", 3, BF16, n, default)]


def _cast_case(name: str, divide_by: float, shape: tuple[int, int] = (1024, 4096), default: bool = False) -> Case:
    """A bf16 gradient of ``shape`` to fp32, divided by ``divide_by``: exact (tolerance 0), as the reference."""
    return Case(name, lambda gen, dev: {"g": _randn(gen, dev, *shape)},
                lambda fn, t: fn(t["g"], FP32, (shape[1], 1), divide_by), 0.0, backward=False, default=default)


def _both_dtypes(make_case: Callable[..., Case], name: str, *args, **kwargs) -> list[Case]:
    """The default run's case in bf16 and in fp32 (train.mixed_precision=fp32 hands the kernel fp32)."""
    return [make_case(f"{name}, {label}", *args, dtype=dtype, default=True, **kwargs)
            for label, dtype in (("bf16", BF16), ("fp32", FP32))]


def _link_case(name: str, ms: float, sms: int, default: bool = False) -> Case:
    """The loopback world's link timer holding its stream ``ms`` on ``sms`` SMs: the output is the time the stream
    was held (device events around clock + hold) over ``ms``, about 1 for the kernel and for the reference (which
    waits on the host); 0.1 allows the timer's launch and the events' resolution."""

    def call(timer, t: Inputs) -> torch.Tensor:
        x, module = t["x"], device.module(t["x"].device.type)
        timer.hold(timer.clock(x), 0, sms, x)  # its kernels compiled (a first call's compile would be timed)
        module.synchronize()
        begin, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        begin.record()
        timer.hold(timer.clock(x), int(ms * 1e6), sms, x)
        end.record()
        end.synchronize()
        return torch.tensor([begin.elapsed_time(end) / ms], device=x.device)

    return Case(name, lambda gen, dev: {"x": _randn(gen, dev, 3, 5)}, call, 0.1, backward=False, default=default)


# Each op's cases: the default run's first (default=True: small, awkward), then the model shapes --full adds.
ODD = f"{N_ODD} tokens x {D_ODD}"
CASES: dict[str, list[Case]] = {
    "rms_norm": [*_both_dtypes(_norm_case, f"3 x 333 x {D_ODD}", (3, 333, D_ODD), 1.0),
                 _norm_case("qwen3 hidden 2048", (4 * 4096, 2048), 1.0),
                 _norm_case("qwen3 q_norm 32 x 128", (4, 4096, 32, 128), 1.0)],
    "offset_rms_norm": [*_both_dtypes(_norm_case, f"3 x 333 x {D_ODD}", (3, 333, D_ODD), 0.0),
                        _norm_case("qwen3.5 hidden 2048", (4 * 4096, 2048), 0.0),
                        _norm_case("qwen3.5 q_norm 16 x 256", (4, 4096, 16, 256), 0.0)],
    "gated_rms_norm": [*_both_dtypes(_norm_case, "3 x 333 x 5 heads x 100", (3, 333, 5, 100), 1.0, gated=True),
                       _norm_case("qwen3.5 deltanet 32 x 128", (4, 4096, 32, 128), 1.0, gated=True)],
    "swiglu": [*_both_dtypes(_swiglu_case, f"{N_ODD} rows x 500", N_ODD, 500),
               _swiglu_case("qwen3.5 shared expert 512", 4 * 4096, 512)],
    "softmax_cross_entropy": [*_both_dtypes(_ce_case, "qwen3 vocab 151936, 77 rows, loss", _ce_loss, 77),
                              *_both_dtypes(_ce_case, "qwen3 vocab 151936, 77 rows, grad", _ce_grad, 77),
                              _ce_case("qwen3 vocab 151936, loss", _ce_loss),
                              _ce_case("qwen3 vocab 151936, grad", _ce_grad)],
    "packed_swiglu": [*_both_dtypes(_packed_swiglu_case, f"{N_ODD} rows x 2 x 768", N_ODD, I_EXPERT),
                      _packed_swiglu_case("qwen3 experts 65536 rows x 2 x 768", 65536, I_EXPERT)],
    "apply_rotary": [*_both_dtypes(_rotary_case, "2 x 5 heads x 333 x 256, 64 rotary", 2, 5, 333, 256, 64),
                     _rotary_case("qwen3.5 16 x 256, 64 rotary", 4, 16, 4096, 256, 64),
                     _rotary_case("qwen3 32 x 128, full", 4, 32, 4096, 128, 128)],
    # The default's one case takes the launch of the model shapes' first (B rows, no cu_seqlens: the decay reset),
    # with a partial last chunk (1,000 = 15 x 64 + 40); --full adds FLA's variable-length launch (one row).
    "chunk_gated_delta_rule": [Case("qwen3.5 packed 2 x 1000, docs <= 400",
                                    lambda gen, dev: _packed_delta_inputs(gen, dev, 2, 1000, 400), _delta_call,
                                    TOL_DELTA_RULE, default=True),
                               Case("qwen3.5 2 x 4096", lambda gen, dev: _delta_inputs(gen, dev, 2, 4096),
                                    _delta_call, TOL_DELTA_RULE),
                               Case("qwen3.5 packed docs 8192",
                                    lambda gen, dev: _packed_delta_inputs(gen, dev, 1, 8192, 1500), _delta_call,
                                    TOL_DELTA_RULE),
                               Case("qwen3.5 packed chat 4 x 4096",
                                    lambda gen, dev: _packed_delta_inputs(gen, dev, 4, 4096, 400), _delta_call,
                                    TOL_DELTA_RULE)],
    "causal_conv1d_silu": [Case("qwen3.5 packed 2 x 1000, docs <= 400",
                                lambda gen, dev: _conv_inputs(gen, dev, 2, 1000, True, 400), _conv_call,
                                TOL_ELEMENTWISE, default=True),
                           Case("qwen3.5 4 x 4096", lambda gen, dev: _conv_inputs(gen, dev, 4, 4096, False),
                                _conv_call, TOL_ELEMENTWISE),
                           Case("qwen3.5 packed docs 4 x 4096", lambda gen, dev: _conv_inputs(gen, dev, 4, 4096, True),
                                _conv_call, TOL_ELEMENTWISE)],
    # FLA's recurrent kernel has no backward; the model uses it only without autograd, on short sequences.
    "fused_recurrent_gated_delta_rule": [Case("qwen3.5 3 x 37", lambda gen, dev: _delta_inputs(gen, dev, 3, 37),
                                              _delta_call, TOL_DELTA_RULE, backward=False, default=True),
                                         Case("qwen3.5 8 x 64", lambda gen, dev: _delta_inputs(gen, dev, 8, 64),
                                              _delta_call, TOL_DELTA_RULE, backward=False)],
    "gather_sum": [_gather_case(f"{ODD} top-8, weighted, bf16", True, N_ODD, D_ODD, default=True),
                   _gather_case(f"{ODD} top-8, bf16", False, N_ODD, D_ODD, default=True),
                   _gather_case(f"{ODD} top-8, weighted, fp32", True, N_ODD, D_ODD, FP32, default=True),
                   _gather_case("qwen3 16k tokens top-8, weighted", True),
                   _gather_case("qwen3 16k tokens top-8", False)],
    "gather_quantize_rows": [_gather_quantize_case(f"{N_ODD} tokens top-8, e4m3 rows, groups of 1000", N_ODD, 1000,
                                                   default=True),
                             _gather_quantize_case("qwen3 16k tokens top-8, e4m3 rows")],
    "unpermute_backward": [*(_unpermute_backward_case(f"{ODD} top-8, {what}, {label}", i, N_ODD, D_ODD, dtype,
                                                      default=True)
                             for label, dtype in (("bf16", BF16), ("fp32", FP32))
                             for i, what in enumerate(("grad_y", "grad_w"))),
                           _unpermute_backward_case("qwen3 16k tokens top-8, grad_y", 0),
                           _unpermute_backward_case("qwen3 16k tokens top-8, grad_w", 1)],
    "moe_token_permute": [_token_case(f"{ODD} top-8", lambda fn, t: fn(t["x"], t["experts"])[0], N_ODD, D_ODD,
                                      default=True, constants=("weights",)),
                          _token_case("qwen3 16k tokens top-8", lambda fn, t: fn(t["x"], t["experts"])[0],
                                      constants=("weights",))],
    "moe_token_unpermute": [_token_case(f"{ODD} top-8, round trip",
                                        lambda fn, t: fn(t["x"], t["experts"], t["weights"]), N_ODD, D_ODD,
                                        default=True),
                            _token_case("qwen3 16k tokens top-8, round trip",
                                        lambda fn, t: fn(t["x"], t["experts"], t["weights"]))],
    # Local experts' GEMMs under ep8: gate_up [M, D] x [16, 2I, D]^T, down [M, I] x [16, D, I]^T. The default's rows
    # are ragged across the experts, one idle; widths stay the model's (torch._grouped_mm takes 16-byte-aligned
    # strides only, other widths run the per-expert loop, i.e. the reference).
    "grouped_mm": [_grouped_mm_case(f"qwen3 ep8 gate_up, {N_ODD} rows, an idle expert", N_ODD, 2 * I_EXPERT, D_HIDDEN,
                                    True, default=True),
                   _grouped_mm_case(f"qwen3 ep8 down, {N_ODD} rows", N_ODD, D_HIDDEN, I_EXPERT, default=True),
                   _grouped_mm_case("qwen3 ep8 gate_up, 64k rows", 65536, 2 * I_EXPERT, D_HIDDEN),
                   _grouped_mm_case("qwen3 ep8 down, 64k rows", 65536, D_HIDDEN, I_EXPERT),
                   _grouped_mm_case("qwen3 ep8 gate_up, an idle expert", 65536, 2 * I_EXPERT, D_HIDDEN, True)],
    "cast_gradient": [_cast_case("777 x 1001 bf16 -> fp32", 1.0, (777, 1001), default=True),
                      _cast_case("777 x 1001 bf16 -> fp32, divided by 3", 3.0, (777, 1001), default=True),
                      _cast_case("4M bf16 -> fp32", 1.0), _cast_case("4M bf16 -> fp32, divided by 3", 3.0)],
    "adamw_step": [*_adamw_cases("999,999 params", 999_999, default=True), *_adamw_cases("4M params", 1 << 22)],
    "link_timer": [_link_case("a 3 ms link on 24 SMs", 3.0, 24, default=True),
                   _link_case("a 20 ms link on 32 SMs", 20.0, 32)],
    # Every implementation against the dense mask (--full then times each on a 32k window: time_attention_window).
    "document_attention": [
        Case("qwen3.5 16/2 x 256, 2 x 1000 mixed docs <= 400",
             lambda gen, dev: _attention_inputs(gen, dev, 2, 1000, mixed=True, heads=(16, 2, 256), longest=400),
             _attention_call, TOL_ELEMENTWISE, default=True),
        Case("qwen3 32/4 x 128, 2 x 4096 mixed docs", lambda gen, dev: _attention_inputs(gen, dev, 2, 4096, mixed=True),
             _attention_call, TOL_ELEMENTWISE),
        # Qwen3.5-35B-A3B's full-attention heads of 256 (the kernels' largest head dim)
        Case("qwen3.5 16/2 x 256, 4096 mixed docs",
             lambda gen, dev: _attention_inputs(gen, dev, 1, 4096, mixed=True, heads=(16, 2, 256)), _attention_call,
             TOL_ELEMENTWISE)],
}


@dataclass(frozen=True)
class Check:
    """One case of one implementation of an op; ``build`` gives (kernel, reference), importing the kernel's package."""

    op: str
    impl: str
    case: Case
    build: Callable[[], tuple[Callable, Callable]]

    @property
    def label(self) -> str:
        return f"{self.op} {self.impl}"


def implementations(op: str, cfg: KernelConfig, env: Env) -> tuple[list[Impl], list[str]]:
    """Every implementation of ``op`` that ``cfg`` asks for on ``env``'s device and that can run there (each is
    checked, not only the registry's preferred one), and why the others asked for cannot. Raises the registry's
    ImportError where a plugin named in ``cfg`` is not installed."""
    spec, names = OPS[op], plugin_names(cfg)
    runnable, why_not = [], []
    for impl in spec.kernels:
        plugin = impl.plugin or spec.plugin
        if (env.device_type not in impl.device_types or plugin not in names
                or (plugin == FLA and op not in cfg.include_kernels)):
            continue
        why = impl.unavailable(env)
        if why is None:
            runnable.append(impl)
        else:
            why_not.append(f"{op} {impl.name}: {why}")
    return runnable, why_not


def _builder(op: str, impl: Impl, cfg: KernelConfig) -> Callable[[], tuple[Callable, Callable]]:
    @functools.cache
    def build() -> tuple[Callable, Callable]:
        kernel, reference = impl.build(cfg), OPS[op].reference(cfg)
        if op in PAIRED:  # the permute of the same implementation
            first = next(other for other in OPS[PAIRED[op]].kernels if other.name == impl.name)
            kernel = _round_trip(first.build(cfg), kernel)
            reference = _round_trip(OPS[PAIRED[op]].reference(cfg), reference)
        return kernel, reference

    return build


def plan(cfg: KernelConfig, env: Env, full: bool = False, only: frozenset[str] = frozenset()
         ) -> tuple[list[Check], list[str]]:
    """The checks to run on ``env``'s device, packed-document attention's last (the default run's cases, or with
    ``full`` every case), and a line per implementation asked for that cannot run there. ``only``: these ops."""
    checks, skipped = [], []
    for op in sorted(OPS, key=lambda op: op == "document_attention"):
        if only and op not in only:
            continue
        impls, why_not = implementations(op, cfg, env)
        skipped += why_not
        for impl in impls:
            build = _builder(op, impl, cfg)
            checks += [Check(op, impl.name, case, build) for case in CASES[op] if full or case.default]
    return checks, skipped


def _checked(t: torch.Tensor, name: str, case: Case) -> bool:
    return t.is_floating_point() and name not in case.constants


def _forward(fn: Callable, case: Case, inputs: Inputs, backward: bool) -> tuple[torch.Tensor, Inputs]:
    leaves = {name: t.detach().clone().requires_grad_(backward and _checked(t, name, case))
              for name, t in inputs.items()}
    return case.call(fn, leaves), leaves


def _results(case: Case, out: torch.Tensor, leaves: Inputs, grad_out: torch.Tensor | None) -> list[torch.Tensor]:
    """The output and (if ``grad_out``) every input's gradient, in fp32."""
    if grad_out is None:
        return [out.detach().float()]
    out.backward(grad_out.to(out.dtype))
    return [out.detach().float(), *(leaf.grad.float() for name, leaf in leaves.items() if _checked(leaf, name, case))]


def _run(fn: Callable, case: Case, inputs: Inputs, grad_out: torch.Tensor | None) -> list[torch.Tensor]:
    return _results(case, *_forward(fn, case, inputs, grad_out is not None), grad_out)


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


def _dtype_name(inputs: Inputs) -> str:
    """The narrowest floating-point dtype among the inputs: what the torch yardstick runs in."""
    floats = [t.dtype for t in inputs.values() if t.is_floating_point()]
    return DTYPE_NAMES.get(min(floats, key=lambda d: torch.finfo(d).bits), "?") if floats else "-"


def check_case(op: str, kernel: Callable, reference: Callable, case: Case, dev: torch.device,
               timed: bool = False) -> bool:
    gen = torch.Generator(device=dev).manual_seed(0)
    inputs = case.make(gen, dev)
    out32, leaves32 = _forward(reference, case, {k: v.float() if v.is_floating_point() else v
                                                 for k, v in inputs.items()}, case.backward)
    grad_out = torch.randn(out32.shape, generator=gen, device=dev) if case.backward else None
    ref32 = _results(case, out32, leaves32, grad_out)
    ref16 = _run(reference, case, inputs, grad_out)
    got = _run(kernel, case, inputs, grad_out)
    grads = [f"d{name}" for name, t in inputs.items() if _checked(t, name, case)] if case.backward else []
    names, low = ["out", *grads], _dtype_name(inputs)
    ok = True
    for name, g, r16, r32 in zip(names, got, ref16, ref32):
        err, err16 = _rel(g, r32), _rel(r16, r32)
        max_abs = (g - r32).abs().max().item()
        status = "ok" if err <= case.tol else "FAIL"
        ok &= err <= case.tol
        print(f"  {op:34s} {case.name:28s} {name:8s} rel {err:.2e} (torch {low} {err16:.2e}, tol {case.tol:.0e}) "
              f"max|diff| {max_abs:.2e}  {status}")
    if not timed:
        return ok
    for mode, backward in [("fwd", False), ("fwd+bwd", True)] if case.backward else [("fwd", False)]:
        g = grad_out if backward else None
        print(f"  {op:34s} {case.name:28s} {mode:8s} kernel {_time_ms(dev.type, kernel, case, inputs, g):8.3f} ms   "
              f"torch {low} {_time_ms(dev.type, reference, case, inputs, g):8.3f} ms")
    return ok


def _list_env(requested: str) -> Env:
    """The device --list lists for: this machine's accelerator, else (none here) ASSUMED_CUDA."""
    try:
        dev_type = device.device_type(requested)
    except ValueError:
        dev_type = "cpu"
    return ASSUMED_CUDA if dev_type == "cpu" else Env.detect(dev_type)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default="auto",
                        help="kernel_config.name: the plugins whose kernels are checked (default: %(default)s, the "
                             "training default; auto,flash-linear-attention adds FLA's, as kernel_config=auto_fla)")
    parser.add_argument("--chunk-size", type=int, default=64, help="kernel_config.chunk_size (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or npu (default: %(default)s)")
    parser.add_argument("--ops", default="", help="comma-separated ops to check (default: every one)")
    parser.add_argument("--full", action="store_true",
                        help="every case: the default run's, then the model shapes with kernel vs torch timings and "
                             "the 32k attention window (minutes)")
    parser.add_argument("--list", action="store_true",
                        help="print the checks that would run (op, implementation, case) and exit")
    args = parser.parse_args(argv)
    cfg = KernelConfig(name=args.kernels, include_kernels=list(FLA_OPS), chunk_size=args.chunk_size)
    validate_kernel_config(cfg)
    only = frozenset(op for op in args.ops.split(",") if op)
    unknown = only - set(OPS)
    if unknown:
        parser.error(f"--ops: unknown {sorted(unknown)}; valid: {', '.join(OPS)}")
    if args.list:
        env = _list_env(args.device)
        checks, skipped = plan(cfg, env, args.full, only)
        assumed = " (assumed: no accelerator here)" if env is ASSUMED_CUDA else ""
        print(f"# {'--full' if args.full else 'default'} checks on {env.describe()}{assumed}")
        for check in checks:
            print(f"{check.op:34s} {check.impl:30s} {check.case.name}")
        for line in skipped:
            print(f"# cannot run here: {line}")
        print(f"# {len(checks)} checks")
        return 0
    dev_type = device.device_type(args.device)
    if dev_type == "cpu":
        print("cpu: nothing to check (the torch references are the cpu kernels)")
        return 0
    dev = device.local_device(dev_type)
    kernels = select_kernels(cfg, dev_type)
    for line in kernels.lines():
        print(f"kernel {line}")
    checks, skipped = plan(cfg, kernels.env, args.full, only)
    for line in skipped:
        print(f"  skipped: {line}")
    started = time.perf_counter()
    print(f"start-up {started - STARTED:.1f} s (imports, {dev_type} initialisation, kernel selection); "
          f"{len(checks)} checks{'' if args.full else ' (the default run; --full: every shape, with timings)'}")
    failed, seconds = [], []
    for check in checks:
        begin = time.perf_counter()
        kernel, reference = check.build()
        if not check_case(check.label, kernel, reference, check.case, dev, timed=args.full):
            failed.append(f"{check.label} [{check.case.name}]")
        device.module(dev_type).empty_cache()
        seconds.append(time.perf_counter() - begin)
        print(f"  {check.label:34s} {check.case.name:28s} wall {seconds[-1]:8.2f} s")
    attention = {check.impl: check.build()[0] for check in checks if check.op == "document_attention"}
    if args.full and attention:
        begin = time.perf_counter()
        time_attention_window(dev, attention, OPS["document_attention"].reference(cfg))
        print(f"  document_attention 32k window timings: wall {time.perf_counter() - begin:.2f} s")
    slowest = sorted(zip(checks, seconds), key=lambda item: -item[1])[:5]
    print(f"{len(checks)} checks in {time.perf_counter() - started:.1f} s, {time.perf_counter() - STARTED:.1f} s in "
          f"all; slowest: " + "; ".join(f"{c.label} [{c.case.name}] {s:.1f} s" for c, s in slowest))
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    print("all selected kernels match their torch references")
    return 0


if __name__ == "__main__":
    sys.exit(main())
