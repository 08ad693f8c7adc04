"""The levers against the EP exchange (issue 62), each opt-in, each counted by the planner and checked on CPU:

- ``dedup`` and ``capacity`` counted by the planner: dedup's rows per token exactly for round-robin routing (the
  simulation's, ``model.arch.router_force_balance``) and as the uniform expectation for learned routing; capacity's
  static buffer. A loopback step sends exactly what the plan counts, for them and for the others below.
- ``dispatcher.fp8_dispatch``: the dispatch in e4m3 (fused, domino, dedup): the dispatch against the single-rank
  LocalDispatcher within e4m3's rounding, and a 2-rank ep2 run's losses and gradient norms against eager's.
- ``parallel.activation_checkpoint=full_keep_exchange``: full checkpointing that keeps what the all-to-alls received:
  the same losses and gradients as full checkpointing (fp32, summation order), and no exchange in the recompute.
"""

from __future__ import annotations

import collections
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import train
from models.moe import GroupedExperts, round_robin_experts
from parallelisms import loopback
from parallelisms.dispatchers import DispatcherConfig
from parallelisms.dispatchers.base import LayerShape, token_ranks
from parallelisms.expert_parallel import apply_expert_parallel
from tests.conftest import TINY_MODEL, compose_config, write_tokens
from tests.dist_utils import run_distributed
from tests.test_parallel_train import train_config, write_inputs
from tests.test_plan import PLANNED_MESHES
from training.planner import PlanConfig, plan

pytestmark = pytest.mark.torch_apis  # EP all-to-alls on gloo ranks and a Python process-group backend


def _shape(E: int, K: int, P: int, T: int, round_robin: bool) -> LayerShape:
    return LayerShape(tokens=T, top_k=K, num_experts=E, ep=P, hidden=8, element_bytes=2, row_len=T,
                      round_robin=round_robin, cfg=DispatcherConfig("dedup"))


@pytest.mark.parametrize("E, K, P, T", [(8, 2, 2, 16), (8, 3, 4, 13), (16, 4, 4, 32), (128, 8, 8, 4096),
                                        (12, 5, 3, 7), (8, 7, 2, 9)])  # the last: runs that wrap onto their first rank
def test_the_ranks_a_token_reaches_under_round_robin_routing_are_counted_exactly(E, K, P, T):
    experts_TK = round_robin_experts(T, E, K, T, torch.device("cpu"))
    brute = sum(len(set((row // (E // P)).tolist())) for row in experts_TK)
    assert token_ranks(_shape(E, K, P, T, True)) * T == pytest.approx(brute, abs=1e-9)


def test_the_ranks_a_token_reaches_under_learned_routing_are_the_uniform_expectation():
    E, K, P = 8, 3, 4
    subsets = list(itertools.combinations(range(E), K))
    brute = sum(len({e // (E // P) for e in s}) for s in subsets) / len(subsets)
    assert token_ranks(_shape(E, K, P, 1, False)) == pytest.approx(brute)
    # Qwen3-30B-A3B at ep8: round robin puts a token's 8 consecutive experts on one rank; a uniform router on 5.27
    assert token_ranks(_shape(128, 8, 8, 4096, True)) == 1.0
    assert token_ranks(_shape(128, 8, 8, 1, False)) == pytest.approx(8 * (1 - math.comb(112, 8) / math.comb(128, 8)))


# ----------------------------------------------------------------------------- a loopback step sends the plan

LEVERS = {
    "dedup": ["dispatcher=dedup"],
    "capacity": ["dispatcher=capacity", "dispatcher.capacity_factor=1.5"],
    "fused_fp8": ["dispatcher=fused", "dispatcher.fp8_dispatch=true"],
    "domino_fp8": ["dispatcher=domino", "dispatcher.fp8_dispatch=true"],
    "dedup_fp8": ["dispatcher=dedup", "dispatcher.fp8_dispatch=true"],
    "fused_keep": ["dispatcher=fused", "parallel.activation_checkpoint=full_keep_exchange"],
    "domino_keep": ["dispatcher=domino", "parallel.activation_checkpoint=full_keep_exchange"],
    "dedup_keep_fp8": ["dispatcher=dedup", "dispatcher.fp8_dispatch=true",
                       "parallel.activation_checkpoint=full_keep_exchange"],
}


def _simulated(tmp_path, name: str, overrides: list[str]) -> dict:
    """One loopback step of rank 1 of a 4-rank ep2 job (round-robin routing): its loss and the bytes it sent per
    (kind, planned mesh)."""
    cfg = compose_config([*TINY_MODEL, "parallel=ep2", "model.arch.router_force_balance=true", "data=tokens",
                          f"data.path={tmp_path / 'tokens.npy'}", "data.seq_len=16",
                          f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path / name}",
                          "train.steps=1", "train.local_batch_size=2", "train.save_final=false", "train.device=cpu",
                          "train.mixed_precision=fp32", "logging.tensorboard=false", "launch.simulate_world=4",
                          "launch.simulate_rank=1", *overrides])
    dims = []
    build_dims = train.parallelisms.build_parallel_dims

    def keep_dims(*args, **kwargs):
        dims.append(build_dims(*args, **kwargs))
        return dims[-1]

    loopback.COUNTED.clear()
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(train.parallelisms, "build_parallel_dims", keep_dims)
            history = train.run(cfg)
        groups = {}
        for planned, mesh in PLANNED_MESHES.items():
            if mesh in dims[0].meshes and dims[0].mesh(mesh).size() > 1:
                groups.setdefault(dims[0].mesh(mesh).get_group().group_name, []).append(planned)
        sent = collections.Counter()
        for (kind, group), nbytes in loopback.COUNTED.items():
            if kind != "all_reduce":  # the loss and norm scalars: not planned
                sent[kind, "+".join(groups.get(group, ["other"]))] += nbytes * 4
        return {"cfg": cfg, "loss": history[0]["loss"], "sent": dict(sent)}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("levers")
    write_tokens(tmp_path / "tokens.npy", 4096)
    return {name: _simulated(tmp_path, name, o) for name, o in {"fused": ["dispatcher=fused"], **LEVERS}.items()}


@pytest.mark.parametrize("name", sorted(LEVERS))
def test_a_loopback_step_of_each_lever_sends_what_the_planner_counts(simulated, name):
    run = simulated[name]
    group_of = {mesh: key[1] for key in run["sent"] for mesh in key[1].split("+")}
    want = collections.Counter()
    for c in plan(run["cfg"], PlanConfig(gpus=4)).collectives:
        want[c.kind, group_of.get(c.mesh, c.mesh)] += c.bytes
    assert ("all_to_all", "ep") in run["sent"] and run["sent"] == dict(want)
    # the same loss as fused: exact up to summation order, the e4m3 dispatch within its rounding
    assert run["loss"] == pytest.approx(simulated["fused"]["loss"], rel=2e-2 if "fp8" in name else 1e-5)


def test_the_levers_send_fewer_bytes_where_they_should(simulated):
    a2a = {name: run["sent"][("all_to_all", "ep")] for name, run in simulated.items()}
    # tiny model: 8 experts top-2 over 2 ranks, round robin: a token's 2 consecutive experts share a rank
    assert a2a["dedup"] < a2a["fused"] / 1.5 and a2a["fused_fp8"] < a2a["fused"]
    plans = {name: plan(run["cfg"], PlanConfig(gpus=4)) for name, run in simulated.items()}
    full = plan(compose_config([*TINY_MODEL, "parallel=ep2", "parallel.activation_checkpoint=full",
                                "dispatcher=fused", "train.mixed_precision=fp32", "train.local_batch_size=2",
                                "data.seq_len=16"]), PlanConfig(gpus=4))
    ep_bytes = {name: sum(c.bytes for c in p.collectives if c.mesh == "ep") for name, p in plans.items()}
    full_bytes = sum(c.bytes for c in full.collectives if c.mesh == "ep")
    assert ep_bytes["fused_keep"] < full_bytes  # no exchange sent again in the recompute
    assert ep_bytes["fused_keep"] == ep_bytes["fused"]  # ... so it sends what no checkpointing sends
    # and keeps what the exchanges received beyond full checkpointing's block inputs
    assert plans["fused_keep"].memory.activations["full_keep_exchange"] > full.memory.activations["full"]


# ----------------------------------------------------------------------------- the e4m3 dispatch on gloo ranks

E, D, I, K = 8, 32, 16, 2


def _fp8_errors(rank: int, world_size: int) -> dict:
    """Per dispatcher: the relative (norm-wise) error of the output and the input, router-weight and expert
    gradients of the fp8 dispatch against the single-rank LocalDispatcher, and against the same dispatcher in
    fp32 (which must be 0 up to summation order: the e4m3 rounding is the only change)."""
    torch.manual_seed(0)
    reference = GroupedExperts(E, D, I)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ep_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    g = torch.Generator().manual_seed(rank)
    experts_NK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(13)])
    x_ND, w_NK = torch.randn(13, D, generator=g), torch.rand(13, K, generator=g)
    probe = torch.randn(13, D, generator=g)

    def run(module) -> list[torch.Tensor]:
        x, w = x_ND.clone().requires_grad_(), w_NK.clone().requires_grad_()
        y = module(x, experts_NK, w)
        (y * probe).sum().backward()
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in module.parameters()]
        return [y.detach(), x.grad, w.grad, *grads]

    want = run(reference)
    local = slice(rank * E // world_size, (rank + 1) * E // world_size)
    for i in range(3, len(want)):  # the experts' gradients: the group's sum, this rank's experts
        dist.all_reduce(want[i])
        want[i] = want[i][local]
    out = {}
    for name in ("fused", "domino", "dedup"):
        for fp8 in (False, True):
            import copy

            module = copy.deepcopy(reference)
            apply_expert_parallel(module, ep_mesh, DispatcherConfig(name, fp8_dispatch=fp8))
            got = run(module)
            out[name, fp8] = [float((a - b).norm() / b.norm()) for a, b in zip(got, want)]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, out)
    return gathered


@pytest.fixture(scope="module")
def fp8_errors():
    return run_distributed(_fp8_errors, 2)


@pytest.mark.parametrize("name", ["fused", "domino", "dedup"])
def test_the_fp8_dispatch_is_the_dispatch_within_e4m3_rounding(fp8_errors, name):
    for rank, errors in enumerate(fp8_errors):
        assert max(errors[name, False]) < 1e-5, (rank, errors[name, False])  # the same maths in fp32
        # e4m3 keeps 3 mantissa bits: an element rounds by 2^-4 of itself at most, 2^-4 / sqrt(3) = 3.6% rms (more
        # for the small elements of a row, which its largest scales); measured 3.4-6.1% here
        assert 1e-3 < errors[name, True][0] < 0.1, (rank, errors[name, True])  # the output is e4m3's, not exact
        assert max(errors[name, True]) < 0.1, (rank, errors[name, True])


def _train_worker(rank: int, world_size: int, cfgs: dict) -> dict:
    return {name: train.run(cfg) for name, cfg in cfgs.items()}


RUNS = {"eager": ["dispatcher=eager"], "full": ["dispatcher=eager", "parallel.activation_checkpoint=full"],
        "fused_fp8": ["dispatcher=fused", "dispatcher.fp8_dispatch=true"],
        "domino_fp8_keep": ["dispatcher=domino", "dispatcher.fp8_dispatch=true",
                            "parallel.activation_checkpoint=full_keep_exchange"],
        "fused_keep": ["dispatcher=fused", "parallel.activation_checkpoint=full_keep_exchange"],
        "dedup_keep": ["dispatcher=dedup", "parallel.activation_checkpoint=full_keep_exchange"]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("levers_train")
    cfgs = {name: train_config(tmp_path, "ep2", 2, *o, run=name) for name, o in RUNS.items()}
    write_inputs(tmp_path, dict(cfgs["eager"].model.arch))
    return run_distributed(_train_worker, 2, cfgs)


@pytest.mark.parametrize("name", ["fused_keep", "dedup_keep"])
def test_full_keep_exchange_trains_as_full_checkpointing(trained, name):
    for got, want in zip(trained[name], trained["full"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5) and got["step"] == want["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("name", ["fused_fp8", "domino_fp8_keep"])
def test_the_fp8_dispatch_trains_as_eager_within_e4m3_rounding(trained, name):
    for got, want in zip(trained[name], trained["eager"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-2) and got["step"] == want["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=5e-2)
    assert any(g["loss"] != w["loss"] for g, w in zip(trained[name], trained["eager"]))


@pytest.mark.parametrize("routing, choice", [
    ("round_robin", "dispatcher=dedup dispatcher.fp8_dispatch=true parallel.activation_checkpoint=full:"),
    ("learned", "dispatcher=fused parallel.activation_checkpoint=full:")])
def test_the_advice_never_chooses_a_setting_measured_slower(monkeypatch, routing, choice):
    """On paper full_keep_exchange (fewer exchanges), fused's e4m3 dispatch and, under learned routing, dedup win;
    measured with the links emulated they lost (training.planner.MEASURED_SLOWER): the advice lists them, says why,
    and chooses the fastest other."""
    from training import planner

    cfg = compose_config(["model=qwen3_moe_30b_a3b", "parallel=ep8", "parallel.activation_checkpoint=full",
                          "data.seq_len=4096", "train.local_batch_size=4",
                          f"model.arch.router_force_balance={routing == 'round_robin'}"])
    machine = PlanConfig(gpus=8, a2a_gb_s=160, capacity_gib=1000)  # everything fits: the choice is speed alone
    lines = planner.advise(cfg, machine)
    chosen, = [line for line in lines if line.startswith("->")]
    assert chosen.startswith(f"-> {choice}") and "measured slower" not in chosen
    assert any("full_keep_exchange" in line and "(measured slower, not chosen: keeping the exchanges" in line
               for line in lines)
    if routing == "learned":
        assert any(line.startswith("   dispatcher=dedup") and "not chosen: under learned routing" in line
                   for line in lines)
    monkeypatch.setattr(planner, "MEASURED_SLOWER", ())  # the paper alone would choose a measured loser
    paper = next(line for line in planner.advise(cfg, machine) if line.startswith("->"))
    assert "dispatcher=dedup" in paper and "fused" not in paper
