"""The loopback simulation (``launch.simulate_world``, ``parallelisms/loopback.py``) against real gloo jobs.

The real job of each layout is one in which every peer is a copy of the simulated rank r: every rank reads the same
batch (under CP, a window of equal cp shards, position ids included: each shard one document) and every parameter's
local shard is the same on every rank (filled from its name), so each sharded tensor is tiled from rank r's shard
and each expert equals the one at its position on rank r. One step with ``optim.grad_clip=0``. The simulation must
give that job's first loss, rank r's gradients and updated shards, to fp32 rounding, except the experts': a
simulated rank's experts stand in for the experts at their position on every ep peer, so their gradient is the mean
over the ep group of the real ranks' gradients there, and their update AdamW's step on that mean. And what the
simulation sends, per collective kind and mesh, times the world, is the planner's count (tests/test_plan.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import subprocess
import sys
import zlib
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

import parallelisms
import train
from models.moe import GroupedExperts
from parallelisms import loopback
from tests.conftest import TINY_MODEL, compose_config, write_tokens
from tests.dist_utils import run_distributed
from tests.test_plan import PLANNED_MESHES, QWEN35_TINY
from training.config import validate
from training.planner import PlanConfig, plan

pytestmark = pytest.mark.torch_apis  # a Python process-group backend (c10d's trampoline names differ by version)

# layout -> (world, simulated rank, overrides). ep4_efsdp2 on 4 experts takes the Shard(1) fallback (efsdp x ep =
# 8 > 4). Qwen3.5's shared_expert_gate [1, D] has fewer rows than FSDP ranks: only rank 0's shard holds its row (a
# padded shard of another rank tiles padding), so that layout simulates rank 0.
CASES = {
    "ep2": (4, 1, [*TINY_MODEL, "parallel=ep2", "dispatcher=fused"]),
    "hsdp": (4, 1, [*TINY_MODEL, "parallel=hsdp", "parallel.activation_checkpoint=full"]),
    "qwen35_cp2_ep2": (4, 0, [*QWEN35_TINY, "parallel=ep2", "parallel.cp_size=2", "dispatcher=eager"]),
    "ep4_efsdp2_shard1": (8, 3, [*TINY_MODEL, "parallel=ep4_efsdp2", "model.arch.num_experts=4", "dispatcher=eager"]),
    "cp2_ep2_efsdp2": (8, 5, [*TINY_MODEL, "parallel=cp2_ep2_efsdp2", "dispatcher=domino"]),
}


def _config(tmp_path: Path, case: str, world: int, rank: int, overrides: list[str], simulate: bool):
    run = f"{case}-{'sim' if simulate else 'real'}"
    return compose_config([*overrides, "data=tokens", f"data.path={tmp_path / 'tokens.npy'}", "data.seq_len=16",
                           f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path / run}",
                           "train.steps=1", "train.local_batch_size=2", "train.save_final=false", "optim.grad_clip=0",
                           "train.device=cpu", "train.mixed_precision=fp32", "logging.tensorboard=false",
                           *([f"launch.simulate_world={world}", f"launch.simulate_rank={rank}"] if simulate
                             else [])])


class SameWindows:
    """The loader of dp rank 0 for every rank, each window made of cp equal shards that each start a document."""

    def __init__(self, loader, cp: int) -> None:
        self._loader, self._cp = loader, cp

    def __next__(self) -> dict[str, torch.Tensor]:
        window = next(self._loader)
        shard = window["input_ids"].shape[-1] // self._cp
        equal = {name: x[..., :shard].repeat(1, self._cp) for name, x in window.items()}
        equal["position_ids"] = torch.arange(shard).repeat(self._cp).expand_as(equal["input_ids"]).contiguous()
        return equal

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _same_data(cfg, dims, plan):
    loader, val = _build_data(cfg, parallelisms.ParallelDims(**{**vars(dims), "rank": 0, "dp": 1}), plan)
    return SameWindows(loader, dims.cp), val


_build_data, _build_model, _grad_norm = train.build_data, train.build_model, parallelisms.grad_norm
_build_dims = parallelisms.build_parallel_dims


def _initial(name: str, shape: torch.Size) -> torch.Tensor:
    """A parameter's local shard, from its name. DeltaNet's conv taps (per-head weights of a CP sequence op, sliced
    by head group) are the same for every channel, so that every cp rank's head group holds equal ones."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name.endswith("conv1d.weight"):
        return (torch.randn(shape[-1], generator=g) * 0.1).expand(shape).clone()
    return torch.randn(shape, generator=g) * 0.1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _run(cfg) -> dict:
    """One step of ``cfg`` with equal shards and data on every rank: the first loss, this rank's local gradients
    and updated shards, which are experts', and the bytes this process sent per (kind, planned mesh)."""
    built, grads = [], {}

    def build_model(*args, **kwargs):
        model, counts, kernels = _build_model(*args, **kwargs)
        with torch.no_grad():
            for name, p in model.named_parameters():  # the same on every rank: tiled full tensors
                _local(p).copy_(_initial(name, _local(p).shape))
        built.append(model)
        return model, counts, kernels

    def grad_norm(model, dims):
        grads.update({n: _local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None})
        return _grad_norm(model, dims)

    dims_built = []

    def build_dims(*args, **kwargs):
        dims_built.append(_build_dims(*args, **kwargs))
        return dims_built[-1]

    loopback.COUNTED.clear()
    with mock.patch.object(train, "build_model", build_model), mock.patch.object(train, "build_data", _same_data), \
            mock.patch.object(train.parallelisms, "grad_norm", grad_norm), \
            mock.patch.object(train.parallelisms, "build_parallel_dims", build_dims):
        history = train.run(cfg)
    model, dims = built[0], dims_built[0]
    experts = {f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, GroupedExperts) for p, _ in
               m.named_parameters()}
    groups = {}
    for planned, name in PLANNED_MESHES.items():
        if name in dims.meshes and dims.mesh(name).size() > 1:
            groups.setdefault(dims.mesh(name).get_group().group_name, []).append(planned)
    sent = collections.Counter()
    for (kind, group), nbytes in loopback.COUNTED.items():
        sent[kind, "+".join(groups.get(group, ["other"]))] += nbytes
    return {"loss": history[0]["loss"], "lr": history[0]["lr"], "grads": grads, "experts": experts,
            "params": {n: _local(p).detach().clone() for n, p in model.named_parameters()},
            "ep_peers": dist.get_process_group_ranks(dims.mesh("ep").get_group()) if dims.ep > 1 else [dims.rank],
            "sent": dict(sent)}


def _real_worker(rank: int, world_size: int, cfgs: dict) -> dict:
    """Every rank's result, gathered on rank 0."""
    out = {}
    for case, cfg in cfgs.items():
        mine = _run(cfg)
        mine.pop("sent")
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine)
        out[case] = gathered
    return out


def _simulate(cfgs: dict) -> dict:
    """In a fresh process: the loopback world is its default process group."""
    results = {}
    for case, cfg in cfgs.items():
        results[case] = _run(cfg)
        dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("simulate")
    write_tokens(tmp_path / "tokens.npy", 4096)
    sims = {case: _config(tmp_path, case, world, rank, o, simulate=True) for case, (world, rank, o) in CASES.items()}
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        simulated = pool.submit(_simulate, sims).result(timeout=600)
    real = {}
    for world in sorted({w for w, _, _ in CASES.values()}):
        cfgs = {case: _config(tmp_path, case, w, r, o, simulate=False) for case, (w, r, o) in CASES.items()
                if w == world}
        real.update(run_distributed(_real_worker, world, cfgs))
    return sims, simulated, real


def _adamw_step(param: torch.Tensor, grad: torch.Tensor, lr: float, cfg) -> torch.Tensor:
    """torch's AdamW, one step from zero moments: the reference for an expert's update on the mean gradient."""
    p = param.clone().requires_grad_()
    p.grad = grad.clone()
    torch.optim.AdamW([p], lr=lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                      weight_decay=cfg.optim.weight_decay if p.ndim >= 2 else 0.0).step()
    return p.detach()


@pytest.mark.parametrize("case", list(CASES))
def test_a_simulated_rank_is_the_real_rank_of_a_job_of_copies(results, case):
    cfgs, simulated, real = results
    sim, ranks = simulated[case], real[case]
    mine = ranks[CASES[case][1]]
    assert sim["loss"] == pytest.approx(mine["loss"], rel=1e-5)
    assert sim["grads"].keys() == mine["grads"].keys() and sim["experts"]
    peers = [ranks[p] for p in sim["ep_peers"]]
    initial = {name: _initial(name, p.shape) for name, p in sim["params"].items()}
    for name, grad in sim["grads"].items():
        if name.endswith("conv1d.weight") and "cp" in case:
            continue  # a head group's taps run every cp rank's heads here: their gradient lands on this rank's group
        if name in sim["experts"]:
            want = torch.stack([r["grads"][name] for r in peers]).mean(0)
            torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(sim["params"][name], _adamw_step(initial[name], want, sim["lr"], cfgs[case]),
                                       rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} (updated): {m}")
        else:
            torch.testing.assert_close(grad, mine["grads"][name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(sim["params"][name], mine["params"][name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{name} (updated): {m}")
    # the experts' gradients really differ between ep peers: the mean is not rank r's own
    if len(peers) > 1:
        assert any(not torch.allclose(peers[0]["grads"][name], peer["grads"][name])
                   for name in sim["experts"] for peer in peers[1:])


@pytest.mark.parametrize("case", list(CASES))
def test_what_a_simulated_rank_sends_times_the_world_is_the_plan(results, case):
    """Bytes of each collective's input per (kind, mesh), as tests/test_plan.py counts a real job's over its
    ranks: the simulated rank's times the world. The scalar all-reduces (loss, norm, stop flag) are not planned."""
    cfgs, simulated, _ = results
    world = CASES[case][0]
    got = {k: v * world for k, v in simulated[case]["sent"].items()
           if k[0] != "all_reduce" or {"edp_cp", "mp_replicate"} & set(k[1].split("+"))}
    group_of = {mesh: key[1] for key in got for mesh in key[1].split("+")}  # meshes that are one group count together
    want = collections.Counter()
    for c in plan(cfgs[case], PlanConfig(gpus=world)).collectives:
        want[c.kind, group_of.get(c.mesh, c.mesh)] += c.bytes
    assert got == dict(want)


def test_a_simulated_run_says_so_and_writes_no_weights(results):
    cfgs, _, _ = results
    run_dir = Path(cfgs["ep2"].train.output_dir)
    assert json.loads((run_dir / "run.json").read_text())["simulated"] == "rank 1 of 4"
    assert "SIMULATION: this process is rank 1 of a 4-rank job" in (run_dir / "train.log").read_text()
    assert not (run_dir / "model.safetensors").exists() and not list(run_dir.glob("checkpoints/step_*"))


@pytest.mark.parametrize("overrides, error", [
    (["launch.simulate_world=8"], r"writes no checkpoint, weights or export .* set train.save_final=false$"),
    (["launch.simulate_world=8", "train.save_final=false", "checkpoint.interval=5", "train.resume=auto"],
     r"set checkpoint.interval=0 train.resume=none$"),
    (["launch.simulate_world=8", "launch.simulate_rank=8", "train.save_final=false"], r"0 <= simulate_rank < "),
    (["launch.simulate_rank=1"], r"launch.simulate_rank=1 needs launch.simulate_world"),
    (["launch.simulate_world=8", "launch.nproc_per_node=8", "train.save_final=false"], r"runs in one process"),
    (["launch.simulate_world=8", "dispatcher=mc2", "train.save_final=false"], r"dispatcher=mc2 .* cannot simulate"),
])
def test_what_a_simulation_cannot_do_is_refused_in_one_line(overrides, error):
    with pytest.raises(ValueError, match=error):
        validate(compose_config(overrides))



def _simulate_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/simulate.py", *args], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)


def test_scripts_simulate_measures_a_rank_and_predicts_the_job(tmp_path):
    """The README's command on the tiny default: rank 0 of a 4-rank ep2 job, its report and simulation.json, with the
    links off (the prediction on paper)."""
    out = _simulate_script("parallel=ep2", "sim.world=4", "sim.steps=3", "train.local_batch_size=2", "data.seq_len=32",
                           f"sim.out={tmp_path}", "sim.links=off")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rank 0 of 4 (ep2, dispatcher fused, routing balanced, 64 tokens per GPU per step)" in out.stdout
    report = json.loads((tmp_path / "simulation.json").read_text())
    assert report["world"] == 4 and report["predicted_tokens_per_s_per_gpu"] > 0 and report["links"] == "off"
    assert report["executed_tflops"] == report["compute_tflops"]  # no checkpointing: nothing ran twice
    assert {c["kind"] for c in report["collectives"]} == {"all_gather", "reduce_scatter", "all_to_all"}
    # The exposed exchanges (ep2's all-to-alls, inside a node) at sim.a2a_gb_s (default 130), not the link's 450
    at_link = sum(c["link_s"] for c in report["collectives"] if c["exposed"])
    assert at_link > 0 and report["link_exposed_s"] == pytest.approx(at_link)
    assert report["exposed_link_s"] == pytest.approx(at_link * 450 / 130)
    assert report["advice"][0].startswith("choice for the exchange (the planner's numbers: 4 GPUs, the all-to-all at "
                                          "130 GB/s inside a node, round-robin routing):")
    bad = _simulate_script("sim.wrld=4")
    assert bad.returncode == 1 and bad.stderr.startswith("error: ValueError: sim has no key 'wrld'")


def test_scripts_simulate_with_the_links_emulated_predicts_the_measured_step(tmp_path):
    """The default, sim.links=on: each collective held for its link time (on the CPU a sleep), the prediction the
    measured step; the all-to-all time held per step is the plan's at sim.a2a_gb_s (fp32, as the CPU computes: the
    planner takes train.mixed_precision=auto for bf16)."""
    out = _simulate_script("parallel=ep2", "dispatcher=dedup", "sim.world=4", "sim.steps=3", "train.local_batch_size=2",
                           "data.seq_len=32", "train.mixed_precision=fp32", f"sim.out={tmp_path}", "sim.a2a_gb_s=50")
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "simulation.json").read_text())
    assert report["links"] == "emulated" and report["predicted_step_s"] == report["step_s"]
    assert report["predicted_tokens_per_s_per_gpu"] == pytest.approx(64 / report["step_s"])
    planned = sum(c["link_s"] for c in report["collectives"] if c["kind"] == "all_to_all") * 450 / 50
    assert report["held_link_s"]["all_to_all"] == pytest.approx(planned, rel=1e-6)
    assert "link time held per step: all_gather" in out.stdout and "predicted:" in out.stdout
    given = _simulate_script("launch.links.a2a_gb_s=9", f"sim.out={tmp_path / 'x'}")
    assert given.returncode == 1 and "launch.links.a2a_gb_s: scripts/simulate.py sets the links from sim.links" in \
        given.stderr
