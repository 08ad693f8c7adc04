"""Loss terms, normalised so that every parallel layout optimises the same global objective.

Each rank returns its *share* of the global loss: summing the shares over the data-parallel ranks gives
``mean token cross-entropy of the global batch + coef x Switch aux loss + z coef x router z-loss`` of the global
batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from core.constants import IGNORE_INDEX
from models.moe import RouterStats

__all__ = ["IGNORE_INDEX", "router_loss_shares"]  # the cross-entropy is the LM head's (models.causal_lm.LMHead)


def router_loss_shares(stats: list[RouterStats], num_experts: int, group: dist.ProcessGroup | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shares of the Switch aux loss ``E * sum_e f_e * P_e`` and of the router z-loss
    ``mean(logsumexp(router logits)^2)`` of the global batch, both over all layers' rows together.

    f_e (fraction of routed slots) and the row count are global (all-reduced, no gradient); P_e and the z sum
    are sums over this rank's rows, so the shares ``E * sum_e f_e * prob_sum_local_e / rows`` and
    ``z_sum_local / rows`` sum over ranks to the global losses and give each rank exactly its tokens' gradient.
    With one rank the aux loss is transformers' ``load_balancing_loss_func`` over all layers, and the z-loss
    ST-MoE's averaged over the layers.
    """
    counts_E = torch.stack([s.counts_E for s in stats]).sum(0)
    prob_sum_E = torch.stack([s.prob_sum_E for s in stats]).sum(0)
    # new_full, not torch.tensor([...], device=...): a fill kernel, where a tensor from host data is a blocking
    # host-to-device copy (a sync on CUDA)
    rows = counts_E.new_full((1,), float(sum(s.num_tokens for s in stats)))
    counts_rows = torch.cat([counts_E, rows])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts_rows, group=group)
    counts_E, rows = counts_rows[:-1], counts_rows[-1]
    z_sum = torch.stack([s.z_sum for s in stats]).sum()
    return num_experts * torch.sum(counts_E / rows * prob_sum_E / rows), z_sum / rows
