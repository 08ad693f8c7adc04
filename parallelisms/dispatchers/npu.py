"""The MC2 collectives of the ``mc2`` dispatcher (the all-to-all fused with the grouped matmul): a dispatcher,
not a kernel, so they live here; the NPU kernels (token permute / unpermute, grouped matmul) are in
``kernels/moe/npu.py``, chosen by the kernel registry.

Signatures (torch_npu / op-plugin docs): ``npu_alltoallv_gmm(gmm_x, gmm_weight, hcom, ep_world_size,
send_counts, recv_counts, *, trans_gmm_weight, permute_out_flag) -> (gmm_y, mm_y, permute_out)`` (all-to-all,
sort by local expert, grouped matmul); ``npu_gmm_alltoallv(gmm_x, gmm_weight, hcom, ep_world_size, send_counts,
recv_counts, *, trans_gmm_weight) -> (y, mm_y)`` (grouped matmul, unsort, all-to-all). Counts are per (rank,
local expert), rank-major, in the direction of that call. The MC2 ops have no autograd: the Functions below
pair them as the FSDPTurbo seed does (each one's backward is the other op, plus a matmul grouped along its
contraction dim for the weights: ``kernels.moe.npu.weight_grad``). Letters as in DEVELOPERS.md.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from core.torch_compat import backend_of
from kernels.moe.npu import weight_grad


def torch_npu():
    return importlib.import_module("torch_npu")


A3_PREFIX = "Ascend910_93"  # torch_npu.npu.get_device_name() on Atlas A3 (Ascend910_9391, _9392, ...)


def check_mc2_chip() -> None:
    """MC2 runs on Atlas A3 only; the ops exist in torch_npu on every chip, so their presence proves nothing."""
    try:
        module = torch_npu()
    except ImportError as error:
        raise RuntimeError("dispatcher=mc2 needs torch_npu: pip install '.[npu]' (README: Ascend NPUs)") from error
    if not (hasattr(module, "npu_alltoallv_gmm") and hasattr(module, "npu_gmm_alltoallv")):
        raise RuntimeError(f"dispatcher=mc2 needs torch_npu's MC2 ops (npu_alltoallv_gmm, npu_gmm_alltoallv), which "
                           f"torch_npu {getattr(module, '__version__', '?')} lacks: pip install '.[npu]'")
    name = module.npu.get_device_name()
    if not name.startswith(A3_PREFIX):
        raise RuntimeError(f"dispatcher=mc2 runs on Atlas A3 ({A3_PREFIX}xx) only, this NPU is {name}; "
                           "use dispatcher=fused")


def hccl_comm_name(group: dist.ProcessGroup) -> str:
    """The HCCL communicator name the MC2 ops address the ep group by."""
    rank = dist.get_global_rank(group, dist.get_rank(group))
    return backend_of(group, torch.device("npu")).get_hccl_comm_name(rank)


def _zero_empty(grad_w: torch.Tensor, counts_G: list[int]) -> torch.Tensor:
    # MC2 cannot fall back per rank (it is a collective), so an expert without rows keeps MC2 and gets an
    # explicit zero gradient instead of whatever a contraction-grouped matmul leaves for an empty group.
    empty = [g for g, c in enumerate(counts_G) if c == 0]
    if empty:
        grad_w[empty] = 0
    return grad_w


class Mc2Dispatch(torch.autograd.Function):
    """x_MD (global-expert order) -> all-to-all -> local-expert order -> @ w_G2ID^T: [R, 2I]."""

    @staticmethod
    def forward(ctx, x_MD, w_G2ID, hcom, splits) -> torch.Tensor:
        ep = len(splits.send)
        y_R2I, _, x_RD = torch_npu().npu_alltoallv_gmm(x_MD, w_G2ID, hcom, ep, splits.send_counts_E,
                                                       splits.recv_counts_PG, trans_gmm_weight=True,
                                                       permute_out_flag=True)
        ctx.save_for_backward(w_G2ID, x_RD)
        ctx.meta = hcom, splits
        return y_R2I

    @staticmethod
    def backward(ctx, grad_R2I):
        w_G2ID, x_RD = ctx.saved_tensors
        hcom, splits = ctx.meta
        grad_R2I = grad_R2I.contiguous()
        counts_G = splits.recv_counts_dev_PG.sum(0)
        grad_MD, _ = torch_npu().npu_gmm_alltoallv(grad_R2I, w_G2ID, hcom, len(splits.send),
                                                   splits.recv_counts_PG, splits.send_counts_E)
        return grad_MD, _zero_empty(weight_grad(grad_R2I, x_RD, counts_G), splits.counts_G), None, None


class Mc2Combine(torch.autograd.Function):
    """h_RI (local-expert order) @ w_GDI^T -> arrival order -> all-to-all back: [M, D] in global-expert order."""

    @staticmethod
    def forward(ctx, h_RI, w_GDI, hcom, splits) -> torch.Tensor:
        y_MD, _ = torch_npu().npu_gmm_alltoallv(h_RI, w_GDI, hcom, len(splits.send), splits.recv_counts_PG,
                                                splits.send_counts_E, trans_gmm_weight=True)
        ctx.save_for_backward(h_RI, w_GDI)
        ctx.meta = hcom, splits
        return y_MD

    @staticmethod
    def backward(ctx, grad_MD):
        h_RI, w_GDI = ctx.saved_tensors
        hcom, splits = ctx.meta
        grad_RI, _, grad_RD = torch_npu().npu_alltoallv_gmm(grad_MD.contiguous(), w_GDI, hcom, len(splits.send),
                                                            splits.send_counts_E, splits.recv_counts_PG,
                                                            permute_out_flag=True)
        counts_G = splits.recv_counts_dev_PG.sum(0)
        return grad_RI, _zero_empty(weight_grad(grad_RD, h_RI, counts_G), splits.counts_G), None, None
