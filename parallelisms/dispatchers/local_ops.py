"""The local halves of a dispatch, per device: permute the routed rows into expert order, run this rank's
experts on what arrived, unpermute with the router weights. ``fused`` and ``domino`` share them; ``dedup`` uses
``TorchOps.compute``.

``TorchOps`` (CPU, CUDA): the gathers of ``kernels.permute`` and ``GroupedExperts.compute`` (torch._grouped_mm,
which handles experts without rows exactly, so no fallback is needed). ``NpuOps``: torch_npu's fused
permute/unpermute and grouped matmul; an expert without rows falls back to the torch compute, as the seeds do.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from kernels.permute import inverse_permutation, permute_rows, permute_tokens, unpermute
from models.moe import GroupedExperts, expert_counts
from parallelisms.dispatchers.common import EPDispatcher, Splits, expert_order, group_device_type


class TorchOps:
    name = "torch"

    def permute(self, x_ND: torch.Tensor, experts_NK: torch.Tensor,
                num_experts: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """-> (x_MD in global-expert order, rows per global expert [E], state for ``unpermute``)."""
        order_M = torch.argsort(experts_NK.flatten(), stable=True)
        inv_M = inverse_permutation(order_M)
        x_MD = permute_tokens(x_ND, order_M // experts_NK.shape[1], inv_M)
        return x_MD, expert_counts(experts_NK, num_experts), (order_M, inv_M)

    def unpermute(self, y_MD: torch.Tensor, weights_NK: torch.Tensor, state: Any) -> torch.Tensor:
        return unpermute(y_MD, weights_NK, *state)

    def compute(self, local: SimpleNamespace, x_RD: torch.Tensor, splits: Splits) -> torch.Tensor:
        """Rows sorted by local expert -> expert outputs, same order."""
        return GroupedExperts.compute(local, x_RD, splits.recv_counts_dev_PL.sum(0))


class NpuOps(TorchOps):
    name = "torch_npu"

    def __init__(self) -> None:
        from parallelisms.dispatchers import npu

        self.npu = npu
        self.torch_npu = npu.torch_npu()

    def permute(self, x_ND, experts_NK, num_experts):
        # Same row order as sort_by_expert (a stable sort by expert id); row_map inverts it.
        x_MD, row_map_M = self.torch_npu.npu_moe_token_permute(x_ND, experts_NK.to(torch.int32))
        return x_MD, expert_counts(experts_NK, num_experts), row_map_M

    def unpermute(self, y_MD, weights_NK, state):
        return self.torch_npu.npu_moe_token_unpermute(y_MD.to(weights_NK.dtype), state, probs=weights_NK)

    def compute(self, local, x_RD, splits):
        if min(splits.counts_L, default=0) == 0:  # host counts: no sync to decide
            return super().compute(local, x_RD, splits)
        counts_L = splits.recv_counts_dev_PL.sum(0)
        gate_up_R2I = self.npu.grouped_matmul(x_RD, local.gate_up_proj.transpose(1, 2), counts_L)
        return self.npu.grouped_matmul(self.torch_npu.npu_swiglu(gate_up_R2I, dim=-1),
                                       local.down_proj.transpose(1, 2), counts_L)


def local_ops(device_type: str) -> TorchOps:
    """The local ops for a device type; NPU needs torch_npu, and saying so beats a silent slow path."""
    if device_type != "npu":
        return TorchOps()
    try:
        return NpuOps()
    except ImportError as error:
        raise RuntimeError("the EP dispatcher runs on an NPU but torch_npu is not installed "
                           "(pip install '.[npu]')") from error


class LocalOpsDispatcher(EPDispatcher):
    """An EP dispatcher whose local permute / expert ops are chosen for the group's device (fused, domino)."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int, device_type: str | None = None) -> None:
        super().__init__(group, num_experts)
        self.ops = local_ops(device_type or group_device_type(group))


def run_local_experts(ops: TorchOps, local: SimpleNamespace, x_RD: torch.Tensor, splits: Splits) -> torch.Tensor:
    """Rows as they arrived (by source rank, then local expert) -> expert outputs in the same order."""
    by_expert_R = expert_order(splits.recv_counts_dev_PL, x_RD.shape[0])
    arrival_R = inverse_permutation(by_expert_R)
    y_RD = ops.compute(local, permute_rows(x_RD, by_expert_R, arrival_R), splits)
    return permute_rows(y_RD, arrival_R, by_expert_R)
