"""Ascend NPU kernels of the dispatch path: torch_npu's fused MoE token permute / unpermute and its grouped
matmul (with the autograd torch_npu does not give it), behind the signatures of the torch references in
``kernels/permute.py`` and ``kernels/grouped_mm.py``. Chosen by ``kernels/registry.py`` on NPU.

Signatures (torch_npu / op-plugin docs): ``npu_moe_token_permute(tokens, indices) -> (permuted, sorted_indices)``
(rows in a stable order by expert id); ``npu_moe_token_unpermute(permuted, sorted_indices, probs)`` (weights applied
and summed over k); ``npu_grouped_matmul(x: list, weight: list, *, group_list, split_item, group_type,
group_list_type)``. torch_npu is looked up at each call, not at import: the MC2 dispatcher
(``parallelisms/dispatchers/npu.py``) imports ``weight_grad`` from here on every machine.
Letters: N tokens, K top-k, M = N*K routed rows, D hidden; for the GEMMs M rows, G groups, K in, N out.
"""

from __future__ import annotations

import importlib

import torch

from kernels.grouped_mm import per_group_mm


def torch_npu():
    return importlib.import_module("torch_npu")


def moe_token_permute(x_ND: torch.Tensor, experts_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``kernels.permute.moe_token_permute_torch`` (the same row order); the state is torch_npu's row map."""
    return torch_npu().npu_moe_token_permute(x_ND, experts_NK.to(torch.int32))


def moe_token_unpermute(y_MD: torch.Tensor, weights_NK: torch.Tensor, row_map_M: torch.Tensor) -> torch.Tensor:
    """As ``kernels.permute.moe_token_unpermute_torch``, from ``moe_token_permute``'s row map."""
    return torch_npu().npu_moe_token_unpermute(y_MD.to(weights_NK.dtype), row_map_M, probs=weights_NK)


def _gmm(x_MK: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
    return torch_npu().npu_grouped_matmul([x_MK], [w_GKN], group_list=counts_G, split_item=2, group_type=0,
                                          group_list_type=1)[0]


def weight_grad(x_MK: torch.Tensor, grad_MN: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
    """[G, K, N]: x^T grad per group of rows (grouped along the contraction dim, group_type 2)."""
    return torch_npu().npu_grouped_matmul([x_MK.t()], [grad_MN], group_list=counts_G, split_item=3, group_type=2,
                                          group_list_type=1)[0]


class _GroupedMatmul(torch.autograd.Function):
    """y[rows of g] = x[rows of g] @ w[g]; torch_npu's grouped matmul has no autograd of its own."""

    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_MK, w_GKN, counts_G)
        return _gmm(x_MK, w_GKN, counts_G)

    @staticmethod
    def backward(ctx, grad_MN: torch.Tensor):
        x_MK, w_GKN, counts_G = ctx.saved_tensors
        grad_MN = grad_MN.contiguous()
        return _gmm(grad_MN, w_GKN.transpose(1, 2), counts_G), weight_grad(x_MK, grad_MN, counts_G), None


def grouped_mm(x_MK: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor,
               counts_host: list[int] | None = None) -> torch.Tensor:
    """As ``kernels.grouped_mm.per_group_mm``, in torch_npu's grouped matmul. A group without rows falls back to
    that loop, as the seeds do (nothing relies on what the K-grouped weight-gradient matmul leaves for an empty
    group), decided from ``counts_host`` where the caller has them (the EP dispatchers: no sync), else from
    ``counts_G`` (one sync)."""
    host = counts_G.tolist() if counts_host is None else counts_host
    if min(host, default=0) == 0:
        return per_group_mm(x_MK, w_GKN, counts_G, host)
    return _GroupedMatmul.apply(x_MK, w_GKN.to(x_MK.dtype), counts_G.to(torch.int64))
