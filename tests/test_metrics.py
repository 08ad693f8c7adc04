"""MoE observability: imbalance and router entropy computed from the routing statistics; the metric sinks on a
resume (metrics.jsonl, tensorboard, wandb through a fake module)."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from models.moe import TopKRouter
from training.config import LoggingConfig
from training.metrics import WANDB_ID_FILE, MetricLogger, moe_metrics, progress_line, reduce_routing, routing_summary


def test_imbalance_and_entropy_match_a_direct_computation():
    torch.manual_seed(0)
    router = TopKRouter(dim=16, num_experts=4, top_k=2, norm_topk_prob=True)
    torch.nn.init.normal_(router.weight)
    x_ND = torch.randn(50, 16)
    _, experts_NK, stats = router(x_ND)
    metrics = moe_metrics(reduce_routing(routing_summary([stats, stats]), group=None))
    counts = torch.bincount(experts_NK.flatten(), minlength=4).float()
    probs = torch.softmax(x_ND @ router.weight.T, dim=-1)
    entropy = -(probs * probs.log()).sum(-1).mean()
    assert metrics["moe/layer1/imbalance"] == pytest.approx((counts.max() / counts.mean()).item())
    assert metrics["moe/layer0/router_entropy"] == pytest.approx(entropy.item(), rel=1e-5)
    assert 0 < metrics["moe/layer0/router_entropy"] <= math.log(4)
    assert metrics["moe/max_imbalance"] == metrics["moe/layer0/imbalance"]
    # One layer's aux loss is transformers' load_balancing_loss_func over that layer's tokens.
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    want = load_balancing_loss_func((x_ND @ router.weight.T,), num_experts=4, top_k=2)
    assert metrics["moe/layer0/aux_loss"] == pytest.approx(want.item(), rel=1e-5)


def test_progress_line_is_one_concise_line():
    m = {"step": 3, "loss": 2.5, "aux_loss": 1.0, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s_per_device": 1234.0,
         "mfu": 0.41, "moe/max_imbalance": 1.7, "peak_mem_gib": 3.2}
    line = progress_line(m, 10, eta_s=75)
    assert "\n" not in line and "step     3/10" in line and "mfu 41.0%" in line and "eta 1m15s" in line


# ---- MetricLogger on a resume: metrics.jsonl, tensorboard and wandb continue from the checkpoint's step ----

def metrics_at(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "grad_norm": 0.5, "skipped": False}


def run_attempt(run_dir: Path, steps: range, loss, keep_until: int | None = None, **logging_keys) -> MetricLogger:
    """One attempt of a run: a MetricLogger (resuming after ``keep_until``) that logs ``steps``, then closes."""
    cfg = LoggingConfig(**{"tensorboard": False, **logging_keys})
    run_dir.mkdir(exist_ok=True)
    metric_logger = MetricLogger(run_dir, cfg, enabled=True, run_config={"train": {"seed": 0}},
                                 keep_until=keep_until)
    for step in steps:
        metric_logger.log(metrics_at(step, loss(step)))
    metric_logger.close()
    return metric_logger


class FakeWandbRun:
    def __init__(self, kwargs: dict) -> None:
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, data: dict, step: int) -> None:
        self.logged.append((step, dict(data)))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    """A ``wandb`` module recording each init's keyword arguments and each run's log calls."""
    module = types.ModuleType("wandb")
    module.runs = []

    def init(**kwargs):
        module.runs.append(FakeWandbRun(kwargs))
        return module.runs[-1]

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.setenv("WANDB_MODE", "offline")  # MetricLogger only sets it when unset; keep os.environ clean
    return module


def test_a_fresh_run_gets_a_new_wandb_id_kept_in_the_run_directory(tmp_path, fake_wandb):
    run_attempt(tmp_path / "a", range(1, 4), float, wandb=True)
    run_attempt(tmp_path / "b", range(1, 4), float, wandb=True)
    first, second = fake_wandb.runs
    assert "resume" not in first.kwargs and first.kwargs["dir"] == str(tmp_path / "a")
    assert first.kwargs["id"] == (tmp_path / "a" / WANDB_ID_FILE).read_text().strip()
    assert first.kwargs["id"] != second.kwargs["id"]
    assert [step for step, _ in first.logged] == [1, 2, 3] and first.finished
    # A fresh start in a reused directory (train.resume=auto, no checkpoint yet) is a new wandb run too.
    run_attempt(tmp_path / "a", range(1, 3), float, wandb=True)
    assert fake_wandb.runs[2].kwargs["id"] not in (first.kwargs["id"], second.kwargs["id"])
    assert (tmp_path / "a" / WANDB_ID_FILE).read_text().strip() == fake_wandb.runs[2].kwargs["id"]


def test_a_resume_continues_the_saved_wandb_run_after_the_steps_it_holds(tmp_path, fake_wandb, caplog):
    run_attempt(tmp_path, range(1, 9), float, wandb=True)  # checkpoint at 5, killed after logging step 8
    with caplog.at_level("WARNING", logger="train"):
        run_attempt(tmp_path, range(6, 13), lambda s: s + 0.5, keep_until=5, wandb=True)
    first, resumed = fake_wandb.runs
    assert resumed.kwargs["id"] == first.kwargs["id"] and resumed.kwargs["resume"] == "allow"
    # wandb's steps only increase: 6..8 keep the first attempt's values there; the rest continues at step 9.
    assert [(step, data["loss"]) for step, data in resumed.logged] == [(s, s + 0.5) for s in range(9, 13)]
    assert "already holds steps 6..8" in caplog.text
    # metrics.jsonl: every step once, the resumed values from step 6 on.
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["loss"]) for m in lines] == [(s, float(s) if s <= 5 else s + 0.5) for s in range(1, 13)]


def test_a_resume_from_the_last_logged_step_sends_every_step(tmp_path, fake_wandb, caplog):
    run_attempt(tmp_path, range(1, 6), float, wandb=True)  # e.g. a SIGTERM checkpoint at the last step
    with caplog.at_level("WARNING", logger="train"):
        run_attempt(tmp_path, range(6, 9), float, keep_until=5, wandb=True)
    assert [step for step, _ in fake_wandb.runs[1].logged] == [6, 7, 8] and "already holds" not in caplog.text


def test_a_resume_without_a_saved_wandb_id_starts_a_new_wandb_run(tmp_path, fake_wandb):
    run_attempt(tmp_path, range(1, 6), float)  # wandb off in the first attempt
    run_attempt(tmp_path, range(6, 9), float, keep_until=5, wandb=True)
    [run] = fake_wandb.runs
    assert "resume" not in run.kwargs and run.kwargs["id"] == (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert [step for step, _ in run.logged] == [6, 7, 8]


def tensorboard_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, value) of every "loss" event tensorboard's reader keeps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return [(e.step, pytest.approx(e.value)) for e in events.Scalars("loss")]


def test_tensorboard_curves_after_a_resume_replace_the_interrupted_tail(tmp_path):
    run_attempt(tmp_path, range(1, 11), float, tensorboard=True)  # checkpoint at 5, killed after step 10
    run_attempt(tmp_path, range(6, 13), lambda s: s + 0.5, keep_until=5, tensorboard=True)
    assert tensorboard_losses(tmp_path) == [(s, float(s) if s <= 5 else s + 0.5) for s in range(1, 13)]
    # A fresh start in the reused directory (no checkpoint reached) replaces everything.
    run_attempt(tmp_path, range(1, 4), lambda s: -s, tensorboard=True)
    assert tensorboard_losses(tmp_path) == [(s, -s) for s in range(1, 4)]
