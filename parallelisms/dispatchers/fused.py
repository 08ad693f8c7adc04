"""``fused``: eager's all-to-alls around fused local ops (``local_ops``).

Per layer: permute the routed rows into expert order (one gather), exchange counts (the one host sync),
all-to-all, sort the arrivals by local expert (one gather), grouped GEMM over the local experts, unsort,
all-to-all back, unpermute with the router weights applied in the same ``bmm`` that sums over k. The dispatch in
e4m3 under ``dispatcher.fp8_dispatch`` (``fp8``). Every map is
a gather whose backward is a gather by the inverse map (``kernels.moe.permute``): none of eager's sort-based
``index_put_(accumulate=True)`` backwards, zero-filled buffers or atomic adds, and no weighted [M, D] product
kept for backward. On NPU the same steps run torch_npu's fused permute / unpermute / grouped matmul.
"""

from __future__ import annotations

import torch

from core.torch_compat import all_to_all_single_autograd
from models.moe import ExpertWeights
from parallelisms.dispatchers import local_ops
from parallelisms.dispatchers.base import Dispatcher, register
from parallelisms.dispatchers.common import exchange_counts
from parallelisms.dispatchers.config import DispatcherConfig
from parallelisms.dispatchers.fp8 import fp8_all_to_all, fp8_configured


@register("fused")
class FusedDispatcher(Dispatcher):
    config_keys = ("fp8_dispatch",)
    fp8 = False  # dispatcher.fp8_dispatch (configure)

    def configure(self, cfg: DispatcherConfig) -> None:
        self.fp8 = fp8_configured(cfg, self.device_type)

    def dispatch(self, experts: ExpertWeights, x_ND: torch.Tensor, experts_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> torch.Tensor:
        x_MD, send_counts_E, state = local_ops.permute(x_ND, experts_NK, self.num_experts)
        (splits,) = exchange_counts(send_counts_E[None], self.group, self.num_local)
        x_RD = (fp8_all_to_all if self.fp8 else all_to_all_single_autograd)(x_MD, splits.recv, splits.send,
                                                                            self.group)
        y_RD = local_ops.run_local_experts(experts, x_RD, splits)
        y_MD = all_to_all_single_autograd(y_RD, splits.send, splits.recv, self.group)
        return local_ops.unpermute(y_MD, weights_NK, state)
