"""Fused RMSNorm forward and backward in Triton (CUDA): the plain, the (1 + w) offset and the gated variant.

One kernel per direction; constexpr flags pick the variant. The forward rounds where the torch references
(``kernels/tokenwise/norm.py``) round, so outputs match them to the last bit but for the fp32 summation order; the
backward works in fp32 throughout. Letters as in DEVELOPERS.md, read generically: N rows (x's leading dims flattened:
the tokens, or tokens x heads for a per-head norm), D the normalised last dim (hidden size or a head dim); here also
J the backward's programs, each summing its rows' weight gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_DIM = 16384  # one row per register tile; no model here comes close
_TILE = 4096  # elements per program: BLOCK_N rows x BLOCK_D columns
_BWD_PROGRAMS = 1024  # each accumulates its rows' weight gradient; the partial sums are added in torch


@triton.jit
def _fwd_kernel(X, W, Z, Y, RSTD, N, D, eps, stride_x, stride_z, stride_y,
                OFFSET: tl.constexpr, GATED: tl.constexpr, ROUND_XHAT: tl.constexpr, ROUND_P: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # int64: N * D may pass 2^31
    cols = tl.arange(0, BLOCK_D)
    row_ok, col_ok = rows < N, cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    xhat = x * rstd[:, None]
    if ROUND_XHAT:  # the reference casts the normalised x back to x's dtype before the weight
        xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    if OFFSET:
        w = w + 1.0
    y = xhat * w[None, :]
    if GATED:
        if ROUND_P:  # w * xhat is rounded to x's dtype when the weight is no wider
            y = y.to(X.dtype.element_ty).to(tl.float32)
        z = tl.load(Z + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y * z * tl.sigmoid(z)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _bwd_kernel(X, W, Z, DY, RSTD, DX, DZ, DW, N, D, stride_x, stride_z, stride_dy, stride_dx, stride_dz,
                OFFSET: tl.constexpr, GATED: tl.constexpr, ROUND_XHAT: tl.constexpr, ROUND_P: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    if OFFSET:
        w = w + 1.0
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(pid * BLOCK_N, N, tl.num_programs(0) * BLOCK_N):
        rows = start.to(tl.int64) + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]
        xhat_out = xhat  # the value the weight multiplied in the forward
        if ROUND_XHAT:
            xhat_out = xhat.to(X.dtype.element_ty).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if GATED:
            z = tl.load(Z + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(z)
            normed = xhat_out * w[None, :]
            if ROUND_P:
                normed = normed.to(X.dtype.element_ty).to(tl.float32)
            dz = dy * normed * sig * (1.0 + z * (1.0 - sig))  # d silu(z) / dz = sig (1 + z (1 - sig))
            tl.store(DZ + rows[:, None] * stride_dz + cols[None, :], dz.to(DZ.dtype.element_ty), mask=mask)
            dy = dy * z * sig
        dw += tl.sum(dy * xhat_out, axis=0)
        dxhat = dy * w[None, :]
        # xhat = x * rstd(x): dx = rstd * (dxhat - xhat * mean(dxhat * xhat)) per row
        dx = rstd[:, None] * (dxhat - xhat * (tl.sum(dxhat * xhat, axis=1) / D)[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + pid * D + cols, dw, mask=col_ok)


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """[N, D] view with unit column stride (the kernels index columns densely), copying only if needed."""
    t_ND = t.reshape(-1, D)
    return t_ND if t_ND.stride(-1) == 1 else t_ND.contiguous()


def _blocks(D: int) -> tuple[int, int, int]:
    if D > _MAX_DIM:
        raise ValueError(f"triton rms_norm supports a normalised dim up to {_MAX_DIM}, got {D}")
    block_d = triton.next_power_of_2(D)
    return max(1, _TILE // block_d), block_d, 8 if block_d >= 4096 else 4


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor | None, eps: float, offset: bool,
                out_dtype: torch.dtype) -> torch.Tensor:
        D = x.shape[-1]
        weight = weight.contiguous()
        x_ND = _rows(x, D)
        z_ND = _rows(z, D) if z is not None else x_ND  # unused when not gated
        N = x_ND.shape[0]
        y_ND = torch.empty(N, D, device=x.device, dtype=out_dtype)
        rstd_N = torch.empty(N, device=x.device, dtype=torch.float32)
        block_n, block_d, warps = _blocks(D)
        flags = dict(OFFSET=offset, GATED=z is not None, ROUND_XHAT=not offset,
                     ROUND_P=torch.promote_types(weight.dtype, x.dtype) == x.dtype)
        _fwd_kernel[(triton.cdiv(N, block_n),)](
            x_ND, weight, z_ND, y_ND, rstd_N, N, D, eps, x_ND.stride(0), z_ND.stride(0), y_ND.stride(0),
            **flags, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps)
        ctx.save_for_backward(x_ND, weight, z_ND if z is not None else None, rstd_N)
        ctx.flags, ctx.x_shape = flags, x.shape
        return y_ND.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_ND, weight, z_ND, rstd_N = ctx.saved_tensors
        N, D = x_ND.shape
        dy_ND = _rows(dy, D)
        dx_ND = torch.empty_like(x_ND)
        dz_ND = torch.empty_like(z_ND) if z_ND is not None else None
        block_n, block_d, warps = _blocks(D)
        programs = max(1, min(_BWD_PROGRAMS, triton.cdiv(N, block_n)))
        dw_JD = torch.empty(programs, D, device=x_ND.device, dtype=torch.float32)
        z_arg = z_ND if z_ND is not None else x_ND
        dz_arg = dz_ND if dz_ND is not None else dx_ND
        _bwd_kernel[(programs,)](
            x_ND, weight, z_arg, dy_ND, rstd_N, dx_ND, dz_arg, dw_JD, N, D, x_ND.stride(0), z_arg.stride(0),
            dy_ND.stride(0), dx_ND.stride(0), dz_arg.stride(0),
            **ctx.flags, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps)
        dz = dz_ND.view(ctx.x_shape) if dz_ND is not None else None
        return dx_ND.view(ctx.x_shape), dw_JD.sum(0).to(weight.dtype), dz, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, None, eps, False, torch.promote_types(x.dtype, weight.dtype))


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, None, eps, True, x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, z, eps, False, x.dtype)
