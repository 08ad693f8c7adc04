"""What a run reads must agree with what it records (issue 53, items 5-8): a checkpoint whose folder name, train
state, files and schedule disagree is refused before anything is written; a run that skips every step stops naming
the first non-finite tensor; pretokenized shards are never mixed with foreign or stale ones; and a token shard
changed under a running job stops it before another step or checkpoint reads it. docs/reliability.md lists each
case with its test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import train


# ------------------------------------------------------------------------------------- 6. every step skipped
@pytest.mark.parametrize("steps,stops_at", [(8, 5), (3, 3)])  # 5 in a row; a shorter run: all of its steps
def test_a_run_that_skips_every_step_stops_naming_the_non_finite_weight(tiny_run_config, tmp_path, steps, stops_at):
    export = tiny_run_config("train.steps=1", "checkpoint.export_hf_at_end=true",
                             f"train.output_dir={tmp_path / 'source'}")
    train.run(export)
    weights = next((tmp_path / "source" / "hf").glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["model.layers.0.post_attention_layernorm.weight"][3] = float("inf")  # the weight holding an Inf
    save_file(tensors, weights, metadata={"format": "pt"})
    cfg = tiny_run_config(f"train.steps={steps}", f"model.init_from={tmp_path / 'source' / 'hf'}",
                          "train.nonfinite=skip", "logging.log_every=1")
    with pytest.raises(FloatingPointError, match=rf"{stops_at} steps in a row skipped \(steps 1 to {stops_at}; "
                                                 rf"train.nonfinite=skip stops at {stops_at}\): parameter "
                                                 r"model.layers.0.post_attention_layernorm.weight holds inf;"):
        train.run(cfg)
    run_dir = Path(cfg.train.output_dir)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["finished"] is False and not (run_dir / "model.safetensors").exists()
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == list(range(1, stops_at + 1)) and all(m["skipped"] for m in logged)


def test_a_non_finite_gradient_is_named_under_nonfinite_stop(tiny_run_config):
    """train.nonfinite=stop reports before the step's gradients are dropped: step 1's huge update leaves the weights
    finite, and step 2's gradients are not."""
    cfg = tiny_run_config("train.steps=2", "optim.lr=1e30", "optim.warmup_steps=0")
    with pytest.raises(FloatingPointError, match=r"non-finite loss=\S+ or grad_norm=nan: gradient of \S+ holds nan"):
        train.run(cfg)
