"""Triton (CUDA) kernel of ``kernels.float8.permute``'s dispatch gather (``gather_quantize_rows``; the same
signature as the torch reference there, ``gather_quantize_rows_torch``): row p of src[index[p]] (zero where -1) as
e4m3 with its per-row power-of-2 scale, in one pass, instead of a gather, a padded copy and the quantiser's read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.float8.grouped_mm import EPS, FP8, FP8_MAX
from kernels.moe.permute import _materialised


@triton.jit
def _gather_quantize_kernel(SRC, INDEX, DATA, SCALE, D: tl.constexpr, BLOCK_D: tl.constexpr,
                            FP8_MAX: tl.constexpr, EPS: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    row = tl.load(INDEX + p).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    live = offs < D
    x = tl.load(SRC + tl.maximum(row, 0) * D + offs, mask=live & (row >= 0), other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), EPS)
    # 2^floor(log2(FP8_MAX / amax)), as kernels.float8.grouped_mm.amax_to_scale (there the division is in fp64;
    # the two differ only where the fp32 quotient rounds onto a power of 2)
    scale = tl.exp2(tl.floor(tl.log2(FP8_MAX / amax)))
    q = tl.minimum(tl.maximum(x * scale, -FP8_MAX), FP8_MAX)
    tl.store(DATA + p * D + offs, q.to(DATA.dtype.element_ty), mask=live)
    tl.store(SCALE + p, scale)


def gather_quantize_rows(src_RD: torch.Tensor, index_P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (e4m3 data [P, D], fp32 scales [P, 1]): one program per row, the whole row in registers (D <= 16k)."""
    src_RD, index_P = _materialised(src_RD).contiguous(), _materialised(index_P).contiguous()
    P, D = index_P.shape[0], src_RD.shape[1]
    data_PD = torch.empty(P, D, device=src_RD.device, dtype=FP8)
    scale_P1 = torch.empty(P, 1, device=src_RD.device, dtype=torch.float32)
    if P:
        _gather_quantize_kernel[(P,)](src_RD, index_P, data_PD, scale_P1, D=D, BLOCK_D=triton.next_power_of_2(D),
                                      FP8_MAX=FP8_MAX, EPS=EPS)
    return data_PD, scale_P1
