"""optim.schedule: each schedule's multiplier against the formula worked by hand, cosine against the formula it
replaced, a resume that follows the schedule exactly, the checks on its keys, and the lr a wsd run logs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import train
from training.config import DECAY_SHAPES, OptimConfig, TrainConfig, validate
from training.optim import DECAY, build_scheduler, lr_multiplier


def cosine_before_schedules(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """training.optim.lr_lambda as it was before optim.schedule existed: cosine must stay exactly this."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("warmup, total, min_lr_ratio", [(10, 100, 0.1), (0, 7, 0.0), (3, 3, 0.5), (5, 1, 0.1)])
def test_cosine_is_the_default_and_unchanged(warmup, total, min_lr_ratio):
    cfg = OptimConfig(warmup_steps=warmup, min_lr_ratio=min_lr_ratio)
    assert cfg.schedule == "cosine"
    for step in range(total + 3):
        assert lr_multiplier(step, cfg, total) == cosine_before_schedules(step, warmup, total, min_lr_ratio)


# warmup 2, 10 steps, wsd decay over the last half (steps 5..10), to 0.1: warmup (s+1)/3, then 1 up to step 5,
# then 0.1 + 0.9 g(p) with p = (s - 5) / 5.
WSD = {"warmup_steps": 2, "min_lr_ratio": 0.1, "decay_fraction": 0.5}
HAND = {
    "linear": {6: 0.1 + 0.9 * 0.8, 8: 0.1 + 0.9 * 0.4, 9: 0.1 + 0.9 * 0.2},
    "cosine": {6: 0.1 + 0.45 * (1 + math.cos(0.2 * math.pi)), 8: 0.1 + 0.45 * (1 + math.cos(0.6 * math.pi)),
               9: 0.1 + 0.45 * (1 + math.cos(0.8 * math.pi))},
    "sqrt": {6: 0.1 + 0.9 * (1 - math.sqrt(0.2)), 8: 0.1 + 0.9 * (1 - math.sqrt(0.6)),
             9: 0.1 + 0.9 * (1 - math.sqrt(0.8))},
}


@pytest.mark.parametrize("shape", DECAY_SHAPES)
def test_wsd_warms_up_holds_the_peak_then_decays_with_its_shape(shape):
    cfg = OptimConfig(schedule="wsd", decay_shape=shape, **WSD)
    expected = {0: 1 / 3, 1: 2 / 3, 2: 1.0, 4: 1.0, 5: 1.0, **HAND[shape], 10: 0.1, 12: 0.1}
    assert {s: lr_multiplier(s, cfg, 10) for s in expected} == pytest.approx(expected, rel=1e-12)


def test_wsd_over_every_step_and_constant():
    whole = OptimConfig(schedule="wsd", warmup_steps=0, decay_fraction=1.0, decay_shape="linear", min_lr_ratio=0.0)
    assert [lr_multiplier(s, whole, 4) for s in range(6)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    constant = OptimConfig(schedule="constant", warmup_steps=3)
    assert [lr_multiplier(s, constant, 5) for s in range(8)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_every_shape_the_config_accepts_has_a_formula():
    assert tuple(DECAY) == DECAY_SHAPES


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_a_scheduler_built_at_a_resumed_position_continues_the_uninterrupted_one(schedule):
    cfg = OptimConfig(schedule=schedule, lr=1e-2, decay_shape="sqrt", **WSD)

    def scheduler(position: int):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        return build_scheduler(optimizer, cfg, 10, position)

    uninterrupted = scheduler(0)
    for position in range(12):
        assert scheduler(position).get_last_lr() == uninterrupted.get_last_lr()
        assert uninterrupted.get_last_lr()[0] == cfg.lr * lr_multiplier(position, cfg, 10)
        uninterrupted.optimizer.step()
        uninterrupted.step()


@pytest.mark.parametrize("keys, message", [
    ({"schedule": "wsdd"}, "optim.schedule='wsdd' is unknown; choose one of cosine, wsd, constant"),
    ({"decay_shape": "exp"}, "optim.decay_shape='exp' is unknown; choose one of linear, cosine, sqrt"),
    ({"decay_fraction": 0.0}, "optim.decay_fraction=0.0 must be in (0, 1]"),
    ({"decay_fraction": 1.5}, "optim.decay_fraction=1.5 must be in (0, 1]"),
    ({"schedule": "wsd", "warmup_steps": 6, "decay_fraction": 0.5},
     "optim.warmup_steps=6 runs into the wsd decay, which starts at step 5 (the last optim.decay_fraction=0.5 of "
     "train.steps=10): lower optim.warmup_steps or optim.decay_fraction"),
])
def test_schedule_keys_are_checked_with_the_key_and_the_fix(keys, message):
    cfg = TrainConfig(optim=OptimConfig(**keys))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=10))
    with pytest.raises(ValueError) as error:
        validate(cfg)
    assert message in str(error.value)


def test_warmup_may_end_where_the_wsd_decay_starts():
    cfg = TrainConfig(optim=OptimConfig(schedule="wsd", warmup_steps=5, decay_fraction=0.5))
    validate(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=10)))


def test_a_wsd_run_logs_the_lr_of_its_schedule(tiny_run_config):
    cfg = tiny_run_config("train.steps=10", "optim.schedule=wsd", "optim.decay_shape=linear", "optim.warmup_steps=2",
                          "optim.decay_fraction=0.5", "optim.lr=1e-2", "train.save_final=false",
                          "logging.routing_every=0")
    history = train.run(cfg)
    lr = {m["step"]: m["lr"] for m in history}
    # Step s updates with the multiplier after s - 1 updates (the HAND table above, shifted by one).
    expected = {1: 1 / 3, 2: 2 / 3, 3: 1.0, 6: 1.0, 7: 0.82, 9: 0.46, 10: 0.28}
    assert {s: lr[s] for s in expected} == pytest.approx({s: 1e-2 * v for s, v in expected.items()}, rel=1e-9)
