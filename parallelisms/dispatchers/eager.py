"""The reference EP dispatcher: plain torch ops and autograd-aware all-to-alls.

Per MoE layer, on every rank of the ep group (letters as in DEVELOPERS.md):
1. sort the routed rows by global expert id, which groups them by destination rank, then local expert;
2. exchange the per-expert counts (all-to-all) so every rank knows its receive splits;
3. all-to-all the rows; sort what arrived (grouped by source rank) by local expert;
4. grouped GEMM over the local experts (``models.moe.compute_experts``);
5. the reverse: unsort, all-to-all back, weight by the router scores and sum over k.
Empty experts and ranks that send or receive nothing are ordinary zero-size splits.
"""

from __future__ import annotations

import torch

from core.torch_compat import all_to_all_single_autograd
from models.moe import ExpertWeights, combine, compute_experts, sort_by_expert
from parallelisms.dispatchers.base import Dispatcher, register
from parallelisms.dispatchers.common import exchange_counts, expert_order


@register("eager")
class EagerDispatcher(Dispatcher):
    extra_saved_rows = 1  # x_RD in arrival order, besides the expert-order copy the grouped GEMM reads

    def dispatch(self, experts: ExpertWeights, x_ND: torch.Tensor, experts_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> torch.Tensor:
        order_M, send_counts_E = sort_by_expert(experts_NK, self.num_experts)
        token_M = order_M // experts_NK.shape[1]
        (splits,) = exchange_counts(send_counts_E[None], self.group, self.num_local)

        x_RD = all_to_all_single_autograd(x_ND[token_M], splits.recv, splits.send, self.group)
        by_expert_R = expert_order(splits.recv_counts_dev_PG, x_RD.shape[0])
        y_RD = compute_experts(experts, x_RD[by_expert_R], splits.recv_counts_dev_PG.sum(0))
        y_RD = torch.empty_like(y_RD).index_copy(0, by_expert_R, y_RD)  # back to arrival order

        y_MD = all_to_all_single_autograd(y_RD, splits.send, splits.recv, self.group)
        return combine(y_MD, weights_NK.flatten()[order_M], token_M, x_ND.shape[0])
