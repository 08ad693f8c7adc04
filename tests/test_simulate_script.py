"""scripts/simulate.py without a GPU: its arithmetic, pinned against hand-computed values (a made-up measured rank and
plan), and its arguments and output directory, each refusal one line before anything is written.

The paper prediction (``sim.links=off``): the measured step less the loopback's all-to-all copies is the compute;
the exposed exchanges are added at the calibrated all-to-all rate, and whatever of FSDP's hidden traffic is longer
than the compute, ``max(0, hidden - compute)``. The executed FLOP rate counts full checkpointing's second forward.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("simulate_script", REPO / "scripts" / "simulate.py")
simulate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(simulate)


def _collective(kind: str, seconds: float, exposed: bool) -> SimpleNamespace:
    return SimpleNamespace(kind=kind, mesh="ep" if kind == "all_to_all" else "fsdp", what="x", calls=1,
                           bytes=8 * 2**20, seconds=seconds, exposed=exposed)


def _plan(a2a_s: float, hidden_s: float) -> SimpleNamespace:
    """A plan of 4,096 tokens per GPU on 8 GPUs: one exposed all-to-all of ``a2a_s`` and FSDP's ``hidden_s``."""
    return SimpleNamespace(collectives=[_collective("all_to_all", a2a_s, True),
                                        _collective("all_gather", hidden_s * 0.25, False),
                                        _collective("reduce_scatter", hidden_s * 0.75, False)],
                           tokens_per_gpu=4096, sizes=SimpleNamespace(world_size=8),
                           memory=SimpleNamespace(peak=2**30, peak_phase="LM head forward"),
                           tokens_per_s_per_gpu=1234.0)


def _history() -> list[dict]:
    """Six steps: the timed ones are steps 3 and 4 (after the first two, before the last), 1.0 and 1.2 s."""
    times = {1: 9.0, 2: 9.0, 3: 1.0, 4: 1.2, 5: 9.0, 6: 9.0}
    return [{"step": s, "step_time_s": t, "tflops_per_device": 100.0, "tokens_per_s_per_device": 1000.0,
             "peak_mem_gib": 3.0, "loss": 5.0} for s, t in times.items()]


def _cfg(checkpoint: str) -> SimpleNamespace:
    return SimpleNamespace(parallel=SimpleNamespace(activation_checkpoint=checkpoint, name="ep8"),
                           train=SimpleNamespace(device="cpu"), dispatcher=SimpleNamespace(name="fused"))


PROFILE = {"loopback_ms": {"all_to_all": 100.0, "all_gather": 7.0}, "busy_ms": 1.0, "idle_ms": 0.0, "wall_ms": 1.0,
           "categories_ms": {}}


@pytest.mark.parametrize("hidden_s, unhidden_s", [(1.5, 0.5), (0.4, 0.0)])
def test_the_paper_prediction_adds_the_calibrated_exchange_and_the_unhidden_fsdp_traffic(hidden_s, unhidden_s):
    # step 1.1 s (the median of 1.0 and 1.2) - 0.1 s of all-to-all copies = 1.0 s of compute; the exposed all-to-all
    # takes 0.6 s at the calibrated rate (0.2 at the link's); FSDP's 1.5 s of hidden traffic leaves 0.5 s beyond the
    # compute, 0.4 s leaves nothing.
    paper, calibrated = _plan(0.2, hidden_s), _plan(0.6, hidden_s)
    r = simulate.predict(_cfg("none"), paper, _history(), PROFILE, calibrated)
    assert r["step_s"] == pytest.approx(1.1) and r["a2a_copies_s"] == pytest.approx(0.1)
    assert r["compute_s"] == pytest.approx(1.0)
    assert r["hidden_link_s"] == pytest.approx(hidden_s)
    assert r["exposed_link_s"] == pytest.approx(0.6) and r["link_exposed_s"] == pytest.approx(0.2)
    assert r["predicted_step_s"] == pytest.approx(1.0 + 0.6 + unhidden_s)
    assert r["predicted_tokens_per_s_per_gpu"] == pytest.approx(4096 / (1.6 + unhidden_s))
    assert r["at_link_rate_tokens_per_s_per_gpu"] == pytest.approx(4096 / (1.2 + unhidden_s))
    assert r["plan_tokens_per_s_per_gpu"] == 1234.0


@pytest.mark.parametrize("checkpoint, executed", [("none", 409.6), ("full", 409.6 * 4 / 3), ("selective", None),
                                                  ("full_keep_exchange", 409.6 * 4 / 3)])
def test_the_executed_rate_counts_full_checkpointings_second_forward(checkpoint, executed):
    # The FLOPs of a step: 4,096 tokens x 100 TFLOP/s / 1,000 tokens/s = 4.096e14, over 1.0 s of compute.
    r = simulate.predict(_cfg(checkpoint), _plan(0.2, 0.4), _history(), PROFILE, _plan(0.6, 0.4))
    assert r["compute_tflops"] == pytest.approx(409.6)
    assert r["executed_tflops"] == (pytest.approx(executed) if executed else None)


@pytest.mark.parametrize("arg, error", [
    ("sim.world=0", r"^sim.world=0 must be >= 1 \(the simulated job's ranks, e.g. sim.world=8\)$"),
    ("sim.world=abc", r"^sim.world=abc must be an integer \(the simulated job's ranks\)$"),
    ("sim.steps=0", r"^sim.steps=0 must be >= 2: the last two steps are profiled"),
    ("sim.steps=1", r"^sim.steps=1 must be >= 2: the last two steps are profiled"),
    ("sim.rank=4", r"^sim.rank=4 must be in \[0, sim.world=4\)$"),
    ("sim.a2a_gb_s=fast", r"^sim.a2a_gb_s=fast must be a number"),
    ("sim.a2a_gb_s=0", r"^sim.a2a_gb_s=0.0 must be > 0"),
    ("sim.routing=random", r"^sim.routing=random must be balanced or learned$"),
    ("sim.links=maybe", r"^sim.links=maybe must be on \(each collective held for its link time\) or off"),
    ("sim.comm_sms=0", r"^sim.comm_sms=0 must be >= 1"),
    ("sim.wrld=4", r"^sim has no key 'wrld'"),
])
def test_a_bad_sim_value_is_one_line_naming_the_key_before_anything_is_written(arg, error, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a simulation without sim.out would write
    with pytest.raises(ValueError, match=error):
        simulate.main([arg, "sim.world=4"] if not arg.startswith("sim.world") else [arg])
    assert not list(tmp_path.iterdir())


def _run_dir(path: Path, simulated: str | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "run.json").write_text(json.dumps({"run_dir": str(path), "simulated": simulated}))
    (path / "config.yaml").write_text("train: {}\n")
    return path


@pytest.mark.parametrize("case, error", [
    ("a training run", r"^sim.out=.*/real is a training run's directory \(config.yaml, run.json\): the simulation "
                       r"would write into that run; give sim.out a new or empty directory$"),
    ("inside a training run", r"^sim.out=.*/real/sim is inside the training run .*/real \(its run.json\)"),
    ("an earlier simulation", r"^sim.out=.*/earlier holds an earlier simulation \(run, simulation.json\), which a "
                              r"simulation neither resumes nor overwrites: give sim.out a new directory"),
    ("a user's folder", r"^sim.out=.*/mine is not empty \(notes.txt\) and holds no simulation"),
    ("a file", r"^sim.out=.*/file is a file, not a directory"),
])
def test_sim_out_takes_only_a_new_or_empty_directory(case, error, tmp_path):
    out = {"a training run": lambda: _run_dir(tmp_path / "real"),
           "inside a training run": lambda: _run_dir(tmp_path / "real") / "sim",
           "an earlier simulation": lambda: _run_dir(tmp_path / "earlier" / "run", "rank 0 of 8").parent,
           "a user's folder": lambda: tmp_path / "mine",
           "a file": lambda: tmp_path / "file"}[case]()
    if case == "an earlier simulation":
        (out / "simulation.json").write_text("{}")
    elif case == "a user's folder":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif case == "a file":
        out.write_text("mine")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match=error):
        simulate.main([f"sim.out={out}", "sim.world=4"])
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written, nothing removed


@pytest.mark.parametrize("given", [False, True])
def test_a_simulation_that_fails_leaves_nothing_behind(given, tmp_path, monkeypatch):
    """The layout is refused after the random tokens are written (an ep2 job of 3 ranks): neither sim.out (made by
    the simulation) nor a temporary directory stays."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "new" / "out"
    with pytest.raises(ValueError, match=r"parallel.ep_size=2 must divide"):
        simulate.main(["parallel=ep2", "sim.world=3", *([f"sim.out={out}"] if given else [])])
    assert not list(tmp_path.iterdir())


def test_the_emulated_prediction_is_the_measured_step():
    """sim.links=on: the median timed step (1.1 s) is the prediction; the compute's rate is over the profile's busy
    time (0.8 s here), the planner's link time at the same rates beside it."""
    profile = {**PROFILE, "busy_ms": 800.0}
    r = simulate.emulated(_cfg("full"), _plan(0.2, 0.4), _history(), profile, _plan(0.6, 0.4), {"all_to_all": 0.55})
    assert r["predicted_step_s"] == r["step_s"] == pytest.approx(1.1) and r["links"] == "emulated"
    assert r["predicted_tokens_per_s_per_gpu"] == pytest.approx(4096 / 1.1)
    assert r["busy_s"] == pytest.approx(0.8) and r["held_link_s"] == {"all_to_all": 0.55}
    assert r["planned_exposed_link_s"] == pytest.approx(0.6) and r["planned_hidden_link_s"] == pytest.approx(0.4)
    assert r["compute_tflops"] == pytest.approx(409.6 / 0.8) and r["executed_tflops"] == pytest.approx(409.6 / 0.6)


_calibrate_spec = importlib.util.spec_from_file_location("calibrate_links", REPO / "scripts" / "calibrate_links.py")
calibrate = importlib.util.module_from_spec(_calibrate_spec)
_calibrate_spec.loader.exec_module(calibrate)


def test_the_calibration_fits_the_rate_at_which_the_exposed_exchange_gives_the_measured_step():
    # At 130 GB/s: a 0.30 s step holding 0.10 s of all-to-all; measured 16,384 / 0.35 s. Fully exposed, the
    # exchange must take 0.15 s: 130 x 0.10 / 0.15 = 86.7, rounded to 85 GB/s.
    report = {"step_s": 0.30, "held_link_s": {"all_to_all": 0.10}, "tokens_per_gpu": 16384}
    assert calibrate.fitted_rate(report, 130.0, 16384 / 0.35) == 85.0
    assert calibrate.fitted_rate(report, 130.0, 16384 / 0.15) == 130.0  # faster than without any exchange: no rate
    assert calibrate.fitted_rate({**report, "held_link_s": {}}, 130.0, 1000.0) == 130.0


def test_the_calibration_table_says_which_rows_hold_and_the_order_of_domino_and_fused(capsys):
    def row(label, measured, predicted, baseline):
        report = {"predicted_tokens_per_s_per_gpu": predicted, "held_link_s": {"all_to_all": 0.05}, "busy_s": 0.2}
        return {"label": label, "measured": measured, "emulated": report,
                "baseline": {"predicted_tokens_per_s_per_gpu": baseline}}

    calibrate.print_table({"rate": 120.0, "rows": [row("8 layers, ep2 fused", 53_727, 53_000, 52_408),
                                                   row("8 layers, ep2 domino", 51_878, 57_000, 52_000)]})
    out = capsys.readouterr().out
    assert "| 8 layers, ep2 fused | 53,727 | 53,000 (-1.4%) | yes | 52,408 (-2.5%) | 50.0 | 200.0 |" in out
    assert "| 8 layers, ep2 domino | 51,878 | 57,000 (+9.9%) | NO |" in out
    assert "order: fused 53,000 <= domino 57,000 (measured: fused 53,727 > domino 51,878): NOT as measured" in out


def test_the_all_to_all_rate_defaults_to_the_one_calibrated_for_the_model_in_use():
    """docs/scaling.md: the paper model (sim.links=off) was calibrated at 130 GB/s, the emulated links at 160."""
    from parallelisms.links import A2A_GB_S, A2A_GB_S_EMULATED

    assert (A2A_GB_S, A2A_GB_S_EMULATED) == (130.0, 160.0)
    assert simulate.sim_args([])[0]["a2a_gb_s"] == A2A_GB_S_EMULATED
    assert simulate.sim_args(["sim.links=off"])[0]["a2a_gb_s"] == A2A_GB_S
    assert simulate.sim_args(["sim.links=off", "sim.a2a_gb_s=50"])[0]["a2a_gb_s"] == 50.0
