"""The experts' FP8 grouped GEMMs as the dispatch calls them (``Float8GroupedMM``: FP8 for the measured shapes),
and the first with the dispatch gather fused into its quantisation: the gather that puts
the routed rows in expert order writes them as e4m3 rows and their per-row scales, in the padded layout of
``kernels.float8.grouped_mm``, so no pass writes or reads the gathered bf16 rows in the forward.

``float8_grouped_mm_gathered(src_RD, index_M, inv_M, w_Gio, counts_G)`` is
``float8_grouped_mm(src_RD[index_M], w_Gio, counts_G)`` with the gather's gradient (each source row read by
K = M / R routed rows, ``inv_M`` the row of each (r, k) slot, as ``kernels.moe.permute.permute_tokens``; K = 1: a
permutation, as ``permute_rows``). Forward: one pass over the source rows (``gather_quantize_rows``: the installed
kernel, ``kernels.float8.triton_permute`` on CUDA) instead of the gather, the zero-filled padded copy and the
quantiser's read. Backward: the weight gradient's per-group column scales need the bf16 rows; they are gathered again
from the source (which the layer before keeps for its own backward) instead of being kept from the forward.
Letters as in DEVELOPERS.md: R source rows, M routed rows, P padded rows, G groups, i in, o out.
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels.float8.grouped_mm import (TORCH_QUANTIZERS, Quantizers, autocast_operands, float8_grouped_mm,
                                       gemm_backward, gemm_forward, implementation, padded_layout)
from kernels.installed import kernel
from kernels.moe.grouped_mm import grouped_mm
from kernels.moe.permute import RoutedRows, gather_sum


def gather_rows(src_RD: torch.Tensor, index_P: torch.Tensor) -> torch.Tensor:
    """``src_RD[index_P]`` with a zero row where the index is -1 (a group's padding)."""
    rows_PD = src_RD.index_select(0, index_P.clamp_min(0))
    return rows_PD.masked_fill_((index_P < 0)[:, None], 0)


def gather_quantize_rows_torch(src_RD: torch.Tensor, index_P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (e4m3 data [P, D] row-major, fp32 scales [P, 1]) of ``gather_rows(src_RD, index_P)`` with
    ``kernels.float8.grouped_mm``'s per-row scales: the reference of the fused kernel."""
    return TORCH_QUANTIZERS.rows(gather_rows(src_RD, index_P))


def gather_quantize_rows(src_RD: torch.Tensor, index_P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The installed kernel of ``gather_quantize_rows_torch``."""
    return kernel("gather_quantize_rows", src_RD, gather_quantize_rows_torch)(src_RD, index_P)


class _GatheredFloat8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src_RD: torch.Tensor, index_P: torch.Tensor, slot_rows: torch.Tensor, w_Gio: torch.Tensor,
                ends_G: torch.Tensor, quant: Quantizers, gemm: Callable, gather_quantize: Callable) -> torch.Tensor:
        ctx.save_for_backward(src_RD, index_P, slot_rows, w_Gio, ends_G)
        ctx.quant, ctx.gemm = quant, gemm
        return gemm_forward(gather_quantize(src_RD, index_P), w_Gio, ends_G, quant, gemm).to(src_RD.dtype)

    @staticmethod
    def backward(ctx, dy_Po: torch.Tensor):
        src_RD, index_P, slot_rows, w_Gio, ends_G = ctx.saved_tensors
        dx_Pi, dw_Gio = gemm_backward(dy_Po, gather_rows(src_RD, index_P), w_Gio, ends_G, ctx.quant, ctx.gemm)
        R = src_RD.shape[0]
        dsrc_RD = gather_sum(dx_Pi.to(src_RD.dtype), slot_rows, R, slot_rows.numel() // R if R else 0)
        return dsrc_RD, None, None, dw_Gio.to(w_Gio.dtype), None, None, None, None


def float8_grouped_mm_gathered(src_RD: torch.Tensor, index_M: torch.Tensor, inv_M: torch.Tensor,
                               w_Gio: torch.Tensor, counts_G: torch.Tensor, emulate: bool = False) -> torch.Tensor:
    """``float8_grouped_mm(src_RD[index_M], w_Gio, counts_G)`` (rows of ``index_M`` in expert order, ``counts_G``
    per group), the gather fused into the quantisation; ``inv_M``: the routed row of each (r, k) slot of the
    source rows (M = R x K). No host sync."""
    src_RD, w_Gio = autocast_operands(src_RD, w_Gio)
    quant, gemm = implementation(src_RD.device.type, emulate)
    gather_quantize = gather_quantize_rows_torch if emulate else gather_quantize_rows
    dest_M, ends_G, rows = padded_layout(counts_G, index_M.shape[0])
    index_P = index_M.new_full((rows,), -1).index_copy(0, dest_M, index_M)
    slot_rows = dest_M.index_select(0, inv_M)  # the padded row of each slot: the gradient's gather
    with torch.autocast(src_RD.device.type, enabled=False):
        y_Po = _GatheredFloat8GroupedMM.apply(src_RD, index_P, slot_rows, w_Gio, ends_G, quant, gemm,
                                              gather_quantize)
    return y_Po.index_select(0, dest_M)


class Float8GroupedMM:
    """A ``GroupedExperts.grouped_mm`` (``kernels.moe.grouped_mm.grouped_mm``'s call) that runs ``float8_grouped_mm``
    for weights [G, i, o] whose (i, o) is in ``shapes`` and the installed bf16 kernel for the others: FP8 per GEMM,
    where it was measured to be faster (``parallelisms.float8``)."""

    def __init__(self, shapes: set[tuple[int, int]]) -> None:
        self.shapes = frozenset(shapes)

    def __call__(self, x_Mi: torch.Tensor, w_Gio: torch.Tensor, counts_G: torch.Tensor,
                 counts_host: list[int] | None = None) -> torch.Tensor:
        if tuple(w_Gio.shape[1:]) in self.shapes:
            return float8_grouped_mm(x_Mi, w_Gio, counts_G, counts_host)
        return grouped_mm(x_Mi, w_Gio, counts_G, counts_host)

    def gathered(self, rows: RoutedRows, w_Gio: torch.Tensor, counts_G: torch.Tensor,
                 counts_host: list[int] | None = None) -> torch.Tensor:
        """The same product of the rows ``rows`` gathers: for an FP8 shape the gather fused into the
        quantisation (``float8_grouped_mm_gathered``), else the gather, then the bf16 kernel."""
        if tuple(w_Gio.shape[1:]) in self.shapes:
            return float8_grouped_mm_gathered(*rows, w_Gio, counts_G)
        return grouped_mm(rows.gather(), w_Gio, counts_G, counts_host)

    def __repr__(self) -> str:
        return f"Float8GroupedMM({sorted(self.shapes)})"
