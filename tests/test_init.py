"""Initialisation does not depend on the layout: a sharded model initialised from a seed holds exactly the
weights one process initialises from that seed, so runs without a seed checkpoint agree too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train
from tests.conftest import TINY_MODEL, compose_config, write_tokens
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.torch_apis  # FSDP2 / EP sharded initialisation on gloo ranks

PRESETS = ["fsdp2", "ep2", "ep4", "ep2_edp2"]


def config(tmp_path: Path, parallel: str, local_batch: int, family: list[str]):
    return compose_config([*family, f"parallel={parallel}", "data=tokens", f"data.path={tmp_path / 'tokens.npy'}",
                           "data.seq_len=16", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=0",
                           f"train.local_batch_size={local_batch}", f"train.output_dir={tmp_path / parallel}",
                           "train.seed=7", "logging.tensorboard=false", "train.device=cpu"])


def worker(rank: int, world_size: int, cfgs: dict) -> dict:
    return {name: train.run(cfg)[0]["loss"] for name, cfg in cfgs.items()}


QWEN35 = ["model=qwen35_moe_debug", "model.arch.vocab_size=256", "model.arch.hidden_size=32"]


@pytest.mark.parametrize("family", [TINY_MODEL, QWEN35], ids=["qwen3_moe", "qwen3_5_moe"])
def test_sharded_init_equals_single_process_init(tmp_path, family):
    write_tokens(tmp_path / "tokens.npy", 2048)
    single_loss = train.run(config(tmp_path, "single", 8, family))[0]["loss"]
    losses = run_distributed(worker, 4, {p: config(tmp_path, p, 2, family) for p in PRESETS})
    want = load_file(tmp_path / "single" / "model.safetensors")
    for preset in PRESETS:
        got = load_file(tmp_path / preset / "model.safetensors")
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=f"{preset}: {name}")
        assert losses[preset] == pytest.approx(single_loss, rel=1e-5)
