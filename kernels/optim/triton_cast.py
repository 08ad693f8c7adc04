"""Triton (CUDA) kernel for ``kernels.optim.cast.cast_gradient``: one vectorised pass (read 2 bytes, write 4 per element
for bf16 -> fp32), the division as torch's CUDA ``div_`` by a scalar does it (times the fp32 reciprocal), so the
result is the reference's to the bit; the same signature as the torch reference, which takes any other layout."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.optim.cast import cast_gradient_torch

_BLOCK = 4096


@triton.jit
def _cast_kernel(G, OUT, n, divide_by, BLOCK: tl.constexpr, DIVIDE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(G + offs, mask=mask).to(OUT.dtype.element_ty)
    if DIVIDE:
        x = x * divide_by  # the reciprocal: torch's CUDA division by a scalar multiplies by it too
    tl.store(OUT + offs, x, mask=mask)


def cast_gradient(g: torch.Tensor, dtype: torch.dtype, stride: tuple[int, ...], divide_by: float) -> torch.Tensor:
    if not g.is_contiguous() or tuple(stride) != g.stride() or dtype != torch.float32:
        return cast_gradient_torch(g, dtype, stride, divide_by)
    out = torch.empty_like(g, dtype=dtype)
    n = g.numel()
    if n:
        reciprocal = torch.tensor(divide_by, dtype=dtype).reciprocal().item()  # rounded to fp32 first, as torch's
        _cast_kernel[(triton.cdiv(n, _BLOCK),)](g, out, n, reciprocal, BLOCK=_BLOCK, DIVIDE=divide_by != 1,
                                                num_warps=8)
    return out
