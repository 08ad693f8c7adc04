"""``mc2``: Ascend MC2, the all-to-all fused with the grouped matmul on either side of the experts
(``torch_npu.npu_alltoallv_gmm`` / ``npu_gmm_alltoallv``, Atlas A3 only), so the transfer of one expert's rows
overlaps another expert's matmul inside one op. NPU only: elsewhere the dispatcher refuses to be built, at
parallelize time.

Per layer: torch_npu permute; count exchange (the one host sync: MC2 takes its counts per (rank, local
expert) as Python ints); dispatch + gate/up matmul; SwiGLU; down matmul + combine; torch_npu unpermute with
the router weights. Outside MC2's documented limits (``Mc2Limits``) the ops fail deep inside with error 161002,
so each limit is checked first: the chip when the dispatcher is built, ep / experts / top-k at parallelize time
(``check_layout``), the bytes of each all-to-all at run time (``check_bytes``: they depend on the routing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.moe import ExpertWeights
from parallelisms.dispatchers import local_ops, npu
from parallelisms.dispatchers.base import Dispatcher, register
from parallelisms.dispatchers.common import Splits, exchange_counts

NEEDS_NPU = "dispatcher=mc2 needs an Ascend NPU with torch_npu (MC2 ops); use eager/fused/domino/dedup elsewhere"
FIX = "use dispatcher=fused"


@dataclass(frozen=True)
class Mc2Limits:
    """MC2's documented limits (torch_npu / op-plugin docs of npu_alltoallv_gmm and npu_gmm_alltoallv)."""

    ep_sizes: tuple[int, ...] = (8, 16, 32, 64)
    max_local_experts: int = 32
    max_experts: int = 256  # e * ep_world_size: the length of the count lists
    top_k: tuple[int, int] = (2, 8)
    bytes_per_all_to_all: tuple[int, int] = (2 * 2**20, 100 * 2**20)  # per rank, each direction
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)


LIMITS = Mc2Limits()


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"{message}; {FIX}")


def check_bytes(splits: Splits, row_bytes: int) -> None:
    """Each of MC2's all-to-alls sends this rank's routed rows and receives its experts' rows: both must lie in
    the documented range. The rows depend on the routing, so this runs per layer, on the host counts the count
    exchange already synced (no extra sync). Only the ranks outside the range raise; the others wait in the
    collective until the launcher ends the job."""
    low, high = LIMITS.bytes_per_all_to_all
    for what, rows in (("sends", sum(splits.send)), ("receives", sum(splits.recv))):
        size = rows * row_bytes
        if not low <= size <= high:
            raise RuntimeError(
                f"dispatcher=mc2: this rank {what} {rows} rows x {row_bytes} bytes = {size / 2**20:.1f} MiB in one "
                f"all-to-all, outside MC2's documented {low / 2**20:.0f}-{high / 2**20:.0f} MiB per rank; change "
                f"train.local_batch_size or data.seq_len to bring it inside, or {FIX}")


@register("mc2")
class Mc2Dispatcher(Dispatcher):
    uncounted_traffic = ("moves inside MC2's grouped matmuls, overlapping them, not in the exposed all-to-alls the "
                         "step time adds")
    # npu_alltoallv_gmm / npu_gmm_alltoallv talk to the peers themselves, not through the ep process group.
    unsimulated = "exchanges rows inside HCCL's fused grouped matmuls, which need real peers"

    def __init__(self, group: dist.ProcessGroup, num_experts: int, device_type: str | None = None) -> None:
        super().__init__(group, num_experts, device_type)
        if self.device_type != "npu":
            raise RuntimeError(NEEDS_NPU)
        npu.check_mc2_chip()
        self.hcom = npu.hccl_comm_name(group)

    @classmethod
    def check_layout(cls, ep: int, num_experts: int, top_k: int) -> None:
        limits = LIMITS
        sizes = "{" + ",".join(map(str, limits.ep_sizes)) + "}"
        _check(ep in limits.ep_sizes, f"dispatcher=mc2 needs parallel.ep_size in {sizes}, got ep={ep}")
        _check(num_experts // ep <= limits.max_local_experts,
               f"dispatcher=mc2 takes at most {limits.max_local_experts} experts per ep rank, got "
               f"model.arch.num_experts / parallel.ep_size = {num_experts} / {ep} = {num_experts // ep}")
        _check(num_experts <= limits.max_experts,
               f"dispatcher=mc2 takes at most {limits.max_experts} experts in all, "
               f"model.arch.num_experts={num_experts}")
        low, high = limits.top_k
        _check(low <= top_k <= high,
               f"dispatcher=mc2 takes top-k {low}..{high}, got model.arch.num_experts_per_tok={top_k}")

    def dispatch(self, experts: ExpertWeights, x_ND: torch.Tensor, experts_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> torch.Tensor:
        if x_ND.dtype not in LIMITS.dtypes:
            raise RuntimeError(f"dispatcher=mc2: MC2 ops take bf16/fp16 activations, got {x_ND.dtype}; "
                               f"train with train.mixed_precision=bf16 or {FIX}")
        x_MD, send_counts_E, state = local_ops.permute(x_ND, experts_NK, self.num_experts)
        (splits,) = exchange_counts(send_counts_E[None], self.group, self.num_local)
        check_bytes(splits, x_ND.shape[1] * x_ND.element_size())
        gate_up_R2I = npu.Mc2Dispatch.apply(x_MD, experts.gate_up_proj.to(x_MD.dtype), self.hcom, splits)
        h_RI = experts.act_fn(gate_up_R2I)  # the packed_swiglu kernel slot: torch_npu's npu_swiglu on NPU
        y_MD = npu.Mc2Combine.apply(h_RI, experts.down_proj.to(h_RI.dtype), self.hcom, splits)
        return local_ops.unpermute(y_MD, weights_NK, state)
