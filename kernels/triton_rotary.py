"""Rotary embedding (rotate-half convention, optionally partial) in one Triton kernel each way (CUDA).

``kernels.rotary.apply_rotary`` runs ~7 eager kernels per call and as many in backward (slices, ``rotate_half``'s
neg and cat, two products, a sum, the pass-through cat), each a full pass over q or k. Here one program handles
one token's heads: out[d] = x[d] cos[d] -/+ x[d +/- rot/2] sin[d] for d < rot, x[d] beyond, in fp32 with one
rounding. The backward is the transpose: grad_x[d] = g[d] cos[d] +/- g[d +/- rot/2] sin[d +/- rot/2].
Inputs are [B, H, T, Dh] views of any strides with unit stride on Dh (q and k are transposed [B, T, H, Dh]);
outputs are [B, T, H, Dh] memory returned as the same [B, H, T, Dh] view, as the eager ops would give.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(X, COS, SIN, OUT, T, H, sxb, sxh, sxt, scb, sct, ROT: tl.constexpr, D: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)
    b, t = bt // T, bt % T
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    half: tl.constexpr = ROT // 2
    rotated = d < ROT
    first = d < half
    partner = tl.where(first, d + half, d - half)
    mask = (h[:, None] < H) & (d[None, :] < D)
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
    out_rows = OUT + ((b * T + t) * H + h[:, None]) * D
    tl.store(out_rows + d[None, :], out.to(OUT.dtype.element_ty), mask=mask)


def _launch(x_BHTD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor, backward: bool) -> torch.Tensor:
    B, H, T, D = x_BHTD.shape
    if x_BHTD.stride(-1) != 1:
        x_BHTD = x_BHTD.contiguous()
    cos_BTR, sin_BTR = cos_BTR.expand(B, T, -1).contiguous(), sin_BTR.expand(B, T, -1).contiguous()
    out_BTHD = torch.empty(B, T, H, D, dtype=torch.promote_types(x_BHTD.dtype, cos_BTR.dtype), device=x_BHTD.device)
    if out_BTHD.numel():
        block_h = min(16, triton.next_power_of_2(H))
        sxb, sxh, sxt, _ = x_BHTD.stride()
        _rotary_kernel[(B * T, triton.cdiv(H, block_h))](
            x_BHTD, cos_BTR, sin_BTR, out_BTHD, T, H, sxb, sxh, sxt, cos_BTR.stride(0), cos_BTR.stride(1),
            ROT=cos_BTR.shape[-1], D=D, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(D), BACKWARD=backward)
    return out_BTHD.transpose(1, 2)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BHTD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos_BTR, sin_BTR)
        ctx.x_dtype = x_BHTD.dtype
        return _launch(x_BHTD, cos_BTR, sin_BTR, backward=False)

    @staticmethod
    def backward(ctx, grad_BHTD: torch.Tensor):
        cos_BTR, sin_BTR = ctx.saved_tensors
        return _launch(grad_BHTD, cos_BTR, sin_BTR, backward=True).to(ctx.x_dtype), None, None


def apply_rotary(x_BHTD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor) -> torch.Tensor:
    """As ``kernels.rotary.apply_rotary``; the cos / sin tables get no gradient (they never need one)."""
    if cos_BTR.requires_grad or sin_BTR.requires_grad:
        raise ValueError("triton apply_rotary does not differentiate the cos / sin tables")
    return _Rotary.apply(x_BHTD, cos_BTR, sin_BTR)
