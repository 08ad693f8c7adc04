"""The local halves of a dispatch: permute the routed rows into expert order, run this rank's experts on what
arrived, unpermute with the router weights. ``fused``, ``domino`` and ``mc2`` share them; ``dedup`` uses
``compute``, ``capacity`` ``run_in_arrival_order``.

Only kernel calls, none chosen here: ``kernels.moe.permute.moe_token_permute`` / ``moe_token_unpermute`` (the gathers
of ``kernels.moe.permute``, or torch_npu's fused permute / unpermute on NPU) and ``models.moe.compute_experts``
(``kernels.moe.grouped_mm``: torch._grouped_mm on CUDA, which handles experts without rows exactly; torch_npu's grouped
matmul on NPU, which falls back to the per-expert loop for an expert without rows, as the seeds do). The kernel
registry chooses them from ``kernel_config`` and logs the choice at start-up.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.moe.permute import (RoutedRows, inverse_permutation, moe_token_permute, moe_token_unpermute,
                             permute_rows)
from models.moe import ExpertWeights, compute_experts, expert_counts
from parallelisms.dispatchers.common import Splits, expert_order


def permute(x_ND: torch.Tensor, experts_NK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """-> (x_MD in global-expert order, rows per global expert [E], state for ``unpermute``)."""
    x_MD, state = moe_token_permute(x_ND, experts_NK)
    return x_MD, expert_counts(experts_NK, num_experts), state


def unpermute(y_MD: torch.Tensor, weights_NK: torch.Tensor, state: Any) -> torch.Tensor:
    return moe_token_unpermute(y_MD, weights_NK, state)


def compute(local: ExpertWeights, x_RD: torch.Tensor, splits: Splits) -> torch.Tensor:
    """Rows sorted by local expert -> expert outputs, same order (the host counts: a kernel that needs them there
    takes no sync)."""
    return compute_experts(local, x_RD, splits.recv_counts_dev_PG.sum(0), splits.counts_G)


def run_local_experts(local: ExpertWeights, x_RD: torch.Tensor, splits: Splits) -> torch.Tensor:
    """Rows as they arrived (by source rank, then local expert) -> expert outputs in the same order."""
    return run_in_arrival_order(local, x_RD, splits.recv_counts_dev_PG, splits.recv_counts_dev_PG.sum(0),
                                splits.counts_G)


def run_in_arrival_order(local: ExpertWeights, x_RD: torch.Tensor, arrival_counts_PG: torch.Tensor,
                         counts_G: torch.Tensor, counts_host: list[int] | None = None) -> torch.Tensor:
    """``run_local_experts`` from device counts: ``arrival_counts_PG`` the rows of each (source rank, key) block
    as they arrived, keys 0..G-1 the local experts (``capacity`` adds a last column, its padding, sorted after
    them), regrouped stably by key into the groups of ``counts_G`` (rows per local expert, all sources; sum R)."""
    by_expert_R = expert_order(arrival_counts_PG, x_RD.shape[0])
    arrival_R = inverse_permutation(by_expert_R)
    y_RD = compute_experts(local, RoutedRows(x_RD, by_expert_R, arrival_R), counts_G, counts_host)
    return permute_rows(y_RD, arrival_R, by_expert_R)
