"""Triton (CUDA) kernels for the K-to-one steps of ``kernels.moe.permute``: each reads every routed row once. Same
signatures as the torch references there (``gather_sum_torch``, ``unpermute_backward_torch``).

``gather_sum``: out[n] = sum_k w[n, k] * src[inv[n*K + k]] (unpermute forward; without weights, the permute
backward), accumulated in fp32, one rounding to src's dtype. The torch version gathers the rows into a
transient, in K chunks of tokens, and reduces them with a ``bmm`` of [C, 1, K] x [C, K, D]: three passes
over the rows and a GEMM shape cuBLAS runs poorly.
``unpermute_backward``: for every slot (n, k) with row m = inv[n*K + k]: grad_y[m] = w[n, k] * grad[n] and
grad_w[n, k] = <grad[n], y[m]> (fp32), in one pass instead of a gather, a batched dot and a scaling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.permute import _materialised

_BLOCK_D = 1024


@triton.jit
def _gather_sum_kernel(SRC, INV, W, OUT, K: tl.constexpr, D: tl.constexpr, HAS_W: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(INV + n * K + k).to(tl.int64)
        x = tl.load(SRC + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:  # the weight rounded to the rows' dtype first, as the torch bmm sees it
            x *= tl.load(W + n * K + k).to(SRC.dtype.element_ty).to(tl.float32)
        acc += x
    tl.store(OUT + n * D + offs, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _unpermute_backward_kernel(GRAD, Y, INV, W, GRAD_Y, GRAD_W, K: tl.constexpr, D: tl.constexpr,
                               BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    for k in tl.static_range(K):
        row = tl.load(INV + n * K + k).to(tl.int64)
        w = tl.load(W + n * K + k).to(GRAD.dtype.element_ty).to(tl.float32)
        dot = 0.0
        for d0 in tl.static_range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            mask = offs < D
            g = tl.load(GRAD + n * D + offs, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(Y + row * D + offs, mask=mask, other=0.0).to(tl.float32)
            dot += tl.sum(g * y, axis=0)
            tl.store(GRAD_Y + row * D + offs, (g * w).to(GRAD_Y.dtype.element_ty), mask=mask)
        tl.store(GRAD_W + n * K + k, dot.to(GRAD_W.dtype.element_ty))


def gather_sum(src_MD: torch.Tensor, inv_M: torch.Tensor, N: int, K: int,
               weights_NK: torch.Tensor | None = None) -> torch.Tensor:
    # The kernel reads data_ptr(): a functional collective's result must be waited for first.
    src_MD, inv_M = _materialised(src_MD).contiguous(), _materialised(inv_M)
    weights_NK = _materialised(weights_NK) if weights_NK is not None else None
    D = src_MD.shape[-1]
    out_ND = src_MD.new_empty(N, D)
    if N and K:
        block = min(_BLOCK_D, triton.next_power_of_2(D))
        w = weights_NK.contiguous() if weights_NK is not None else inv_M  # unread when HAS_W is false
        _gather_sum_kernel[(N, triton.cdiv(D, block))](src_MD, inv_M, w, out_ND, K=K, D=D,
                                                       HAS_W=weights_NK is not None, BLOCK_D=block)
    elif N:
        out_ND.zero_()
    return out_ND


def unpermute_backward(grad_ND: torch.Tensor, y_MD: torch.Tensor, weights_NK: torch.Tensor, order_M: torch.Tensor,
                       inv_M: torch.Tensor, need_y: bool = True, need_w: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (grad_y_MD in y's dtype, grad_w_NK in the weights' dtype): both, whatever is needed (one pass computes
    them together), for a permutation ``inv_M`` (each row written once per slot reading it). ``order_M`` unused."""
    grad_ND, y_MD, weights_NK = _materialised(grad_ND).contiguous(), y_MD.contiguous(), weights_NK.contiguous()
    N, K = weights_NK.shape
    D = y_MD.shape[-1]
    grad_y_MD = torch.empty_like(y_MD)
    grad_w_NK = torch.empty_like(weights_NK)
    if N and K:
        block = min(_BLOCK_D, triton.next_power_of_2(D))
        _unpermute_backward_kernel[(N,)](grad_ND, y_MD, inv_M, weights_NK, grad_y_MD, grad_w_NK, K=K, D=D,
                                         BLOCK_D=block)
    return grad_y_MD, grad_w_NK
