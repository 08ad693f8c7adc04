"""``mc2``: Ascend MC2, the all-to-all fused with the grouped matmul on either side of the experts
(``torch_npu.npu_alltoallv_gmm`` / ``npu_gmm_alltoallv``, Atlas A3), so the transfer of one expert's rows
overlaps another expert's matmul inside one op. NPU only: elsewhere the dispatcher refuses to be built, at
parallelize time.

Per layer: torch_npu permute; count exchange (the one host sync: MC2 takes its counts per (rank, local
expert) as Python ints); dispatch + gate/up matmul; SwiGLU; down matmul + combine; torch_npu unpermute with
the router weights. MC2 takes bf16/fp16 only. Documented limits (CANN 8.x): ep in {8, 16, 32, 64}, at most 32
local experts and 256 in all, top-k 2..8, 2-100 MB of traffic per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.moe import ExpertWeights
from parallelisms.dispatchers import local_ops, npu
from parallelisms.dispatchers.base import Dispatcher, register
from parallelisms.dispatchers.common import exchange_counts

MC2_DTYPES = (torch.bfloat16, torch.float16)
NEEDS_NPU = "dispatcher=mc2 needs an Ascend NPU with torch_npu (MC2 ops); use eager/fused/domino/dedup elsewhere"


@register("mc2")
class Mc2Dispatcher(Dispatcher):
    def __init__(self, group: dist.ProcessGroup, num_experts: int, device_type: str | None = None) -> None:
        super().__init__(group, num_experts, device_type)
        if self.device_type != "npu" or not npu.has_mc2():
            raise RuntimeError(NEEDS_NPU)
        self.hcom = npu.hccl_comm_name(group)

    def dispatch(self, experts: ExpertWeights, x_ND: torch.Tensor, experts_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> torch.Tensor:
        if x_ND.dtype not in MC2_DTYPES:
            raise RuntimeError(f"dispatcher=mc2: MC2 ops take bf16/fp16 activations, got {x_ND.dtype}; "
                               "train with train.mixed_precision=bf16 or use dispatcher=fused")
        x_MD, send_counts_E, state = local_ops.permute(x_ND, experts_NK, self.num_experts)
        (splits,) = exchange_counts(send_counts_E[None], self.group, self.num_local)
        gate_up_R2I = npu.Mc2Dispatch.apply(x_MD, experts.gate_up_proj.to(x_MD.dtype), self.hcom, splits)
        h_RI = experts.act_fn(gate_up_R2I)  # the packed_swiglu kernel slot: torch_npu's npu_swiglu on NPU
        y_MD = npu.Mc2Combine.apply(h_RI, experts.down_proj.to(h_RI.dtype), self.hcom, splits)
        return local_ops.unpermute(y_MD, weights_NK, state)
