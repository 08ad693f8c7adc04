"""What every EP dispatcher shares: the ep group's device, the count exchange (with the one host sync per layer),
the arrival -> local-expert order of received rows, and this rank's expert weights as local tensors.

Letters: N tokens, K top-k, M = N*K routed rows, R rows received, E experts, L = E / P local experts,
P ep ranks, H independently dispatched token chunks (1, or 2 for domino).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single
from torch.distributed.tensor import DTensor

from models.moe import ExpertWeights


def group_device_type(group: dist.ProcessGroup) -> str:
    """The accelerator a process group's collectives run on: cuda (nccl), npu (hccl) or cpu (gloo)."""
    backend = str(dist.get_backend(group))
    return "cuda" if "nccl" in backend else "npu" if "hccl" in backend else "cpu"


@dataclass
class Splits:
    """One chunk's all-to-all layout. Host lists come from the layer's one device-to-host copy."""

    send: list[int]  # rows to each ep rank [P]
    recv: list[int]  # rows from each ep rank [P]
    send_counts_E: list[int]  # rows to each global expert (rank-major, as sent)
    recv_counts_PL: list[int]  # rows from each (source rank, local expert), flattened (as received)
    counts_L: list[int]  # rows per local expert, all sources
    recv_counts_dev_PL: torch.Tensor  # recv_counts_PL on the device, for index maths without a sync


def exchange_counts(send_counts_HE: torch.Tensor, group: dist.ProcessGroup, num_local: int) -> list[Splits]:
    """Tell every rank how many rows of each of H chunks it will receive per local expert: one count
    all-to-all for all chunks, then the one host sync of the layer (all_to_all_single needs its split sizes as
    Python ints). It stalls the CPU until routing is known, which is why parallelize sets explicit FSDP
    prefetching instead of relying on the implicit one."""
    H, E = send_counts_HE.shape
    P, L = E // num_local, num_local
    send_PHL = send_counts_HE.view(H, P, L).transpose(0, 1).contiguous()  # rank p gets its L counts of each chunk
    recv_PHL = all_to_all_single(send_PHL.flatten(), None, None, group).view(P, H, L)
    host = torch.cat([send_counts_HE.flatten(), recv_PHL.transpose(0, 1).flatten()]).tolist()
    splits = []
    for h in range(H):
        send_E, recv_PL = host[h * E:(h + 1) * E], host[(H + h) * E:(H + h + 1) * E]
        splits.append(Splits(
            send=[sum(send_E[p * L:(p + 1) * L]) for p in range(P)],
            recv=[sum(recv_PL[p * L:(p + 1) * L]) for p in range(P)],
            send_counts_E=send_E, recv_counts_PL=recv_PL,
            counts_L=[sum(recv_PL[l::L]) for l in range(L)],
            recv_counts_dev_PL=recv_PHL[:, h],
        ))
    return splits


def expert_order(recv_counts_PL: torch.Tensor, num_rows: int) -> torch.Tensor:
    """by_expert_R: the arrival row (grouped by source rank, then local expert) of each row in local-expert
    order (stable, so sources stay in rank order within an expert)."""
    P, L = recv_counts_PL.shape
    local_expert_R = torch.repeat_interleave(torch.arange(L, device=recv_counts_PL.device).repeat(P),
                                             recv_counts_PL.flatten(), output_size=num_rows)
    return torch.argsort(local_expert_R, stable=True)


def local_weights(experts: ExpertWeights) -> ExpertWeights:
    """This rank's expert weights as local [L, ...] tensors. Under EP the weights are DTensors of global shape
    [E, ...] (Shard(0) on the ep mesh), so checkpoints and loaders see whole tensors; the grouped GEMM needs the
    local blocks, and the gradient flows from them back into the DTensors. The activation kernel is kept."""
    return experts._replace(**{name: w.to_local() for name, w in experts._asdict().items()
                               if isinstance(w, DTensor)})
