"""The reference EP dispatcher: plain torch ops and autograd-aware all-to-alls.

Per MoE layer, on every rank of the ep group (letters: N tokens, K top-k, M = N*K routed rows,
R rows received, L local experts = E / ep, P ep ranks):
1. sort the routed rows by global expert id, which groups them by destination rank, then local expert;
2. exchange the per-expert counts (all-to-all) so every rank knows its receive splits;
3. all-to-all the rows; sort what arrived (grouped by source rank) by local expert;
4. grouped GEMM over the local experts (``GroupedExperts.compute``);
5. the reverse: unsort, all-to-all back, weight by the router scores and sum over k.
Empty experts and ranks that send or receive nothing are ordinary zero-size splits.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.tensor import DTensor

from models.moe import GroupedExperts, combine, sort_by_expert


class EagerDispatcher:
    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_experts = num_experts  # global; the rank with ep index p holds experts [p*L, (p+1)*L)
        self.num_local = num_experts // self.ep

    def __call__(self, experts: GroupedExperts, x_ND: torch.Tensor, experts_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> torch.Tensor:
        P, L = self.ep, self.num_local
        order_M, send_counts_E = sort_by_expert(experts_NK, self.num_experts)
        token_M = order_M // experts_NK.shape[1]

        recv_counts_PL = all_to_all_single(send_counts_E, None, None, self.group).view(P, L)
        # The one host sync: all_to_all needs its split sizes as Python ints. It stalls the CPU until routing
        # is known, which is why parallelize sets explicit FSDP prefetching instead of relying on the implicit one.
        splits = torch.cat([send_counts_E.view(P, L).sum(1), recv_counts_PL.sum(1)]).tolist()
        send_splits, recv_splits = splits[:P], splits[P:]

        x_RD = all_to_all_single_autograd(x_ND[token_M], recv_splits, send_splits, self.group)
        local_expert_R = torch.repeat_interleave(torch.arange(L, device=x_ND.device).repeat(P),
                                                 recv_counts_PL.flatten(), output_size=sum(recv_splits))
        by_expert_R = torch.argsort(local_expert_R, stable=True)
        y_RD = _local_compute(experts, x_RD[by_expert_R], recv_counts_PL.sum(0))
        y_RD = torch.empty_like(y_RD).index_copy(0, by_expert_R, y_RD)  # back to arrival order

        y_MD = all_to_all_single_autograd(y_RD, send_splits, recv_splits, self.group)
        return combine(y_MD, weights_NK.flatten()[order_M], token_M, x_ND.shape[0])


def _local_compute(experts: GroupedExperts, x_RD: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
    """``GroupedExperts.compute`` on this rank's experts. Under EP the expert weights are DTensors of global
    shape [E, ...] (Shard(0) on the ep mesh), so checkpoints and loaders see whole tensors; the grouped GEMM
    needs the local [L, ...] blocks, and the gradient flows from them back into the DTensors.
    TODO: a ``compute`` taking the weights as arguments would remove this stand-in for ``self``."""
    local = SimpleNamespace(**{name: p.to_local() if isinstance(p, DTensor) else p
                               for name, p in experts.named_parameters(recurse=False)})
    return GroupedExperts.compute(local, x_RD, counts_L)
