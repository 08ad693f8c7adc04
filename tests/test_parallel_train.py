"""End to end through ``train.run``: every 4-rank preset loads the same Hugging Face weights, trains 3 steps on
the same token file and logs the loss and grad norm of the single-process run (fp32, rel 1e-4: the layouts
differ only in summation order)."""

from __future__ import annotations

from pathlib import Path

import pytest

import train
from models import build_args, get_spec
from models.hf_io import export_hf
from tests.conftest import TINY_MODEL, compose_config, write_tokens
from tests.dist_utils import run_distributed, seeded_weights

WORLD, LOCAL_BATCH = 4, 2
PRESETS = ["ddp", "fsdp2", "hsdp", "ep2", "ep4", "ep2_edp2"]


def train_config(tmp_path: Path, parallel: str, local_batch: int, *overrides: str, run: str | None = None,
                 device: str = "cpu", mixed_precision: str = "fp32"):
    """3 steps of the tiny model from tmp_path/hf on tmp_path/tokens.npy, with clipping active."""
    hf_dir, tokens = tmp_path / "hf", tmp_path / "tokens.npy"
    return compose_config([
        *TINY_MODEL, f"model.init_from={hf_dir}", f"parallel={parallel}", "data=tokens", f"data.path={tokens}",
        "data.seq_len=16", f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path / (run or parallel)}",
        "train.steps=3", f"train.local_batch_size={local_batch}", "train.save_final=false", "optim.warmup_steps=0",
        "optim.lr=1e-2", "optim.grad_clip=0.5", "logging.tensorboard=false", f"train.device={device}",
        f"train.mixed_precision={mixed_precision}", *overrides,
    ])


def write_inputs(tmp_path: Path, arch: dict) -> None:
    """The token file and the Hugging Face checkpoint of a seeded model that every run starts from."""
    write_tokens(tmp_path / "tokens.npy", 4096)
    args = build_args("qwen3_moe", arch)
    model = get_spec("qwen3_moe").model_cls(args)
    model.load_state_dict(seeded_weights(args))
    export_hf(model, "qwen3_moe", tmp_path / "hf")


def train_worker(rank: int, world_size: int, cfgs: dict) -> dict:
    return {name: train.run(cfg) for name, cfg in cfgs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("parallel_train")
    single = train_config(tmp_path, "single", LOCAL_BATCH * WORLD)
    write_inputs(tmp_path, dict(single.model.arch))
    reference = train.run(single)
    results = run_distributed(train_worker, WORLD, {p: train_config(tmp_path, p, LOCAL_BATCH) for p in PRESETS})
    return reference, results


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_trains_like_one_process(runs, preset):
    reference, results = runs
    got = results[preset]
    assert [m["step"] for m in got] == [1, 2, 3]
    for g, w in zip(got, reference):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4), f"step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), f"step {g['step']}"
    assert reference[0]["grad_norm"] > 0.5  # max_norm 0.5 really clipped
