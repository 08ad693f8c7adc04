"""scripts/simulate.py's arithmetic, pinned against hand-computed values (no run: a made-up measured rank and plan).

The paper prediction (``sim.links=off``): the measured step less the loopback's all-to-all copies is the compute;
the exposed exchanges are added at the calibrated all-to-all rate, and whatever of FSDP's hidden traffic is longer
than the compute, ``max(0, hidden - compute)``. The executed FLOP rate counts full checkpointing's second forward.
"""

from __future__ import annotations

import importlib.util
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
                           train=SimpleNamespace(device="cpu"))


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


@pytest.mark.parametrize("checkpoint, executed", [("none", 409.6), ("full", 409.6 * 4 / 3), ("selective", None)])
def test_the_executed_rate_counts_full_checkpointings_second_forward(checkpoint, executed):
    # The FLOPs of a step: 4,096 tokens x 100 TFLOP/s / 1,000 tokens/s = 4.096e14, over 1.0 s of compute.
    r = simulate.predict(_cfg(checkpoint), _plan(0.2, 0.4), _history(), PROFILE, _plan(0.6, 0.4))
    assert r["compute_tflops"] == pytest.approx(409.6)
    assert r["executed_tflops"] == (pytest.approx(executed) if executed else None)
