"""Rotary embedding (rotate-half convention, optionally partial) in one Triton kernel each way (CUDA).

``kernels.tokenwise.rotary.apply_rotary`` runs ~7 eager kernels per call and as many in backward (slices,
``rotate_half``'s neg and cat, two products, a sum, the pass-through cat), each a full pass over q or k. Here one
program handles one token's heads: out[d] = x[d] cos[d] -/+ x[d +/- rot/2] sin[d] for d < rot, x[d] beyond, in fp32 with
one rounding. The backward is the transpose: grad_x[d] = g[d] cos[d] +/- g[d +/- rot/2] sin[d +/- rot/2].
Inputs are [B, H, T, d] views of any strides with unit stride on d (q and k are transposed [B, T, H, d]);
outputs are [B, T, H, d] memory returned as the same [B, H, T, d] view, as the eager ops would give; the cos / sin
tables are [B, T, r]. Letters as in DEVELOPERS.md (H the heads of whichever tensor: q's H or k's h).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(X, COS, SIN, OUT, T, H, sxb, sxh, sxt, scb, sct, ROT: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)
    b, t = bt // T, bt % T
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    half: tl.constexpr = ROT // 2
    rotated = d < ROT
    first = d < half
    partner = tl.where(first, d + half, d - half)
    mask = (h[:, None] < H) & (d[None, :] < HEAD_DIM)
    rows = X + b * sxb + t * sxt + h[:, None] * sxh
    x = tl.load(rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(rows + partner[None, :], mask=mask & rotated[None, :], other=0.0).to(tl.float32)
    table = b * scb + t * sct
    cos = tl.load(COS + table + d, mask=rotated, other=1.0).to(tl.float32)
    if BACKWARD:  # the partner's sine, opposite sign
        sin = tl.load(SIN + table + partner, mask=rotated, other=0.0).to(tl.float32)
        sin = tl.where(first, sin, -sin)
    else:
        sin = tl.load(SIN + table + d, mask=rotated, other=0.0).to(tl.float32)
        sin = tl.where(first, -sin, sin)
    out = x * cos[None, :] + x_partner * sin[None, :]
    out_rows = OUT + ((b * T + t) * H + h[:, None]) * HEAD_DIM
    tl.store(out_rows + d[None, :], out.to(OUT.dtype.element_ty), mask=mask)


def _launch(x_BHTd: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor, backward: bool) -> torch.Tensor:
    B, H, T, d = x_BHTd.shape
    if x_BHTd.stride(-1) != 1:
        x_BHTd = x_BHTd.contiguous()
    cos_BTr, sin_BTr = cos_BTr.expand(B, T, -1).contiguous(), sin_BTr.expand(B, T, -1).contiguous()
    out_BTHd = torch.empty(B, T, H, d, dtype=torch.promote_types(x_BHTd.dtype, cos_BTr.dtype), device=x_BHTd.device)
    if out_BTHd.numel():
        block_h = min(16, triton.next_power_of_2(H))
        sxb, sxh, sxt, _ = x_BHTd.stride()
        _rotary_kernel[(B * T, triton.cdiv(H, block_h))](
            x_BHTd, cos_BTr, sin_BTr, out_BTHd, T, H, sxb, sxh, sxt, cos_BTr.stride(0), cos_BTr.stride(1),
            ROT=cos_BTr.shape[-1], HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d), BACKWARD=backward)
    return out_BTHd.transpose(1, 2)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BHTd: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos_BTr, sin_BTr)
        ctx.x_dtype = x_BHTd.dtype
        return _launch(x_BHTd, cos_BTr, sin_BTr, backward=False)

    @staticmethod
    def backward(ctx, grad_BHTd: torch.Tensor):
        cos_BTr, sin_BTr = ctx.saved_tensors
        return _launch(grad_BHTd, cos_BTr, sin_BTr, backward=True).to(ctx.x_dtype), None, None


def apply_rotary(x_BHTd: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor) -> torch.Tensor:
    """As ``kernels.tokenwise.rotary.apply_rotary``; the cos / sin tables get no gradient (they never need one)."""
    if cos_BTr.requires_grad or sin_BTr.requires_grad:
        raise ValueError("triton apply_rotary does not differentiate the cos / sin tables")
    return _Rotary.apply(x_BHTd, cos_BTr, sin_BTr)
