"""What every EP dispatcher shares: the ep group's device, the count exchange (with the one host sync per layer),
the arrival -> local-expert order of received rows, and this rank's expert weights as local tensors.

Letters as in DEVELOPERS.md (G = E / P local experts, P ep ranks, Q the independently dispatched token chunks:
1, or 2 for domino).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from core.torch_compat import all_to_all_single
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
    recv_counts_PG: list[int]  # rows from each (source rank, local expert), flattened (as received)
    counts_G: list[int]  # rows per local expert, all sources
    recv_counts_dev_PG: torch.Tensor  # recv_counts_PG on the device, for index maths without a sync


def exchange_counts(send_counts_QE: torch.Tensor, group: dist.ProcessGroup, num_local: int) -> list[Splits]:
    """Tell every rank how many rows of each of Q chunks it will receive per local expert: one count
    all-to-all for all chunks, then the one host sync of the layer (all_to_all_single needs its split sizes as
    Python ints). It stalls the CPU until routing is known, which is why parallelize sets explicit FSDP
    prefetching instead of relying on the implicit one."""
    Q, E = send_counts_QE.shape
    P, G = E // num_local, num_local
    send_PQG = send_counts_QE.view(Q, P, G).transpose(0, 1).contiguous()  # rank p gets its G counts of each chunk
    recv_PQG = all_to_all_single(send_PQG.flatten(), None, None, group).view(P, Q, G)
    host = torch.cat([send_counts_QE.flatten(), recv_PQG.transpose(0, 1).flatten()]).tolist()
    splits = []
    for q in range(Q):
        send_E, recv_PG = host[q * E:(q + 1) * E], host[(Q + q) * E:(Q + q + 1) * E]
        splits.append(Splits(
            send=[sum(send_E[p * G:(p + 1) * G]) for p in range(P)],
            recv=[sum(recv_PG[p * G:(p + 1) * G]) for p in range(P)],
            send_counts_E=send_E, recv_counts_PG=recv_PG,
            counts_G=[sum(recv_PG[g::G]) for g in range(G)],
            recv_counts_dev_PG=recv_PQG[:, q],
        ))
    return splits


def expert_order(recv_counts_PG: torch.Tensor, num_rows: int) -> torch.Tensor:
    """by_expert_R: the arrival row (grouped by source rank, then local expert) of each row in local-expert
    order (stable, so sources stay in rank order within an expert)."""
    P, G = recv_counts_PG.shape
    local_expert_R = torch.repeat_interleave(torch.arange(G, device=recv_counts_PG.device).repeat(P),
                                             recv_counts_PG.flatten(), output_size=num_rows)
    return torch.argsort(local_expert_R, stable=True)


def local_weights(experts: ExpertWeights) -> ExpertWeights:
    """This rank's expert weights as local [G, ...] tensors. Under EP the weights are DTensors of global shape
    [E, ...] (Shard(0) on the ep mesh), so checkpoints and loaders see whole tensors; the grouped GEMM needs the
    local blocks, and the gradient flows from them back into the DTensors. The activation kernel is kept."""
    return experts._replace(**{name: w.to_local() for name, w in experts._asdict().items()
                               if isinstance(w, DTensor)})
