"""FP8 grouped GEMM of the experts (``train.float8=rowwise``): ``y[rows of g] = x[rows of g] @ w[g]`` with both
operands of each of the three GEMMs (forward, input gradient, weight gradient) quantised to float8_e4m3fn under
dynamic scales along that GEMM's contraction dim: torchao.prototype.moe_training's rowwise recipe.

Every operand gets one scale per row or column of the contraction (and, where the contraction runs over routed
rows, per group): ``scale = 2^floor(log2(FP8_MAX / amax))``, a power of 2 (exact to undo) that puts the slice's
largest value in [FP8_MAX / 2, FP8_MAX], e4m3's top binade (``data / scale`` is the value an fp8 entry stands for):

    forward   y_Po   = x_Pi  @ w_Gio   x: per row (over i)            w: per (g, o) (over i)
    grad x    dx_Pi  = dy_Po @ w_Goi   dy: per row (over o)           w: per (g, i) (over o)
    grad w    dw_Gio = x_iP  @ dy_Po   x: per (g, i) over g's rows    dy: per (g, o) over g's rows

``float8_grouped_mm`` runs ``torch._scaled_grouped_mm`` (CUDA, sm_90) with torchao's fused Triton quantisers, or
(``emulate=True``, and for any tensor not on CUDA) the same steps with the torch quantisers of this file and the GEMM
emulated exactly: dequantise, multiply each group in fp32, round to the kernel's bf16 output. Each group's rows are
padded to a multiple of ``ALIGN`` (an empty group to ``ALIGN`` zero rows), as the fp8 kernel needs 16-byte aligned
group starts where it contracts over rows; padding rows are zero, so they change no scale and no sum.
Letters as in DEVELOPERS.md: M routed rows (P: padded), G groups, i in-features, o out-features.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
EPS = 1e-12  # torchao's floor on amax: an all-zero row gets a finite scale (and stays zero)
ALIGN = 16  # rows per group padded to a multiple of this: fp8 operands need 16-byte aligned strides and offsets
OUT_DTYPE = torch.bfloat16  # what torch._scaled_grouped_mm writes (rowwise fp8 on sm_90 outputs bf16 only)
USE_FAST_ACCUM = True  # torchao's choice for all three GEMMs; scripts/check_float8.py measures the error


def amax_to_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 quantisation scales ``2^floor(log2(FP8_MAX / max(amax, EPS)))`` (the division in fp64, as torchao)."""
    scale = (FP8_MAX / amax.double().clamp_min(EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale)))


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * scale`` (broadcast) in fp32, saturated to e4m3 (a no-op for finite x; eager casts before torch 2.12
    did not saturate), as float8_e4m3fn, in x's layout."""
    return (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class Quantizers(NamedTuple):
    """The four quantisations the three GEMMs need, with the layouts torch._scaled_grouped_mm takes."""

    rows: Callable  # x_Mk -> data row-major [M, k], scale [M, 1] (over k)
    weight: Callable  # w_Gio -> data [G, i, o] column-major, scale [G, 1, o] (over i)
    weight_t: Callable  # w_Gio -> data [G, o, i] column-major (w transposed), scale [G, i] (over o)
    group_cols: Callable  # (dy_Po, x_Pi, ends_G) -> dy, x column-major, scales [G * o], [G * i] (over g's rows)


def _rows(x_Mk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale_M1 = amax_to_scale(torch.linalg.vector_norm(x_Mk, float("inf"), dim=1, keepdim=True))
    return to_fp8(x_Mk, scale_M1).contiguous(), scale_M1


def _weight(w_Gio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale_G1o = amax_to_scale(torch.linalg.vector_norm(w_Gio, float("inf"), dim=1, keepdim=True))
    return to_fp8(w_Gio, scale_G1o).transpose(1, 2).contiguous().transpose(1, 2), scale_G1o


def _weight_t(w_Gio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale_Gi1 = amax_to_scale(torch.linalg.vector_norm(w_Gio, float("inf"), dim=2, keepdim=True))
    return to_fp8(w_Gio, scale_Gi1).contiguous().transpose(1, 2), scale_Gi1.squeeze(2)


def _group_cols_one(x_Pk: torch.Tensor, group_P: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Rows past the last group's end (the padding buffer's tail, all zero) fall in an extra group, dropped.
    abs_Pk = x_Pk.abs().float()
    amax_Gk = abs_Pk.new_zeros(groups + 1, x_Pk.shape[1]).scatter_reduce_(
        0, group_P[:, None].expand_as(abs_Pk), abs_Pk, "amax", include_self=True)
    scale_Gk = amax_to_scale(amax_Gk)
    data_Pk = to_fp8(x_Pk, scale_Gk[group_P]).t().contiguous().t()
    return data_Pk, scale_Gk[:groups].flatten()


def _group_cols(dy_Po: torch.Tensor, x_Pi: torch.Tensor, ends_G: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    group_P = torch.searchsorted(ends_G, torch.arange(x_Pi.shape[0], device=x_Pi.device, dtype=ends_G.dtype),
                                 right=True)
    return (*_group_cols_one(dy_Po, group_P, ends_G.numel()), *_group_cols_one(x_Pi, group_P, ends_G.numel()))


TORCH_QUANTIZERS = Quantizers(_rows, _weight, _weight_t, _group_cols)


@functools.lru_cache(maxsize=None)
def torchao_quantizers() -> Quantizers:
    """torchao's fused Triton kernels of the same four quantisations (same scales, same layouts); CUDA only."""
    try:
        from torchao.prototype.moe_training import kernels as k
    except ImportError as e:
        raise ImportError(f"train.float8 needs torchao (pip install torchao): {e}") from e

    def rows(x_Mk):
        return k.triton_fp8_rowwise_2d_scale_and_cast(x_Mk, output_dtype=FP8, round_scales_to_power_of_2=True)

    def weight(w_Gio):
        w_Gio = w_Gio.transpose(1, 2).contiguous().transpose(1, 2)  # column-major (a no-op for the experts' views)
        return k.triton_fp8_colwise_3d_scale_and_cast(w_Gio, output_dtype=FP8, round_scales_to_power_of_2=True)

    def weight_t(w_Gio):
        w_Gio = w_Gio.transpose(1, 2).contiguous().transpose(1, 2)
        return k.triton_fp8_rowwise_3d_transpose_rhs(w_Gio, output_dtype=FP8, round_scales_to_power_of_2=True)

    def group_cols(dy_Po, x_Pi, ends_G):
        return k.triton_fp8_per_group_colwise_scales_dual(dy_Po, x_Pi, ends_G, FP8, round_scales_to_power_of_2=True)

    return Quantizers(rows, weight, weight_t, group_cols)


# ----------------------------------------------------------------------------------------------- the GEMMs

def scaled_grouped_mm_cuda(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
                           ends_G: torch.Tensor) -> torch.Tensor:
    return torch._scaled_grouped_mm(a, b, inv_a, inv_b, ends_G, out_dtype=OUT_DTYPE, use_fast_accum=USE_FAST_ACCUM)


def scaled_grouped_mm_emulated(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
                               ends_G: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_grouped_mm``'s result, exactly but for the summation order: the fp8 values times their
    (power-of-2) inverse scales are exact in fp32, each group is multiplied in fp32, rounded once to OUT_DTYPE.
    2d x 3d: a [P, k], b [G, k, n], inv_a [P], inv_b [G, n] -> [P, n] (rows past the last end: zero).
    2d x 2d: a [m, P], b [P, n], inv_a [G * m], inv_b [G * n] -> [G, m, n] (contracting each group's rows)."""
    ends = ends_G.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:
        a_f, out = a.float() * inv_a[:, None], a.new_zeros(a.shape[0], b.shape[2], dtype=torch.float32)
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = a_f[s:e] @ (b[g].float() * inv_b[g][None, :])
        return out.to(OUT_DTYPE)
    m, n = a.shape[0], b.shape[1]
    inv_a_Gm, inv_b_Gn = inv_a.view(-1, m), inv_b.view(-1, n)
    out = torch.stack([(a[:, s:e].float() * inv_a_Gm[g][:, None]) @ (b[s:e].float() * inv_b_Gn[g][None, :])
                       for g, (s, e) in enumerate(zip(starts, ends))])
    return out.to(OUT_DTYPE)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """What the GEMM multiplies by: 1 / scale (exact: a power of 2), contiguous as torch._scaled_grouped_mm asks."""
    return scale.reciprocal().contiguous()


def gemm_forward(x: tuple[torch.Tensor, torch.Tensor], w_Gio: torch.Tensor, ends_G: torch.Tensor, quant: Quantizers,
                 gemm: Callable) -> torch.Tensor:
    """The forward GEMM from x already quantised per row (``quant.rows``' data and scales) -> y_Po (OUT_DTYPE)."""
    w = quant.weight(w_Gio)
    return gemm(x[0], w[0], _inverse(x[1].squeeze(1)), _inverse(w[1].squeeze(1)), ends_G)


def gemm_backward(dy_Po: torch.Tensor, x_Pi: torch.Tensor, w_Gio: torch.Tensor, ends_G: torch.Tensor,
                  quant: Quantizers, gemm: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and weight gradients (OUT_DTYPE) of the forward GEMM on the padded rows ``x_Pi``."""
    dy_Po = dy_Po.contiguous()  # e.g. an expanded gradient of .sum()
    dy, wt = quant.rows(dy_Po), quant.weight_t(w_Gio)
    dx_Pi = gemm(dy[0], wt[0], _inverse(dy[1].squeeze(1)), _inverse(wt[1]), ends_G)
    dy_c, dy_scale, x_c, x_scale = quant.group_cols(dy_Po, x_Pi, ends_G)
    return dx_Pi, gemm(x_c.t(), dy_c, _inverse(x_scale), _inverse(dy_scale), ends_G)


class _Float8GroupedMM(torch.autograd.Function):
    """The three GEMMs on padded rows (``x_Pi``: each group starts at a multiple of ALIGN, ``ends_G`` int32)."""

    @staticmethod
    def forward(ctx, x_Pi: torch.Tensor, w_Gio: torch.Tensor, ends_G: torch.Tensor, quant: Quantizers,
                gemm: Callable) -> torch.Tensor:
        ctx.save_for_backward(x_Pi, w_Gio, ends_G)
        ctx.quant, ctx.gemm = quant, gemm
        return gemm_forward(quant.rows(x_Pi), w_Gio, ends_G, quant, gemm).to(x_Pi.dtype)

    @staticmethod
    def backward(ctx, dy_Po: torch.Tensor):
        x_Pi, w_Gio, ends_G = ctx.saved_tensors
        dx_Pi, dw_Gio = gemm_backward(dy_Po, x_Pi, w_Gio, ends_G, ctx.quant, ctx.gemm)
        return dx_Pi.to(x_Pi.dtype), dw_Gio.to(w_Gio.dtype), None, None, None


def padded_layout(counts_G: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each row goes when every group is padded to a multiple of ALIGN rows (an empty one to ALIGN): the
    destination row of each of the ``rows`` rows, the padded groups' ends (int32) and the buffer's row count, a
    bound fixed by the shapes (no host sync): ``ceil(rows / ALIGN) * ALIGN + ALIGN * G``."""
    counts_G = counts_G.to(torch.int64)
    groups = counts_G.numel()
    padded_G = ((counts_G + ALIGN - 1) // ALIGN * ALIGN).clamp_min(ALIGN)
    ends_G = torch.cumsum(padded_G, 0)
    shift_G = ends_G - padded_G - (torch.cumsum(counts_G, 0) - counts_G)  # padded start - start
    group_M = torch.repeat_interleave(torch.arange(groups, device=counts_G.device), counts_G, output_size=rows)
    dest_M = torch.arange(rows, device=counts_G.device) + shift_G[group_M]
    return dest_M, ends_G.to(torch.int32), -(-rows // ALIGN) * ALIGN + ALIGN * groups


def autocast_operands(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both operands in autocast's dtype where it is on (as ``grouped_mm`` does), else as they are."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return x.to(dtype), w.to(dtype)
    return x, w


def implementation(device_type: str, emulate: bool) -> tuple[Quantizers, Callable]:
    """(quantisers, GEMM): torchao's Triton quantisers and torch._scaled_grouped_mm on CUDA unless ``emulate``,
    else the torch quantisers and the exact emulation."""
    if device_type == "cuda" and not emulate:
        return torchao_quantizers(), scaled_grouped_mm_cuda
    return TORCH_QUANTIZERS, scaled_grouped_mm_emulated


def float8_grouped_mm(x_Mi: torch.Tensor, w_Gio: torch.Tensor, counts_G: torch.Tensor,
                      counts_host: list[int] | None = None, emulate: bool = False) -> torch.Tensor:
    """``kernels.moe.grouped_mm.grouped_mm``'s product (same call) in FP8 with rowwise dynamic scales: on CUDA
    ``torch._scaled_grouped_mm`` unless ``emulate``; elsewhere the exact emulation. Under autocast both operands
    are cast to its dtype first, as ``grouped_mm`` does. The result and gradients are in x's and w's dtypes.
    ``counts_host`` is not needed: the padded layout is computed on the device, with no host sync."""
    x_Mi, w_Gio = autocast_operands(x_Mi, w_Gio)
    quant, gemm = implementation(x_Mi.device.type, emulate)
    device_type = x_Mi.device.type
    dest_M, ends_G, rows = padded_layout(counts_G, x_Mi.shape[0])
    x_Pi = x_Mi.new_zeros(rows, x_Mi.shape[1]).index_copy(0, dest_M, x_Mi)
    with torch.autocast(device_type, enabled=False):
        y_Po = _Float8GroupedMM.apply(x_Pi, w_Gio, ends_G, quant, gemm)
    return y_Po.index_select(0, dest_M)


def float8_grouped_mm_ok(w_Gio: torch.Tensor) -> bool:
    """Whether the fp8 kernel takes these weights: in- and out-features multiples of 16 (16-byte fp8 strides)."""
    return w_Gio.shape[1] % ALIGN == 0 and w_Gio.shape[2] % ALIGN == 0

