"""The MC2 collectives of the ``mc2`` dispatcher (the all-to-all fused with the grouped matmul): a dispatcher,
not a kernel, so they live here; the NPU kernels (token permute / unpermute, grouped matmul) are in
``kernels/npu_moe.py``, chosen by the kernel registry.

Signatures (torch_npu / op-plugin docs): ``npu_alltoallv_gmm(gmm_x, gmm_weight, hcom, ep_world_size,
send_counts, recv_counts, *, trans_gmm_weight, permute_out_flag) -> (gmm_y, mm_y, permute_out)`` (all-to-all,
sort by local expert, grouped matmul); ``npu_gmm_alltoallv(gmm_x, gmm_weight, hcom, ep_world_size, send_counts,
recv_counts, *, trans_gmm_weight) -> (y, mm_y)`` (grouped matmul, unsort, all-to-all). Counts are per (rank,
local expert), rank-major, in the direction of that call. The MC2 ops have no autograd: the Functions below
pair them as the FSDPTurbo seed does (each one's backward is the other op, plus a K-grouped matmul for the
weights: ``kernels.npu_moe.weight_grad``).
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from kernels.npu_moe import weight_grad


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
        return grad_MD, _zero_empty(weight_grad(grad_RN, x_RD, counts_L), splits.counts_L), None, None


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
        return grad_RI, _zero_empty(weight_grad(grad_RD, h_RI, counts_L), splits.counts_L), None, None
