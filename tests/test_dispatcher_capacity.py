"""dispatcher=capacity (static, equal all-to-all splits) against dispatcher=eager, on 4 gloo ranks at ep 4 and 2.

Both dispatchers shard the same experts; each routing case (tests/test_dispatch.py's, cut to 7 tokens on every
rank: capacity needs equal N over the group) runs forward and backward through both, and the output, the input,
router-weight and expert-weight gradients must agree to fp32 summation order (test_dispatch's ATOL, RTOL). Also:
an overflow raises on every rank, from the next call (or ``raise_if_overflowed``, or the trainer's
``raise_if_dispatch_overflowed``), the config group's capacity_factor reaches the dispatcher, and the dispatch and combine
halves read no device value on the host (``Tensor.tolist`` / ``item`` / ``nonzero`` / ``__bool__`` patched to raise
around forward and backward, lifted only inside the grouped GEMM, whose CPU reference loop reads its counts).
The end-to-end 3-step run against eager is in tests/test_dispatchers.py (E2E_RUNS).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from kernels.moe.grouped_mm import grouped_mm
from models.moe import GroupedExperts
from parallelisms.dispatchers import DispatcherConfig
from parallelisms.dispatchers.capacity import CapacityDispatcher
from parallelisms.expert_parallel import apply_expert_parallel, may_drop_rows, raise_if_dispatch_overflowed
from tests.dist_utils import run_distributed
from tests.test_dispatch import ATOL, RTOL, D, E, I, _experts_NK

pytestmark = pytest.mark.torch_apis  # EP all-to-alls and grouped_mm on gloo ranks

N = 7
# case -> capacity_factor: large enough that nothing overflows (the routing sends one peer up to all N*K rows:
# a factor of ep), or a rank's mean share with room for random routing's imbalance.
CASES = {"random": 2.5, "zero_token_experts": 4.0, "local_only": 4.0, "next_rank": 4.0, "all_to_rank_0": 4.0,
         "one_token": 4.0, "top1": 2.5, "top4": 2.0}
SYNCING = ("tolist", "item", "nonzero", "__bool__")


@contextlib.contextmanager
def _patched(replacements: dict) -> None:
    saved = {name: getattr(torch.Tensor, name) for name in replacements}
    for name, fn in replacements.items():
        setattr(torch.Tensor, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _no_host_reads():
    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name} in the dispatch path")
        return method

    return _patched({name: refuse(name) for name in SYNCING})


def _host_reads_allowed(mm):
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def lifted(*args, **kwargs):
        with _patched(originals):
            return mm(*args, **kwargs)

    return lifted


def _run(module: GroupedExperts, x_ND, experts_NK, weights_NK, probe_ND, guard=contextlib.nullcontext):
    module.zero_grad()
    x, w = x_ND.clone().requires_grad_(), weights_NK.clone().requires_grad_()
    with guard():
        y = module(x, experts_NK, w)
        (y * probe_ND).sum().backward()
    return [y.detach(), x.grad, w.grad, *(p.grad.to_local() for p in module.parameters())]


def _sharded_pair(ep_mesh) -> tuple[GroupedExperts, GroupedExperts]:
    """The same seeded experts under dispatcher=eager and dispatcher=capacity."""
    torch.manual_seed(0)
    eager = GroupedExperts(E, D, I)
    with torch.no_grad():
        for p in eager.parameters():
            p.normal_(std=0.5)
    capacity = copy.deepcopy(eager)
    apply_expert_parallel(eager, ep_mesh, DispatcherConfig("eager"))
    apply_expert_parallel(capacity, ep_mesh, DispatcherConfig("capacity"))
    return eager, capacity


def _worker(rank: int, world_size: int) -> dict:
    result = {}
    for ep in (4, 2):
        ep_mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("rest", "ep"))["ep"]
        ep_rank = ep_mesh.get_local_rank()
        eager, capacity = _sharded_pair(ep_mesh)
        dispatcher = capacity.dispatcher
        assert isinstance(dispatcher, CapacityDispatcher)
        capacity.grouped_mm = _host_reads_allowed(grouped_mm)
        for case, factor in CASES.items():
            dispatcher.configure(DispatcherConfig("capacity", capacity_factor=factor))
            experts_NK = _experts_NK(case, ep_rank, ep, seed=rank)[:N]
            g = torch.Generator().manual_seed(100 + rank)
            inputs = (torch.randn(len(experts_NK), D, generator=g), experts_NK,
                      torch.rand(*experts_NK.shape, generator=g), torch.randn(len(experts_NK), D, generator=g))
            want = _run(eager, *inputs)
            got = _run(capacity, *inputs, guard=_no_host_reads)
            dispatcher.raise_if_overflowed()
            errors = []
            for a, b in zip(got, want):
                errors.append(float(((a - b).abs() / (ATOL + RTOL * b.abs())).max()) if b.numel() else 0.0)
            padded = dispatcher.capacity(len(experts_NK), experts_NK.shape[1]) * ep > experts_NK.numel()
            result[(ep, case, rank)] = {"errors": errors, "padded": padded}

        if ep == 2:  # the guard is real: eager's one host sync (its split sizes) trips it
            try:
                _run(eager, *inputs, guard=_no_host_reads)
                result["eager_guarded"] = "no error"
            except AssertionError as error:
                result["eager_guarded"] = str(error)

        # Overflow: everything to ep rank 0 at a factor of 1 (C = N*K/ep rows per peer, the mean).
        dispatcher.configure(DispatcherConfig("capacity", capacity_factor=1.0))
        experts_NK = _experts_NK("all_to_rank_0", ep_rank, ep, seed=rank)[:N]
        inputs = (torch.randn(N, D), experts_NK, torch.rand(*experts_NK.shape), torch.randn(N, D))
        _run(capacity, *inputs)  # the step that overflows returns; its host copy is queued
        messages = []
        trainer_check = lambda: raise_if_dispatch_overflowed(nn.ModuleList([eager, capacity]))  # noqa: E731
        for check in (dispatcher.raise_if_overflowed, lambda: _run(capacity, *inputs), trainer_check):
            try:
                check()
                messages.append("no error")
            except RuntimeError as error:
                messages.append(str(error))
        result[(ep, "overflow", rank)] = messages
        # The trainer queues no update before its read where a dispatcher may drop rows (train.py: train_step).
        result[(ep, "may_drop_rows", rank)] = (may_drop_rows(nn.ModuleList([eager, capacity])),
                                                may_drop_rows(nn.ModuleList([eager])))
        configured = GroupedExperts(E, D, I)  # apply_expert_parallel hands the group's keys to the dispatcher
        apply_expert_parallel(configured, ep_mesh, DispatcherConfig("capacity", capacity_factor=3.0))
        result[(ep, "factor", rank)] = configured.dispatcher.capacity_factor
    gathered = [None] * world_size
    dist.all_gather_object(gathered, result)
    return {key: value for part in gathered for key, value in part.items()}


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_worker, 4)


@pytest.mark.parametrize("ep", [4, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_capacity_matches_eager_with_no_host_reads(four_ranks, ep, case):
    for rank in range(4):
        got = four_ranks[(ep, case, rank)]
        names = ["y", "x.grad", "weights.grad", "gate_up_proj.grad", "down_proj.grad"]
        for name, ratio in zip(names, got["errors"]):
            assert ratio < 1, f"rank {rank}: {name} differs by {ratio:.2f}x its tolerance"
        assert got["padded"], "the case should send padding rows"


@pytest.mark.parametrize("ep", [4, 2])
def test_capacity_overflow_raises_on_every_rank(four_ranks, ep):
    C = -(-N * 2 // ep)  # factor 1: the mean rows per peer
    for rank in range(4):
        immediate, next_call, trainer = four_ranks[(ep, "overflow", rank)]
        assert immediate == next_call == trainer, rank
        assert immediate.startswith(f"dispatcher=capacity overflowed: an ep rank had {N * 2} rows for one peer, "
                                    f"over its capacity of {C} (dispatcher.capacity_factor=1.0)"), immediate
        assert "Raise dispatcher.capacity_factor" in immediate


def test_only_a_model_with_a_capacity_dispatcher_may_drop_rows(four_ranks):
    assert {four_ranks[(ep, "may_drop_rows", rank)] for ep in (4, 2) for rank in range(4)} == {(True, False)}


def test_the_config_group_reaches_the_dispatcher(four_ranks):
    assert {four_ranks[(ep, "factor", rank)] for ep in (4, 2) for rank in range(4)} == {3.0}


def test_the_guard_catches_eager_s_host_sync(four_ranks):
    assert four_ranks["eager_guarded"] == "Tensor.tolist in the dispatch path"
