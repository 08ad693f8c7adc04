"""Start-up in one pass (training/startup.py): a run validates its config and checks its model, tokenizer and layout
once each, on a fresh start and on a resume alike; a resume may change exactly the fields that declare themselves
``execution`` (core/config.py), and nothing else without train.allow_changes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

import train
from core.config import execution, execution_keys
from training import startup
from training.config import TrainConfig, check_resume_config


def _counting(monkeypatch, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(startup, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(startup, name, counted)
    return calls


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_checks_its_config_once(tiny_run_config, monkeypatch, resume) -> None:
    if resume:
        train.run(tiny_run_config("train.steps=2", "checkpoint.interval=1"))
    validated, checked = _counting(monkeypatch, "validate"), _counting(monkeypatch, "check_config")
    history = train.run(tiny_run_config("train.steps=3", "train.resume=auto" if resume else "train.resume=none",
                                        *(["train.allow_changes=[train.steps]"] if resume else [])))
    assert [m["step"] for m in history] == ([3] if resume else [1, 2, 3])
    assert (len(validated), len(checked)) == (1, 1)


def test_the_launching_process_plans_once_and_hands_torchrun_the_plans_directory(tiny_run_config, monkeypatch):
    """launch.nproc_per_node: the launcher's one plan (its run directory and checkpoint root) is what torchrun's
    children are told; nothing is written before they start."""
    validated, checked = _counting(monkeypatch, "validate"), _counting(monkeypatch, "check_config")
    launched = {}
    monkeypatch.setattr(train, "relaunch_with_torchrun",
                        lambda launch, overrides, run_dir, config, checkpoints: launched.update(
                            run_dir=run_dir, checkpoints=checkpoints))
    monkeypatch.setattr("hydra.core.hydra_config.HydraConfig.get", lambda: _FakeHydra())
    cfg = tiny_run_config("launch.nproc_per_node=2", "parallel=ep2")
    train.relaunch(cfg)
    assert (len(validated), len(checked)) == (1, 1)
    assert launched == {"run_dir": cfg.train.output_dir, "checkpoints": startup.checkpoint_root(
        cfg, startup.run_path(cfg))}
    assert not startup.run_path(cfg).exists()


class _FakeHydra:
    class overrides:
        task: list[str] = []

    class runtime:
        config_sources = [type("Source", (), {"provider": "main", "path": "file://conf"})()]
        output_dir = "unused"

    class job:
        config_name = "config"


def test_the_plan_is_frozen_and_holds_what_start_up_decided(tiny_run_config) -> None:
    cfg = tiny_run_config("train.grad_accum_steps=2")
    plan = startup.plan_run(cfg, startup.World(1))
    assert (plan.spec.model_type, plan.global_batch, plan.first_step, plan.finished) == ("qwen3_moe", 8, 1, False)
    assert plan.tokens_per_step == 8 * cfg.data.seq_len
    assert plan.run_config["model"]["arch"]["hidden_size"] == 32  # the architecture as built, recorded
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.global_batch = 1


def test_a_resume_may_change_exactly_the_fields_declared_execution() -> None:
    """The free keys are read off the schema's field metadata: every one of them passes a resume, and a field of the
    same groups not so marked (the optimizer, the data, the seed) is refused without train.allow_changes."""
    free = set(execution_keys(TrainConfig))
    assert {"parallel", "dispatcher", "train.device", "train.local_batch_size", "data.cache_dir",
            "model.init_from"} <= free
    assert not free & {"optim.lr", "train.seed", "data.path", "model.arch", "train.steps", "data.seq_len"}
    for key in sorted(free):
        assert check_resume_config({key: "old"}, {key: "new"}, [], "ckpt") == [f"{key}: 'old' -> 'new'"]
    for key in ("optim.lr", "train.seed", "data.seq_len"):
        with pytest.raises(ValueError, match=rf"would change what is trained: {key}"):
            check_resume_config({key: 1}, {key: 2}, [], "ckpt")


@dataclass
class _Inner:
    how: int = execution(default=0)
    what: int = 0


@dataclass
class _Outer:
    free: _Inner = execution(default_factory=_Inner)
    compared: _Inner = field(default_factory=_Inner)


def test_execution_marks_a_whole_group_or_single_fields() -> None:
    assert list(execution_keys(_Outer)) == ["free", "compared.how"]
