"""Loss terms, normalised so that every parallel layout optimises the same global objective.

Each rank returns its *share* of the global loss: summing the shares over the data-parallel ranks gives
``mean token cross-entropy of the global batch + coef x Switch aux loss of the global batch``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from core.constants import IGNORE_INDEX
from models.moe import RouterStats

__all__ = ["IGNORE_INDEX", "aux_loss_share"]  # the cross-entropy is the LM head's (models.causal_lm.LMHead)


def aux_loss_share(stats: list[RouterStats], num_experts: int, group: dist.ProcessGroup | None = None
                   ) -> torch.Tensor:
    """This rank's share of the Switch aux loss ``E * sum_e f_e * P_e`` of the global batch.

    f_e (fraction of routed slots) and the row count are global (all-reduced, no gradient); P_e is
    linear in the router probabilities, so the share ``E * sum_e f_e * prob_sum_local_e / rows`` sums
    over ranks to the global loss and gives each rank exactly its tokens' gradient. With one rank this
    is transformers' ``load_balancing_loss_func`` over all layers.
    """
    counts_E = torch.stack([s.counts_E for s in stats]).sum(0)
    prob_sum_E = torch.stack([s.prob_sum_E for s in stats]).sum(0)
    rows = torch.tensor([float(sum(s.num_tokens for s in stats))], device=counts_E.device)
    counts_rows = torch.cat([counts_E, rows])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts_rows, group=group)
    counts_E, rows = counts_rows[:-1], counts_rows[-1]
    return num_experts * torch.sum(counts_E / rows * prob_sum_E / rows)
