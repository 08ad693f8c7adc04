"""What a run reads must agree with what it records (issue 53, items 5-8): a checkpoint whose folder name, train
state, files and schedule disagree is refused before anything is written; a run that skips every step stops naming
the first non-finite tensor; pretokenized shards are never mixed with foreign or stale ones; and a token shard
changed under a running job stops it before another step or checkpoint reads it. docs/reliability.md lists each
case with its test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import train
from tests.conftest import TINY_MODEL, compose_config, write_tokens
from training import checkpoint as ckpt


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One run of 4 steps with checkpoints at 2 and 4, trained once for this module, as if stopped after its last
    checkpoint (so that a resume loads step 4)."""
    base = tmp_path_factory.mktemp("trained")
    write_tokens(base / "tokens.npy", 4096)
    train.run(compose_config([*TINY_MODEL, "data=tokens", f"data.path={base / 'tokens.npy'}", "data.seq_len=32",
                              f"data.cache_dir={base / 'cache'}", f"train.output_dir={base / 'run'}",
                              "train.local_batch_size=4", "logging.tensorboard=false", "train.steps=4",
                              "checkpoint.interval=2", "train.device=cpu"]))
    record = json.loads((base / "run" / "run.json").read_text())
    (base / "run" / "run.json").write_text(json.dumps({**record, "finished": False}))
    return base


@pytest.fixture
def config(trained, tiny_run_config):
    return lambda *overrides: tiny_run_config(f"data.path={trained / 'tokens.npy'}", "train.steps=4", *overrides)


@pytest.fixture
def run_dir(trained, tmp_path) -> Path:
    """A fresh copy of the module's run, in the run directory that ``config`` writes to."""
    shutil.copytree(trained / "run", tmp_path / "run")
    return tmp_path / "run"


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name not in ("train.log", "run.lock")}


def _edit_state(checkpoint: Path, edit) -> None:
    state = json.loads((checkpoint / ckpt.TRAIN_STATE).read_text())
    edit(state)
    (checkpoint / ckpt.TRAIN_STATE).write_text(json.dumps(state))


# ------------------------------------------------------------------------------------- 5. a record that disagrees
def test_a_renamed_checkpoint_folder_is_refused_naming_the_way_back(config, run_dir):
    root = run_dir / "checkpoints"
    step2, step4, step9 = (root / f"step_{s:08d}" for s in (2, 4, 9))
    step4.rename(step9)  # before: resumed as step 9 at step 4, on every resume=auto, newer checkpoints pruned
    before = _files(run_dir)
    with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint {step9} disagrees with itself: its folder name says "
                                                   r"step 9, its train_state.json step 4, its files were written as "
                                                   rf"step_00000004: .*rename it back \(mv {step9} {step4}\)"):
        train.run(config("train.resume=auto"))
    assert _files(run_dir) == before
    step9.rename(step4)  # the fix: the run continues from step 4
    assert [m["step"] for m in train.run(config("train.resume=auto", "train.steps=6",
                                                "train.allow_changes=[train.steps]"))] == [5, 6]
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002", "step_00000004", "step_00000006"]
    assert step2.is_dir()


@pytest.mark.parametrize("edit,says", [
    (lambda s: s.update(step=9), r"its folder name says step 4, its train_state.json step 9, its files were written "
                                 r"as step_00000004"),
    (lambda s: s["scheduler"].update(last_epoch=-3), r"train_state.json records -3 optimizer updates "
                                                     r"\(scheduler.last_epoch\) by step 4"),
    (lambda s: s["scheduler"].update(last_epoch=7), r"records 7 optimizer updates"),
    (lambda s: s["loader"].update(epoch=-1), r"records the data loader at epoch -1"),
], ids=["step", "negative scheduler epoch", "more updates than steps", "negative loader epoch"])
def test_an_edited_train_state_is_refused_before_anything_is_written(config, run_dir, edit, says):
    step4 = run_dir / "checkpoints" / "step_00000004"
    _edit_state(step4, edit)
    before = _files(run_dir)
    with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint {step4} (is damaged|disagrees with itself): .*{says}"):
        train.run(config("train.resume=auto"))
    assert _files(run_dir) == before


def test_a_renamed_and_edited_checkpoint_is_told_by_its_files(config, run_dir):
    root = run_dir / "checkpoints"
    step9 = root / "step_00000009"
    (root / "step_00000004").rename(step9)
    _edit_state(step9, lambda s: s.update(step=9))  # the folder and the state agree; DCP's files were step 4's
    with pytest.raises(ckpt.CheckpointError, match=r"its folder name says step 9, its train_state.json step 9, its "
                                                   r"files were written as step_00000004"):
        train.run(config("train.resume=auto"))


def test_a_loader_position_past_the_data_is_refused(config, run_dir):
    step4 = run_dir / "checkpoints" / "step_00000004"
    _edit_state(step4, lambda s: s["loader"].update(position=10**6))  # before: taken, the order silently restarted
    before = _files(run_dir)
    with pytest.raises(ValueError, match=rf"checkpoint {step4} records the data loader past the data it was saved "
                                         r"with \('tokens' at position 1000000 of \d+ windows\)"):
        train.run(config("train.resume=auto"))
    assert _files(run_dir) == before


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

