"""``toy``: a dispatcher added the way a new one is, in its two files at the paths they would have in the repository
(this module, parallelisms/dispatchers/toy.py, and conf/dispatcher/toy.yaml), so that tests/test_dispatcher_traits.py
can show the planner, the simulation's checks and parallelize handling it by what it declares, never by its name.

Fused's steps on the tokens in two halves, one after the other, with one count exchange for both: domino's
traffic without its overlap, so ``chunks = 2`` is what it really sends. Its layout limit stands in for a real
dispatcher's (mc2's).
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import all_to_all_single_autograd

from models.moe import ExpertWeights
from parallelisms.dispatchers import local_ops
from parallelisms.dispatchers.base import Dispatcher, register
from parallelisms.dispatchers.common import exchange_counts

MAX_EP = 2


@register("toy")
class ToyDispatcher(Dispatcher):
    chunks = 2

    @classmethod
    def check_layout(cls, ep: int, num_experts: int, top_k: int) -> None:
        if ep > MAX_EP:
            raise ValueError(f"dispatcher=toy takes parallel.ep_size <= {MAX_EP}, got ep={ep}; use dispatcher=fused")

    def dispatch(self, experts: ExpertWeights, x_ND: torch.Tensor, experts_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> torch.Tensor:
        N = x_ND.shape[0]
        halves = [(N + 1) // 2, N // 2]
        permuted = [local_ops.permute(x, e, self.num_experts) for x, e in zip(x_ND.split(halves),
                                                                              experts_NK.split(halves))]
        splits = exchange_counts(torch.stack([counts_E for _, counts_E, _ in permuted]), self.group, self.num_local)
        out = []
        for (x_MD, _, state), s, w_NK in zip(permuted, splits, weights_NK.split(halves)):
            x_RD = all_to_all_single_autograd(x_MD, s.recv, s.send, self.group)
            y_RD = local_ops.run_local_experts(experts, x_RD, s)
            out.append(local_ops.unpermute(all_to_all_single_autograd(y_RD, s.send, s.recv, self.group), w_NK, state))
        return torch.cat(out)
