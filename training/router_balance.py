"""Aux-loss-free load balancing (DeepSeek-V3): after each optimizer step every router's per-expert bias moves
toward equal expert loads (``models.moe.TopKRouter.update_expert_bias``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.moe import TopKRouter


def update_expert_biases(routers: list[TopKRouter], counts_LE: torch.Tensor, rate: float,
                         group: dist.ProcessGroup | None) -> None:
    """Move each router's bias by the global batch's loads: ``counts_LE`` [MoE layers, E] holds this rank's routed
    slots per expert, summed here over the data-parallel group (an all-reduce, no host sync), so every rank of
    every layout applies the same update to the same biases."""
    counts_LE = counts_LE.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts_LE, group=group)
    for router, counts_E in zip(routers, counts_LE, strict=True):
        router.update_expert_bias(counts_E, rate)
