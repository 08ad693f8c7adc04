"""The eager EP dispatcher against the single-rank LocalDispatcher: outputs and every gradient, on 4 gloo
ranks with ep 4 and ep 2, including experts that get no token and ranks that send or receive nothing.

Reference: each rank runs its own tokens through all experts locally. The EP run must give the same
outputs and input gradients; its expert gradients (local experts only) must equal the reference gradients
summed over the ep group, since the all-to-all backward brings every peer's contribution home.
fp32; tolerances cover the different summation order only (``ATOL``, ``RTOL``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from models.moe import GroupedExperts
from parallelisms.dispatchers import DispatcherConfig, dispatcher_class
from parallelisms.dispatchers.eager import EagerDispatcher
from parallelisms.expert_parallel import apply_expert_parallel
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.torch_apis  # EP all-to-alls and grouped_mm on gloo ranks

E, D, I, K, WORLD = 8, 8, 4, 2, 4
# fp32 round-off of two summation orders, which grows with the values (up to ~40 here, where an ulp is 3.8e-6):
# expert gradients sum every rank's rows (the EP run in one grouped GEMM per received block, domino in one per
# half added up by autograd; the reference per rank, then all-reduced), router-weight gradients are dot products
# over D taken in another order. An absolute 1e-5 alone is 2-3 ulps of the largest values: an H200 host's CPU
# gave 1.14e-5 (domino, an expert gradient of 32-64) and 7.6e-6 (a router-weight gradient). So each element may
# differ by ATOL + RTOL x |reference| (torch.testing's fp32 defaults); the worst seen there is 0.21 of that.
ATOL, RTOL = 1e-5, 1.3e-6


def _routing(case: str, ep_rank: int, ep: int, seed: int) -> torch.Tensor:
    """experts_NK of one rank for a routing case (distinct experts per token, as top-k gives)."""
    g = torch.Generator().manual_seed(seed)
    local = E // ep
    if case == "empty_rank" and ep_rank == 0:
        return torch.empty(0, K, dtype=torch.long)
    pool = {
        "random": torch.arange(E),
        "empty_rank": torch.arange(E),
        "zero_token_experts": torch.tensor([0, 3, 6]),  # the other experts get nothing, on every rank
        "local_only": torch.arange(ep_rank * local, (ep_rank + 1) * local),  # nothing crosses ranks
        "all_to_rank_0": torch.arange(local),  # every rank sends everything to ep rank 0, the others idle
        "next_rank": torch.arange((ep_rank + 1) % ep * local, ((ep_rank + 1) % ep + 1) * local),  # all K remote
    }[case]
    n = 7 + ep_rank
    return torch.stack([pool[torch.randperm(len(pool), generator=g)[:K]] for _ in range(n)])


CASES = ["random", "empty_rank", "zero_token_experts", "local_only", "all_to_rank_0", "next_rank"]


def _experts_NK(case: str, ep_rank: int, ep: int, seed: int) -> torch.Tensor:
    """A routing case, or one of the variants: a single token, top-1, top-4 (several experts per rank)."""
    if case == "one_token":
        return _routing("random", ep_rank, ep, seed)[:1]
    if case == "top1":
        return _routing("random", ep_rank, ep, seed)[:, :1]
    if case == "top4":
        g = torch.Generator().manual_seed(seed)
        return torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(7 + ep_rank)])
    return _routing(case, ep_rank, ep, seed)


def _errors(reference: GroupedExperts, sharded: GroupedExperts, ep_mesh, rank: int, case: str) -> dict:
    """{what: (same shape, max |EP - local|, the worst element's |EP - local| / its tolerance)} for the output and
    every gradient (expert gradients summed over the ep group); the run matches where every ratio is < 1."""
    ep, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    experts_NK = _experts_NK(case, ep_rank, ep, seed=rank)
    g = torch.Generator().manual_seed(100 + rank)
    x_ND, weights_NK = torch.randn(len(experts_NK), D, generator=g), torch.rand(*experts_NK.shape, generator=g)
    probe_ND = torch.randn(len(experts_NK), D, generator=g)
    runs = []
    for module in (reference, sharded):
        module.zero_grad()
        x, w = x_ND.clone().requires_grad_(), weights_NK.clone().requires_grad_()
        y = module(x, experts_NK, w)
        (y * probe_ND).sum().backward()
        runs.append((y.detach(), x.grad, w.grad, [torch.zeros_like(p) if p.grad is None else p.grad
                                                  for p in module.parameters()]))
    (y_ref, gx_ref, gw_ref, gp_ref), (y, gx, gw, gp) = runs
    for grad in gp_ref:
        dist.all_reduce(grad, group=ep_mesh.get_group())
    local = slice(ep_rank * (E // ep), (ep_rank + 1) * (E // ep))
    pairs = {"y": (y, y_ref), "x.grad": (gx, gx_ref), "weights.grad": (gw, gw_ref),
             **{f"param{i}.grad": (a.to_local(), b[local]) for i, (a, b) in enumerate(zip(gp, gp_ref))}}
    result = {}
    for what, (a, b) in pairs.items():
        if a.shape != b.shape or not a.numel():
            result[what] = (a.shape == b.shape, 0.0, 0.0)
            continue
        tolerance = ATOL + RTOL * b.abs()
        result[what] = (True, float((a - b).abs().max()), float(((a - b).abs() / tolerance).max()))
    return result


def check_errors(errors: dict, label: str) -> None:
    """Fail naming the first mismatch of an ``_errors`` result."""
    for what, (same_shape, max_err, ratio) in errors.items():
        assert same_shape, f"{label}: {what} shape"
        assert ratio < 1, f"{label}: {what} differs by {max_err} ({ratio:.2f}x its tolerance)"


def _dispatch_worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    reference = GroupedExperts(E, D, I)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.5)
    errors = {}
    for ep in (4, 2):
        ep_mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("rest", "ep"))["ep"]
        sharded = copy.deepcopy(reference)
        apply_expert_parallel(sharded, ep_mesh, DispatcherConfig("eager"))
        assert isinstance(sharded.dispatcher, EagerDispatcher) and sharded.num_experts == E // ep
        for case in CASES:
            errors[(ep, case, rank)] = _errors(reference, sharded, ep_mesh, rank, case)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, errors)
    return {key: value for part in gathered for key, value in part.items()}


@pytest.fixture(scope="module")
def dispatch_errors():
    return run_distributed(_dispatch_worker, WORLD)


@pytest.mark.parametrize("ep", [4, 2])
@pytest.mark.parametrize("case", CASES)
def test_eager_dispatch_matches_local_dispatch(dispatch_errors, ep, case):
    for rank in range(WORLD):
        check_errors(dispatch_errors[(ep, case, rank)], f"rank {rank}")


def test_unknown_dispatchers_fail_by_name():
    assert dispatcher_class("eager") is EagerDispatcher
    with pytest.raises(ValueError,
                       match=r"dispatcher.name='eagre' is unknown; registered: capacity, dedup, domino, eager, fused, mc2"):
        dispatcher_class("eagre")
