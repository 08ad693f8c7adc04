"""A new dispatcher is two files, and what the rest of the code needs of it, it declares (parallelisms/dispatchers/
base.py): tests/toy_dispatcher/ holds the two files of ``toy`` at the paths they would have in the repository,
parallelisms/dispatchers/toy.py and conf/dispatcher/toy.yaml. The ``toy`` fixture loads the module as the
dispatcher package loads its own (its ``@register("toy")`` runs) and puts conf/ on Hydra's search path; it is
unregistered after each test.

Then the planner (its traffic and memory, and what it refuses to count), the simulation's checks
(``training.launch.simulation_errors`` through ``validate``), the dispatcher group's keys (``validate``) and
parallelize (which installs it and asks its ``check_layout``) handle ``toy`` by its traits: with domino's
(``chunks = 2``) it gets domino's plan, with eager's or fused's theirs, and a trait set on its class changes what
each refuses. A one-step loopback run of it sends what the planner counts, and trains as domino does.
"""

from __future__ import annotations

import collections
import concurrent.futures
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from parallelisms.dispatchers import DISPATCHERS, Dispatcher, base
from tests.conftest import TINY_MODEL, compose_config, write_tokens
from tests.test_dispatchers import installed_dispatchers
from tests.test_simulate import _config, _run
from training.config import validate
from training.planner import PlanConfig, plan

TOY = Path(__file__).resolve().parent / "toy_dispatcher"
SEARCH_PATH = f"hydra.searchpath=[file://{TOY / 'conf'}]"


def load_toy() -> type[Dispatcher]:
    """Import tests/toy_dispatcher/parallelisms/dispatchers/toy.py as the dispatcher package imports its modules:
    its ``@register("toy")`` adds it to DISPATCHERS."""
    spec = importlib.util.spec_from_file_location("toy_dispatcher", TOY / "parallelisms" / "dispatchers" / "toy.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return DISPATCHERS["toy"]


@pytest.fixture
def toy() -> Iterator[type[Dispatcher]]:
    assert "toy" not in DISPATCHERS
    try:
        yield load_toy()
    finally:
        DISPATCHERS.pop("toy", None)  # tests/test_dispatchers.py: the registered dispatchers are conf/dispatcher's


def toy_config(overrides: list[str]):
    return compose_config([SEARCH_PATH, *TINY_MODEL, "dispatcher=toy", *overrides])


def test_the_toy_registers_itself_and_composes(toy):
    lines = (TOY / "conf" / "dispatcher" / "toy.yaml").read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1:] == ["name: toy"]  # as tests/test_dispatchers.py asks of each
    assert toy.name == "toy" and toy.__name__ == "ToyDispatcher"
    cfg = toy_config(["parallel=ep2"])
    assert cfg.dispatcher.name == "toy"
    validate(cfg)


@pytest.mark.parametrize("traits, twin", [({}, "domino"), ({"chunks": 1}, "fused"),
                                          ({"chunks": 1, "extra_saved_rows": 1}, "eager")])
@pytest.mark.parametrize("checkpoint", ["none", "full"])  # none: the rows kept for backward; full: forwards twice
def test_the_planner_plans_the_toy_by_its_traits(toy, monkeypatch, traits, twin, checkpoint):
    for trait, value in traits.items():
        monkeypatch.setattr(toy, trait, value)
    overrides = ["parallel=ep2", f"parallel.activation_checkpoint={checkpoint}"]
    machine = PlanConfig(gpus=4)
    assert plan(toy_config(overrides), machine) == plan(compose_config([*TINY_MODEL, *overrides,
                                                                        f"dispatcher={twin}"]), machine)


def test_the_planner_refuses_to_count_what_the_toy_says_it_cannot(toy, monkeypatch):
    # Counted by default, so it joins the list the planner gives for one it cannot count.
    with pytest.raises(ValueError, match=r"counts the traffic of capacity, dedup, domino, eager, fused, toy only "
                                         r"\(mc2's moves inside MC2's grouped matmuls"):
        plan(compose_config([*TINY_MODEL, "parallel=ep2", "dispatcher=mc2"]), PlanConfig(gpus=4))
    monkeypatch.setattr(toy, "uncounted_traffic", "depends on the weather")
    with pytest.raises(ValueError, match=r"^dispatcher.name='toy': the planner counts the traffic of capacity, dedup, "
                                         r"domino, eager, fused only \(toy's depends on the weather\)$"):
        plan(toy_config(["parallel=ep2"]), PlanConfig(gpus=4))
    plan(toy_config(["parallel=fsdp2"]), PlanConfig(gpus=4))  # no EP: no dispatcher, nothing to count


SIMULATED = ["launch.simulate_world=8", "train.save_final=false"]


def test_the_simulation_refuses_the_toy_only_where_it_says_so(toy, monkeypatch):
    validate(toy_config(SIMULATED))
    with pytest.raises(ValueError, match=r"^dispatcher=mc2 .*cannot simulate it; use a dispatcher it can \(capacity, "
                                         r"dedup, domino, eager, fused, toy\)$"):
        validate(compose_config(["dispatcher=mc2", *SIMULATED]))
    monkeypatch.setattr(toy, "unsimulated", "talks to its peers through a side channel")
    with pytest.raises(ValueError, match=r"^dispatcher=toy talks to its peers through a side channel: "
                                         r"launch.simulate_world cannot simulate it; use a dispatcher it can "
                                         r"\(capacity, dedup, domino, eager, fused\)$"):
        validate(toy_config(SIMULATED))


def test_the_toy_takes_only_the_keys_it_declares(toy, monkeypatch):
    with pytest.raises(ValueError, match=r"^dispatcher.capacity_factor applies to dispatcher=capacity only, not toy$"):
        validate(toy_config(["dispatcher.capacity_factor=3"]))
    monkeypatch.setattr(toy, "config_keys", ("capacity_factor",))
    validate(toy_config(["dispatcher.capacity_factor=-1"]))  # its own: capacity's range check is capacity's
    with pytest.raises(ValueError, match=r"^dispatcher.capacity_factor applies to dispatcher=capacity, toy only, "
                                         r"not fused$"):
        validate(compose_config(["dispatcher.capacity_factor=3"]))
    with pytest.raises(ValueError, match=r"^dispatcher.capacity_factor=-1.0 must be > 0"):
        validate(compose_config(["dispatcher=capacity", "dispatcher.capacity_factor=-1"]))
    monkeypatch.setattr(toy, "config_keys", ("capacity_fctor",))
    with pytest.raises(TypeError, match=r"@register\('toy2'\): config_keys \['capacity_fctor'\] are not keys of the "
                                        r"dispatcher group"):
        base.register("toy2")(toy)
    assert "toy2" not in DISPATCHERS



def test_parallelize_installs_the_toy_within_its_layout(toy):
    assert installed_dispatchers(toy_config(["parallel=ep2"])) == {toy}
    with pytest.raises(ValueError, match=r"^dispatcher=toy takes parallel.ep_size <= 2, got ep=4; use "
                                         r"dispatcher=fused$"):
        installed_dispatchers(toy_config(["parallel=ep4"]))


# ----------------------------------------------------------------------------- the toy really sends what is planned

def _simulate(cfgs: dict) -> dict:
    """In a fresh process (the loopback world is its default process group), the toy registered there too."""
    load_toy()
    out = {}
    for name, cfg in cfgs.items():
        result = _run(cfg)
        dist.destroy_process_group()
        out[name] = {"loss": result["loss"], "sent": result["sent"]}
    return out


@pytest.mark.torch_apis  # a Python process-group backend (tests/test_simulate.py)
def test_a_loopback_run_of_the_toy_sends_what_the_planner_counts(toy, tmp_path):
    """Rank 1 of a 4-rank ep2 job, one step: the toy's bytes per (kind, mesh) times the world are its plan (as
    tests/test_simulate.py checks the built-in dispatchers), and its loss is domino's."""
    write_tokens(tmp_path / "tokens.npy", 4096)
    world, rank = 4, 1
    cfgs = {name: _config(tmp_path, name, world, rank, [SEARCH_PATH, *TINY_MODEL, "parallel=ep2",
                                                        f"dispatcher={name}"], simulate=True)
            for name in ("toy", "domino")}
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        simulated = pool.submit(_simulate, cfgs).result(timeout=600)
    assert simulated["toy"]["loss"] == pytest.approx(simulated["domino"]["loss"], rel=1e-5)
    got = {k: v * world for k, v in simulated["toy"]["sent"].items()
           if k[0] != "all_reduce" or {"edp_cp", "mp_replicate"} & set(k[1].split("+"))}  # scalars: not planned
    group_of = {mesh: key[1] for key in got for mesh in key[1].split("+")}  # meshes that are one group count together
    want = collections.Counter()
    for c in plan(cfgs["toy"], PlanConfig(gpus=world)).collectives:
        want[c.kind, group_of.get(c.mesh, c.mesh)] += c.bytes
    assert ("all_to_all", "ep") in got and got == dict(want)
