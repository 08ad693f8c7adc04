"""Ascend NPU kernels of the dispatch path: torch_npu's fused MoE token permute / unpermute and its grouped
matmul (with the autograd torch_npu does not give it), behind the signatures of the torch references in
``kernels/moe/permute.py`` and ``kernels/moe/grouped_mm.py``. Chosen by ``kernels/registry.py`` on NPU.

Signatures (torch_npu / op-plugin docs): ``npu_moe_token_permute(tokens, indices) -> (permuted, sorted_indices)``
(rows in a stable order by expert id); ``npu_moe_token_unpermute(permuted, sorted_indices, probs)`` (weights applied
and summed over k); ``npu_grouped_matmul(x: list, weight: list, *, group_list, split_item, group_type,
group_list_type)``. torch_npu is looked up at each call, not at import: the MC2 dispatcher
(``parallelisms/dispatchers/npu.py``) imports ``weight_grad`` from here on every machine.
Documented limits kept here: the permute takes bf16 tokens and int64 indices; the grouped matmul rejects a group
list of length 1, so one expert (one expert per ep rank: the debug model at ep8) is one plain matmul.
Letters as in DEVELOPERS.md (for the GEMMs: M rows, G groups, i in-features, o out-features).
"""

from __future__ import annotations

import importlib

import torch

from kernels.moe.grouped_mm import per_group_mm


def torch_npu():
    return importlib.import_module("torch_npu")


PERMUTE_DTYPES = (torch.bfloat16,)  # npu_moe_token_permute's tokens


def moe_token_permute(x_ND: torch.Tensor, experts_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``kernels.moe.permute.moe_token_permute_torch`` (the same row order); the state is torch_npu's row map."""
    if x_ND.dtype not in PERMUTE_DTYPES:
        raise TypeError(f"torch_npu's npu_moe_token_permute takes bf16 tokens, got {x_ND.dtype}: on NPU train with "
                        "train.mixed_precision=bf16 (or auto)")
    return torch_npu().npu_moe_token_permute(x_ND, experts_NK.to(torch.int64))


def moe_token_unpermute(y_MD: torch.Tensor, weights_NK: torch.Tensor, row_map_M: torch.Tensor) -> torch.Tensor:
    """As ``kernels.moe.permute.moe_token_unpermute_torch``, from ``moe_token_permute``'s row map."""
    return torch_npu().npu_moe_token_unpermute(y_MD.to(weights_NK.dtype), row_map_M, probs=weights_NK)


def _gmm(x_Mi: torch.Tensor, w_Gio: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
    return torch_npu().npu_grouped_matmul([x_Mi], [w_Gio], group_list=counts_G, split_item=2, group_type=0,
                                          group_list_type=1)[0]


def weight_grad(x_Mi: torch.Tensor, grad_Mo: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
    """[G, i, o]: x^T grad per group of rows (grouped along the contraction dim, group_type 2)."""
    if counts_G.shape[0] == 1:  # torch_npu rejects a group list of length 1: the one group is one matmul
        return (x_Mi.t() @ grad_Mo)[None]
    return torch_npu().npu_grouped_matmul([x_Mi.t()], [grad_Mo], group_list=counts_G, split_item=3, group_type=2,
                                          group_list_type=1)[0]


class _GroupedMatmul(torch.autograd.Function):
    """y[rows of g] = x[rows of g] @ w[g]; torch_npu's grouped matmul has no autograd of its own."""

    @staticmethod
    def forward(ctx, x_Mi: torch.Tensor, w_Gio: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_Mi, w_Gio, counts_G)
        return _gmm(x_Mi, w_Gio, counts_G)

    @staticmethod
    def backward(ctx, grad_Mo: torch.Tensor):
        x_Mi, w_Gio, counts_G = ctx.saved_tensors
        grad_Mo = grad_Mo.contiguous()
        return _gmm(grad_Mo, w_Gio.transpose(1, 2), counts_G), weight_grad(x_Mi, grad_Mo, counts_G), None


def grouped_mm(x_Mi: torch.Tensor, w_Gio: torch.Tensor, counts_G: torch.Tensor,
               counts_host: list[int] | None = None) -> torch.Tensor:
    """As ``kernels.moe.grouped_mm.per_group_mm``, in torch_npu's grouped matmul. A group without rows falls back to
    that loop, as the seeds do (nothing relies on what the contraction-grouped weight-gradient matmul leaves for an
    empty group), and so does a single group (one matmul: torch_npu rejects a group list of length 1); decided from
    ``counts_host`` where the caller has them (the EP dispatchers: no sync), else from ``counts_G`` (one sync)."""
    host = counts_G.tolist() if counts_host is None else counts_host
    if min(host, default=0) == 0 or len(host) == 1:
        return per_group_mm(x_Mi, w_Gio, counts_G, host)
    return _GroupedMatmul.apply(x_Mi, w_Gio.to(x_Mi.dtype), counts_G.to(torch.int64))
