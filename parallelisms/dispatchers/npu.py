"""torch_npu pieces of the NPU dispatch paths, imported only there.

Signatures (torch_npu / op-plugin docs): ``npu_grouped_matmul(x: list, weight: list, *, group_list,
split_item, group_type, group_list_type)``; ``npu_alltoallv_gmm(gmm_x, gmm_weight, hcom, ep_world_size,
send_counts, recv_counts, *, trans_gmm_weight, permute_out_flag) -> (gmm_y, mm_y, permute_out)`` (all-to-all,
sort by local expert, grouped matmul); ``npu_gmm_alltoallv(gmm_x, gmm_weight, hcom, ep_world_size, send_counts,
recv_counts, *, trans_gmm_weight) -> (y, mm_y)`` (grouped matmul, unsort, all-to-all). Counts are per (rank,
local expert), rank-major, in the direction of that call. The MC2 ops have no autograd: the Functions below
pair them as the FSDPTurbo seed does (each one's backward is the other op, plus a K-grouped matmul for the
weights).
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist


def torch_npu():
    return importlib.import_module("torch_npu")


def has_mc2() -> bool:
    try:
        module = torch_npu()
    except ImportError:
        return False
    return hasattr(module, "npu_alltoallv_gmm") and hasattr(module, "npu_gmm_alltoallv")


def hccl_comm_name(group: dist.ProcessGroup) -> str:
    """The HCCL communicator name the MC2 ops address the ep group by."""
    rank = dist.get_global_rank(group, dist.get_rank(group))
    return group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)


def _gmm(x_MK: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
    return torch_npu().npu_grouped_matmul([x_MK], [w_GKN], group_list=counts_G, split_item=2, group_type=0,
                                          group_list_type=1)[0]


def _weight_grad(x_MK: torch.Tensor, grad_MN: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
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
        return _gmm(grad_MN, w_GKN.transpose(1, 2), counts_G), _weight_grad(x_MK, grad_MN, counts_G), None


def grouped_matmul(x_MK: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
    return _GroupedMatmul.apply(x_MK, w_GKN.to(x_MK.dtype), counts_G.to(torch.int64))


def _zero_empty(grad_w: torch.Tensor, counts_L: list[int]) -> torch.Tensor:
    # MC2 cannot fall back per rank (it is a collective), so an expert without rows keeps MC2 and gets an
    # explicit zero gradient instead of whatever a K-grouped matmul leaves for an empty group.
    empty = [l for l, c in enumerate(counts_L) if c == 0]
    if empty:
        grad_w[empty] = 0
    return grad_w


class Mc2Dispatch(torch.autograd.Function):
    """x_MD (global-expert order) -> all-to-all -> local-expert order -> @ w_LND^T: [R, N]."""

    @staticmethod
    def forward(ctx, x_MD, w_LND, hcom, splits) -> torch.Tensor:
        ep = len(splits.send)
        y_RN, _, x_RD = torch_npu().npu_alltoallv_gmm(x_MD, w_LND, hcom, ep, splits.send_counts_E,
                                                      splits.recv_counts_PL, trans_gmm_weight=True,
                                                      permute_out_flag=True)
        ctx.save_for_backward(w_LND, x_RD)
        ctx.meta = hcom, splits
        return y_RN

    @staticmethod
    def backward(ctx, grad_RN):
        w_LND, x_RD = ctx.saved_tensors
        hcom, splits = ctx.meta
        grad_RN = grad_RN.contiguous()
        counts_L = splits.recv_counts_dev_PL.sum(0)
        grad_MD, _ = torch_npu().npu_gmm_alltoallv(grad_RN, w_LND, hcom, len(splits.send), splits.recv_counts_PL,
                                                   splits.send_counts_E)
        return grad_MD, _zero_empty(_weight_grad(grad_RN, x_RD, counts_L), splits.counts_L), None, None


class Mc2Combine(torch.autograd.Function):
    """h_RI (local-expert order) @ w_LDI^T -> arrival order -> all-to-all back: [M, D] in global-expert order."""

    @staticmethod
    def forward(ctx, h_RI, w_LDI, hcom, splits) -> torch.Tensor:
        y_MD, _ = torch_npu().npu_gmm_alltoallv(h_RI, w_LDI, hcom, len(splits.send), splits.recv_counts_PL,
                                                splits.send_counts_E, trans_gmm_weight=True)
        ctx.save_for_backward(h_RI, w_LDI)
        ctx.meta = hcom, splits
        return y_MD

    @staticmethod
    def backward(ctx, grad_MD):
        h_RI, w_LDI = ctx.saved_tensors
        hcom, splits = ctx.meta
        grad_RI, _, grad_RD = torch_npu().npu_alltoallv_gmm(grad_MD.contiguous(), w_LDI, hcom, len(splits.send),
                                                            splits.send_counts_E, splits.recv_counts_PL,
                                                            permute_out_flag=True)
        counts_L = splits.recv_counts_dev_PL.sum(0)
        return grad_RI, _zero_empty(_weight_grad(grad_RD, h_RI, counts_L), splits.counts_L), None, None
