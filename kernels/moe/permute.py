"""Token permute / unpermute for MoE dispatch as gathers whose backward is a gather too.

Autograd's default for ``x[index]`` is ``index_put_(accumulate=True)``, which sorts the index on CUDA, needs
a zero-filled buffer and adds with atomics (non-deterministic). Every map here is a permutation or a
K-to-one gather whose inverse is known, so forward and backward are plain ``index_select``s plus a reduction
over K: deterministic, no zero fill, no atomics, no sort. The unpermute applies the router weights in the op
that sums over K and does not keep the weighted [M, D] product for backward, as ``out * w`` would. The torch
K-to-one gathers run in token chunks, so their transient gathered rows stay within [N, D] (what eager's
zero-filled buffer costs), not [M, D] (512 MiB per layer at the Qwen3-30B-A3B shapes).

Letters as in DEVELOPERS.md (M = N*K routed rows, here in expert order).
``order_M``: flat (token, k) slot of each expert-ordered row (a stable argsort of the expert ids);
``inv_M``: its inverse (row of each flat slot); ``token_M = order_M // K``.

Kernels (chosen by ``kernels/registry.py`` from ``kernel_config``, installed per device type in
``kernels.installed``; the torch code here is the reference of each and what runs until then):
``gather_sum`` and ``unpermute_backward``, the K-to-one steps (``kernels.moe.triton_permute`` on CUDA: one pass over
the rows); ``moe_token_permute`` / ``moe_token_unpermute``, a dispatcher's whole permute and unpermute
(``kernels.moe.npu``: torch_npu's fused ops on NPU). The two token ops are chosen together: the permute's state is
what its own unpermute reads.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kernels.installed import kernel


def _materialised(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a functional collective's result (or a view of one: such views stay
    ``AsyncCollectiveTensor``s, and so does ``.to()`` to the same dtype). A Triton kernel reads ``data_ptr()``
    without going through torch dispatch, so it would neither wait for the all-to-all nor see real storage (an
    ``AsyncCollectiveTensor`` is a wrapper subclass)."""
    from core.torch_compat import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i`` (no host sync, no sort)."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype))


def gather_sum(src_MD: torch.Tensor, inv_M: torch.Tensor, N: int, K: int,
               weights_NK: torch.Tensor | None = None) -> torch.Tensor:
    """out[n] = sum_k w[n, k] * src[inv_M[n*K + k]] (w = 1 without weights; the weights rounded to src's dtype
    first), accumulated in fp32, for any map (a row may be read by several slots): the installed kernel."""
    return kernel("gather_sum", src_MD, gather_sum_torch)(src_MD, inv_M, N, K, weights_NK)


def gather_sum_torch(src_MD: torch.Tensor, inv_M: torch.Tensor, N: int, K: int,
                     weights_NK: torch.Tensor | None = None) -> torch.Tensor:
    """``gather_sum``'s reference: K chunks of tokens, a gathered transient of [N, D] instead of [M, D]."""
    D = src_MD.shape[-1]
    out_ND = src_MD.new_empty(N, D)
    chunk = max(1, -(-N // K)) if K else 1
    for n0 in range(0, N, chunk):
        n1 = min(N, n0 + chunk)
        rows_CKD = src_MD.index_select(0, inv_M[n0 * K:n1 * K]).view(n1 - n0, K, D)
        if weights_NK is None:
            torch.sum(rows_CKD, dim=1, out=out_ND[n0:n1])
        else:  # written through a [C, 1, D] view: the output is a fresh tensor, not a view
            torch.bmm(weights_NK[n0:n1].to(src_MD.dtype).unsqueeze(1), rows_CKD, out=out_ND[n0:n1].unsqueeze(1))
    return out_ND


def unpermute_backward_torch(grad_ND: torch.Tensor, y_MD: torch.Tensor, weights_NK: torch.Tensor,
                             order_M: torch.Tensor, inv_M: torch.Tensor, need_y: bool = True,
                             need_w: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``unpermute``'s y_MD (in y's dtype) and weights_NK (in theirs), each only if needed:
    grad_y[m] = w[n, k] * grad[n] and grad_w[n, k] = <grad[n], y[m]> for every slot (n, k) reading row m."""
    token_M = order_M.div(weights_NK.shape[1], rounding_mode="floor")
    grad_MD = grad_ND.contiguous().index_select(0, token_M)  # the one [M, D] buffer of the backward
    grad_w = None
    if need_w:
        # <y_m, grad_token(m)> per row as a batched dot: no [M, D] product is materialised.
        dot_M = torch.bmm(grad_MD.unsqueeze(1), y_MD.unsqueeze(2)).view(-1)
        grad_w = dot_M.index_select(0, inv_M).view_as(weights_NK).to(weights_NK.dtype)
    grad_y = None
    if need_y:
        w_M = weights_NK.reshape(-1).index_select(0, order_M).to(grad_MD.dtype)
        grad_y = grad_MD.mul_(w_M.unsqueeze(1))
    return grad_y, grad_w


class _PermuteRows(torch.autograd.Function):
    """``x[perm]`` for a permutation ``perm`` with inverse ``inv``."""

    @staticmethod
    def forward(ctx, x_RD: torch.Tensor, perm_R: torch.Tensor, inv_R: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inv_R)
        return x_RD.index_select(0, perm_R)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        (inv_R,) = ctx.saved_tensors
        return grad_RD.index_select(0, inv_R), None, None


class _PermuteTokens(torch.autograd.Function):
    """x_ND -> x_MD = x_ND[token_M]: each token copied to its K expert-ordered rows."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, token_M: torch.Tensor, inv_M: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inv_M)
        N = x_ND.shape[0]
        ctx.NK = (N, token_M.numel() // N if N else 0)
        return x_ND.index_select(0, token_M)

    @staticmethod
    def backward(ctx, grad_MD: torch.Tensor):
        (inv_M,) = ctx.saved_tensors
        return gather_sum(grad_MD, inv_M, *ctx.NK), None, None  # the K rows of token n: inv_M[n*K:(n+1)*K]


class _Unpermute(torch.autograd.Function):
    """y_ND[n] = sum_k w[n, k] * y_MD[inv_M[n*K + k]], in y's dtype (as ``models.moe.combine``)."""

    @staticmethod
    def forward(ctx, y_MD: torch.Tensor, weights_NK: torch.Tensor, order_M: torch.Tensor,
                inv_M: torch.Tensor, permutation: bool) -> torch.Tensor:
        N, K = weights_NK.shape
        # The all-to-all's output (and maps or weights that came through one) are saved and read by Triton.
        y_MD, weights_NK, order_M, inv_M = (_materialised(t) for t in (y_MD, weights_NK, order_M, inv_M))
        ctx.save_for_backward(y_MD, weights_NK, order_M, inv_M)
        ctx.permutation = permutation
        # A fresh tensor, not a view (FSDP2 warns about module outputs that are views: an in-place op on one
        # would drop its pre-backward hook).
        return gather_sum(y_MD, inv_M, N, K, weights_NK)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        y_MD, weights_NK, order_M, inv_M = ctx.saved_tensors
        # The installed kernel may write a row once per slot reading it (Triton does): only for a permutation.
        backward = (kernel("unpermute_backward", y_MD, unpermute_backward_torch) if ctx.permutation
                    else unpermute_backward_torch)
        grad_y, grad_w = backward(grad_ND, y_MD, weights_NK, order_M, inv_M, *ctx.needs_input_grad[:2])
        return grad_y, grad_w, None, None, None


class RoutedRows(NamedTuple):
    """Routed rows ``src_RD[index_M]`` before the gather runs: each source row read by K = M / R of them,
    ``inv_M`` the row of each (r, k) slot (K = 1: a permutation), as ``permute_tokens`` takes them. A grouped
    GEMM with a ``gathered`` form (``kernels.float8.permute``) fuses the gather into its first pass."""

    src_RD: torch.Tensor
    index_M: torch.Tensor
    inv_M: torch.Tensor

    def gather(self) -> torch.Tensor:
        return permute_tokens(self.src_RD, self.index_M, self.inv_M)


def permute_rows(x_RD: torch.Tensor, perm_R: torch.Tensor, inv_R: torch.Tensor) -> torch.Tensor:
    return _PermuteRows.apply(x_RD, perm_R, inv_R)


def permute_tokens(x_ND: torch.Tensor, token_M: torch.Tensor, inv_M: torch.Tensor) -> torch.Tensor:
    return _PermuteTokens.apply(x_ND, token_M, inv_M)


def unpermute(y_MD: torch.Tensor, weights_NK: torch.Tensor, order_M: torch.Tensor, inv_M: torch.Tensor,
              permutation: bool = True) -> torch.Tensor:
    """``order_M``: the flat (token, k) slot of each row of ``y_MD``; ``inv_M``: the row each slot reads.
    ``permutation=False`` where slots may repeat a row (a masked slot of weight 0 reading a valid slot's row,
    as in the dedup dispatcher, with fewer rows than slots): its backward then runs the torch gathers, whose
    row gradient uses each row's own slot only."""
    return _Unpermute.apply(y_MD, weights_NK, order_M, inv_M, permutation)


def moe_token_permute(x_ND: torch.Tensor, experts_NK: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """x_ND -> (x_MD: each token's K rows in a stable order by expert id, the state ``moe_token_unpermute`` reads):
    the installed kernel."""
    return kernel("moe_token_permute", x_ND, moe_token_permute_torch)(x_ND, experts_NK)


def moe_token_unpermute(y_MD: torch.Tensor, weights_NK: torch.Tensor, state: Any) -> torch.Tensor:
    """y_ND[n] = sum_k w[n, k] * (the row of slot (n, k)), from ``moe_token_permute``'s state: the installed
    kernel (the same implementation as the permute's)."""
    return kernel("moe_token_unpermute", y_MD, moe_token_unpermute_torch)(y_MD, weights_NK, state)


def moe_token_permute_torch(x_ND: torch.Tensor, experts_NK: torch.Tensor
                            ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The reference: a stable argsort of the expert ids and the gathers above; state (order_M, inv_M)."""
    rows, state = moe_token_routed_rows(x_ND, experts_NK)
    return rows.gather(), state


def moe_token_routed_rows(x_ND: torch.Tensor, experts_NK: torch.Tensor
                          ) -> tuple[RoutedRows, tuple[torch.Tensor, torch.Tensor]]:
    """``moe_token_permute_torch`` with the gather not yet run (for a grouped GEMM that fuses it): the rows and
    the state (order_M, inv_M) ``moe_token_unpermute_torch`` reads."""
    order_M = torch.argsort(experts_NK.flatten(), stable=True)
    inv_M = inverse_permutation(order_M)
    return RoutedRows(x_ND, order_M // experts_NK.shape[1], inv_M), (order_M, inv_M)


def moe_token_unpermute_torch(y_MD: torch.Tensor, weights_NK: torch.Tensor,
                              state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return unpermute(y_MD, weights_NK, *state)
