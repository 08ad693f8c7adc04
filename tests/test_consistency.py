"""What a run reads must agree with what it records (issue 53, items 5-8): a checkpoint whose folder name, train
state, files and schedule disagree is refused before anything is written; a run that skips every step stops naming
the first non-finite tensor; pretokenized shards are never mixed with foreign or stale ones; and a token shard
changed under a running job stops it before another step or checkpoint reads it. docs/reliability.md lists each
case with its test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import train
from tests.conftest import TINY_MODEL, stopped_run, write_chats, write_tokens
from training import checkpoint as ckpt
from training.data.config import DataConfig
from training.data.loader import PackedLoader, build_data_loader
from training.data.token_shards import load_token_stream
from training.data.tokenize_shards import MANIFEST, tokenize_to_shards
from training.optim import first_nonfinite

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One run of 4 steps with checkpoints at 2 and 4, trained once for this module, as if stopped after step 4."""
    return stopped_run(tmp_path_factory.mktemp("trained"))


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
def test_a_run_that_skips_every_step_stops_naming_the_non_finite_weight(tiny_run_config, tmp_path):
    train.run(tiny_run_config("train.steps=1", "checkpoint.export_hf_at_end=true",
                              f"train.output_dir={tmp_path / 'source'}"))
    weights = next((tmp_path / "source" / "hf").glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["model.layers.0.post_attention_layernorm.weight"][3] = float("inf")  # the weight holding an Inf
    save_file(tensors, weights, metadata={"format": "pt"})
    for steps, stops_at in [(8, 5), (3, 3)]:  # 5 in a row; a shorter run: all of its steps
        cfg = tiny_run_config(f"train.steps={steps}", f"model.init_from={tmp_path / 'source' / 'hf'}",
                              "train.nonfinite=skip", "logging.log_every=1", f"train.output_dir={tmp_path}/{steps}")
        with pytest.raises(FloatingPointError, match=rf"{stops_at} steps in a row skipped \(steps 1 to {stops_at}; "
                                                     rf"train.nonfinite=skip stops at {stops_at}\): parameter "
                                                     r"model.layers.0.post_attention_layernorm.weight holds inf;"):
            train.run(cfg)  # before: every step skipped, exit 0, run.json finished
        run_dir = Path(cfg.train.output_dir)
        record = json.loads((run_dir / "run.json").read_text())
        assert record["finished"] is False and not (run_dir / "model.safetensors").exists()
        logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in logged] == list(range(1, stops_at + 1)) and all(m["skipped"] for m in logged)


def test_the_first_non_finite_tensor_is_named_weights_first_then_optimizer_state_then_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert first_nonfinite(model, optimizer) is None
    model[1].bias.grad[0] = float("nan")
    assert first_nonfinite(model, optimizer) == "gradient of 1.bias holds nan"
    optimizer.state[model[1].weight]["exp_avg_sq"][0, 0] = float("inf")
    assert first_nonfinite(model, optimizer) == "optimizer state exp_avg_sq of 1.weight holds inf (and 1 more)"
    with torch.no_grad():
        model[1].bias[:] = torch.tensor([float("nan"), float("inf")])
    assert first_nonfinite(model, optimizer) == "parameter 1.bias holds nan and inf (and 2 more)"


def test_a_non_finite_gradient_is_named_under_nonfinite_stop(tiny_run_config, giant_lr):
    """train.nonfinite=stop reports before the step's gradients are dropped: step 1's huge update leaves the weights
    finite, and step 2's gradients are not."""
    cfg = tiny_run_config("train.steps=2", "optim.lr=1e30", "optim.weight_decay=0", "optim.warmup_steps=0")
    with pytest.raises(FloatingPointError, match=r"non-finite loss=\S+ or grad_norm=nan: gradient of \S+ holds nan"):
        train.run(cfg)


# ------------------------------------------------------------------------------------- 7. foreign or stale shards
def _tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_pretokenize_never_overwrites_a_shard_it_did_not_write(tmp_path):
    source, out = write_chats(tmp_path / "chats.jsonl", 40), tmp_path / "out"
    out.mkdir()
    np.save(out / "shard_00000.npy", np.arange(10))  # the user's (before: overwritten)
    before = _tree(out)
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "pretokenize.py"), str(source), str(out),
                           "--workers", "1", "--docs-per-shard", "10"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"error: ValueError: {out} holds shard_00000.npy, which scripts/pretokenize.py did "
                                  "not write (no manifest.json records them): ")
    assert _tree(out) == before  # nothing written, not even a manifest


def test_pretokenize_into_an_old_folder_without_its_manifest_is_refused(tmp_path):
    source, out = write_chats(tmp_path / "chats.jsonl", 60), tmp_path / "out"
    tokenize_to_shards(source, out, "qwen3", docs_per_shard=10)  # an old run: 6 shards
    (out / MANIFEST).unlink()
    before = _tree(out)
    with pytest.raises(ValueError, match=rf"{out} holds shard_00000.npy, shard_00001.npy, shard_00002.npy and 3 "
                                         r"more, which scripts/pretokenize.py did not write"):
        tokenize_to_shards(write_chats(tmp_path / "new.jsonl", 20, seed=1), out, "qwen3", docs_per_shard=10)
    assert _tree(out) == before


def test_the_trainer_reads_exactly_the_shards_the_manifest_lists(tmp_path):
    source, out = write_chats(tmp_path / "chats.jsonl", 40), tmp_path / "out"
    tokenize_to_shards(source, out, "qwen3", docs_per_shard=10)
    cfg = DataConfig(name="tokens", path=str(out), seq_len=8, cache_dir=str(tmp_path / "cache"))
    load = lambda: build_data_loader(cfg, seed=0, local_batch_size=2, dp_rank=0, dp_size=1)  # noqa: E731
    assert load().num_windows == sum(s["tokens"] for s in json.loads((out / MANIFEST).read_text())["shards"]) // 9
    shutil.copy(out / "shard_00000.npy", out / "shard_00007.npy")  # a stale shard (before: read with the others)
    with pytest.raises(ValueError, match=rf"data.path: {out} and its manifest.json disagree: {out / 'shard_00007.npy'} "
                                         r"not in it \(stale or foreign shards\)"):
        load()
    (out / "shard_00007.npy").unlink()
    (out / "shard_00002.npy").unlink()  # before: trained on the other three
    with pytest.raises(ValueError, match=rf"{out / 'shard_00002.npy'} listed but missing: .*run "
                                         r"scripts/pretokenize.py again"):
        load()
    tokenize_to_shards(source, out, "qwen3", docs_per_shard=10)  # the fix the line gives
    assert load().num_windows > 0


# ------------------------------------------------------------------------------------- 8. data changed under the run
def test_a_shard_rewritten_under_the_run_stops_it_by_the_next_logged_step(tiny_run_config, tmp_path, monkeypatch):
    shard = write_tokens(tmp_path / "shard.npy", 4096)
    original = tmp_path / "original.npy"
    shutil.copy(shard, original)
    reads = []

    def next_then_rewrite(self):
        batch = real_next(self)
        reads.append(1)
        if len(reads) == 3:  # after step 3's batch: the same size and inode, other ids (before: trained on)
            np.save(shard, np.load(shard)[::-1].copy())
        return batch

    real_next = PackedLoader.__next__
    monkeypatch.setattr(PackedLoader, "__next__", next_then_rewrite)
    cfg = tiny_run_config("train.steps=6", f"data.path={shard}", "checkpoint.interval=1", "checkpoint.keep_last=6")
    with pytest.raises(ValueError, match=rf"data.path: token shard {shard} changed under the running job \(rewritten: "
                                         r"modified since the run opened it\); the run stops here"):
        train.run(cfg)
    run_dir = Path(cfg.train.output_dir)
    saved = ckpt.complete_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in saved] == ["step_00000001", "step_00000002"]  # none after the change
    read = load_token_stream(str(original), "uint16", str(tmp_path / "cache")).identity
    assert all(json.loads((p / ckpt.TRAIN_STATE).read_text())["loader"]["data"] == {"shard": read} for p in saved)
    assert json.loads((run_dir / "run.json").read_text())["finished"] is False


def test_a_shard_truncated_under_the_run_is_one_line_not_a_bus_error(tmp_path):
    shard = write_tokens(tmp_path / "tokens.npy", 1 << 16)
    run = subprocess.Popen([sys.executable, str(REPO / "train.py"), *TINY_MODEL, "data=tokens", f"data.path={shard}",
                            "data.seq_len=32", "train.local_batch_size=2", f"data.cache_dir={tmp_path / 'cache'}",
                            f"train.output_dir={tmp_path / 'run'}", "logging.tensorboard=false", "train.device=cpu",
                            "train.steps=100000", "logging.log_every=1"],
                           cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        for _ in range(1200):
            if run.poll() is not None or (metrics.exists() and metrics.read_text().count("\n") >= 2):
                break
            time.sleep(0.05)
        size = shard.stat().st_size
        os.truncate(shard, 4096)  # in place, under the memory map (before: SIGBUS, exit 135, no line)
        stderr = run.communicate(timeout=120)[1]
    finally:
        run.kill()
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert errors == [f"error: ValueError: data.path: token shard {shard} changed under the running job ({size} -> "
                      "4096 bytes); the run stops here, and its checkpoints hold what it read before: restore the "
                      "file and continue with train.resume=auto, or train on the new contents with "
                      "train.resume=auto train.allow_changes=[data]"]
