"""DeltaNet's short convolution and silu (``kernels/linear_attention/short_conv.py``'s ``causal_conv1d_silu``) in Triton
(CUDA).

Packed documents are masked in place: a tap reads the token j back only when that token is in the same document
(``docs.ids_BT``), so a packed row runs the same launch as a row that is one sequence. FLA's variable-length kernel
instead tiles every document in chunks of its own, and every document's last chunk is partial.

Nothing but x is kept for the backward (as FLA keeps it). The backward is two passes: the gradient at the
pre-activations (``da = dy * silu'(conv(x))``, the forward's pass with dy), then dx and dw from it. The weight
gradient is summed per tile of ``BWD_TILE`` tokens, then over the tiles: deterministic. Letters: F the conv channels, W the taps, N tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.attention import Documents

Tensor = torch.Tensor

# Tiles (tokens, channels, warps), fixed rather than autotuned: no tuning pass at the first call, the same launch
# on every run. The fastest of those timed on an H200 by scripts/bench_deltanet.py --conv-tiles
# (docs/results.md#kernels-alone, row 31).
FWD_TILE = (32, 128, 4)
BWD_TILE = (64, 64, 4)  # the weight gradient keeps one partial sum per tile of tokens


@triton.jit
def _pre_activation(x_b, ids_b, w_ptr, o_p, m_p, id_p, o_f, m_f, stride_xt, W: tl.constexpr,
                    HAS_DOCS: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr):
    """conv(x) at the tokens ``o_p`` [BT] and channels ``o_f`` [BF], in fp32: tap j reads token p - j (weight column
    W-1-j, nn.Conv1d's order) where it exists and, with documents, is in p's document."""
    acc = tl.zeros((BT, BF), dtype=tl.float32)
    for j in tl.static_range(W):
        o_q = o_p - j
        m_q = m_p & (o_q >= 0)
        if HAS_DOCS:
            m_q = m_q & (tl.load(ids_b + o_q, mask=m_q, other=-1) == id_p)
        x = tl.load(x_b + o_q[:, None] * stride_xt + o_f[None, :], mask=m_q[:, None] & m_f[None, :], other=0.0)
        w = tl.load(w_ptr + o_f * W + (W - 1 - j), mask=m_f, other=0.0)
        acc += x.to(tl.float32) * w.to(tl.float32)[None, :]
    return acc


@triton.jit
def _silu_kernel(X, Wt, IDS, DY, OUT, T, F, stride_xb, stride_xt, stride_ib, W: tl.constexpr,
                 HAS_DOCS: tl.constexpr, GRAD: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr):
    """OUT = silu(a) for a = conv(x); with GRAD, OUT = dy * silu'(a), the gradient at a (the backward's first half)."""
    i_f, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_f = i_f * BF + tl.arange(0, BF)
    m_t, m_f = o_t < T, o_f < F
    m_tf = m_t[:, None] & m_f[None, :]
    ids_b = IDS + i_b * stride_ib
    id_t = o_t  # unused without documents
    if HAS_DOCS:
        id_t = tl.load(ids_b + o_t, mask=m_t, other=-2)
    a = _pre_activation(X + i_b * stride_xb, ids_b, Wt, o_t, m_t, id_t, o_f, m_f, stride_xt, W, HAS_DOCS, BT, BF)
    sig = tl.sigmoid(a)
    if GRAD:
        dy = tl.load(DY + (i_b * T + o_t[:, None]) * F + o_f[None, :], mask=m_tf, other=0.0).to(tl.float32)
        out = dy * sig * (1.0 + a * (1.0 - sig))  # d silu(a) / da = sig (1 + a (1 - sig))
    else:
        out = a * sig
    tl.store(OUT + (i_b * T + o_t[:, None]) * F + o_f[None, :], out.to(OUT.dtype.element_ty), mask=m_tf)


@triton.jit
def _conv_backward_kernel(X, Wt, IDS, DA, DX, DW, T, F, stride_xb, stride_xt, stride_ib, W: tl.constexpr,
                          HAS_DOCS: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr):
    """dx and this tile's share of dw from da, the gradient at the pre-activations."""
    i_f, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_f = i_f * BF + tl.arange(0, BF)
    m_t, m_f = o_t < T, o_f < F
    x_b, ids_b, da_b = X + i_b * stride_xb, IDS + i_b * stride_ib, DA + i_b * T * F
    id_t = o_t  # unused without documents
    if HAS_DOCS:
        id_t = tl.load(ids_b + o_t, mask=m_t, other=-2)
    dx = tl.zeros((BT, BF), dtype=tl.float32)
    for s in tl.static_range(W):  # token t + s reads x_t through its tap s (weight column W-1-s), in t's document
        o_p = o_t + s
        reads = o_p < T
        if HAS_DOCS:
            reads = reads & (tl.load(ids_b + o_p, mask=reads, other=-3) == id_t)
        da = tl.load(da_b + o_p[:, None] * F + o_f[None, :], mask=reads[:, None] & m_f[None, :], other=0.0)
        w = tl.load(Wt + o_f * W + (W - 1 - s), mask=m_f, other=0.0)
        dx += da.to(tl.float32) * w.to(tl.float32)[None, :]
    tl.store(DX + (i_b * T + o_t[:, None]) * F + o_f[None, :], dx.to(DX.dtype.element_ty),
             mask=m_t[:, None] & m_f[None, :])
    da_t = tl.load(da_b + o_t[:, None] * F + o_f[None, :], mask=m_t[:, None] & m_f[None, :], other=0.0)
    for j in tl.static_range(W):  # dw[:, W-1-j] += sum over t of da_t x_{t-j}, in t's document
        o_q = o_t - j
        m_q = m_t & (o_q >= 0)
        if HAS_DOCS:
            m_q = m_q & (tl.load(ids_b + o_q, mask=m_q, other=-1) == id_t)
        x = tl.load(x_b + o_q[:, None] * stride_xt + o_f[None, :], mask=m_q[:, None] & m_f[None, :], other=0.0)
        dw_tile = tl.sum(da_t.to(tl.float32) * x.to(tl.float32), axis=0)
        tl.store(DW + ((i_b * tl.num_programs(1) + i_t) * F + o_f) * W + (W - 1 - j), dw_tile, mask=m_f)


def _silu(x_BTF: Tensor, w_FW: Tensor, ids_BT: Tensor | None, dy_BTF: Tensor | None) -> Tensor:
    """silu(conv(x)), or with ``dy`` its gradient at conv(x)."""
    B, T, F = x_BTF.shape
    out_BTF = torch.empty(B, T, F, dtype=x_BTF.dtype if dy_BTF is None else dy_BTF.dtype, device=x_BTF.device)
    ids = x_BTF if ids_BT is None else ids_BT  # a placeholder pointer without documents
    BT, BF, warps = FWD_TILE
    _silu_kernel[triton.cdiv(F, BF), triton.cdiv(T, BT), B](
        x_BTF, w_FW, ids, dy_BTF, out_BTF, T, F, x_BTF.stride(0), x_BTF.stride(1),
        0 if ids_BT is None else ids.stride(0), W=w_FW.shape[1], HAS_DOCS=ids_BT is not None, GRAD=dy_BTF is not None,
        BT=BT, BF=BF, num_warps=warps)
    return out_BTF


class _ShortConvSilu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BTF: Tensor, w_FW: Tensor, ids_BT: Tensor | None) -> Tensor:
        if x_BTF.stride(-1) != 1:
            x_BTF = x_BTF.contiguous()
        w_FW = w_FW.contiguous()
        ids_BT = None if ids_BT is None else ids_BT.long().contiguous()
        ctx.save_for_backward(x_BTF, w_FW, ids_BT)
        return _silu(x_BTF, w_FW, ids_BT, None)

    @staticmethod
    def backward(ctx, dy_BTF: Tensor):
        x_BTF, w_FW, ids_BT = ctx.saved_tensors
        B, T, F = x_BTF.shape
        W = w_FW.shape[1]
        da_BTF = _silu(x_BTF, w_FW, ids_BT, dy_BTF.contiguous())
        BT, BF, warps = BWD_TILE
        N = triton.cdiv(T, BT)
        dx_BTF = torch.empty(B, T, F, dtype=x_BTF.dtype, device=x_BTF.device)
        dw_NFW = torch.empty(B * N, F, W, dtype=torch.float32, device=x_BTF.device)
        ids = x_BTF if ids_BT is None else ids_BT
        _conv_backward_kernel[triton.cdiv(F, BF), N, B](
            x_BTF, w_FW, ids, da_BTF, dx_BTF, dw_NFW, T, F, x_BTF.stride(0), x_BTF.stride(1),
            0 if ids_BT is None else ids.stride(0), W=W, HAS_DOCS=ids_BT is not None, BT=BT, BF=BF, num_warps=warps)
        return dx_BTF, dw_NFW.sum(0).to(w_FW.dtype), None


def causal_conv1d_silu(x_BTF: Tensor, w_FW: Tensor, docs: Documents | None) -> Tensor:
    """silu(causal depthwise conv) of x [B, T, F] with taps w [F, W], restarting at every packed document."""
    return _ShortConvSilu.apply(x_BTF, w_FW, None if docs is None else docs.ids_BT)
