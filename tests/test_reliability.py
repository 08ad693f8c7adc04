"""A run that is safe to leave alone: crafted and damaged checkpoints are refused (naming the file and the fix),
a resume is exact or refuses, nothing of a run is rewritten before its resume is known good, metrics are strict
JSON, and bad input ends in one readable line. docs/reliability.md lists each case with its test."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import train
from tests.conftest import TINY_MODEL, stopped_run, write_tokens
from training import checkpoint as ckpt
from training.config import OptimConfig
from training.optim import lr_multiplier

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One run of 4 steps with checkpoints at 2 and 4, trained once for this module, as if stopped after step 4."""
    return stopped_run(tmp_path_factory.mktemp("trained"))


@pytest.fixture
def config(trained, tiny_run_config):
    """tiny_run_config on the module run's data (its path is part of what is trained)."""
    return lambda *overrides: tiny_run_config(f"data.path={trained / 'tokens.npy'}", *overrides)


@pytest.fixture
def run_dir(trained, tmp_path) -> Path:
    """A fresh copy of the module's run, in the run directory that ``config`` writes to."""
    shutil.copytree(trained / "run", tmp_path / "run")
    return tmp_path / "run"


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {name: (run_dir / name).read_bytes() for name in ("config.yaml", "metrics.jsonl", "model.safetensors")}


# ------------------------------------------------------------------------------------- crafted metadata
def _text(s: str) -> bytes:
    data = s.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def _call(module: str, name: str, *args: bytes) -> bytes:
    """Pickle ops that call module.name(*args) (STACK_GLOBAL, args tuple, REDUCE)."""
    return _text(module) + _text(name) + b"\x93" + b"(" + b"".join(args) + b"tR"


def _gadgets(marker: Path) -> dict[str, bytes]:
    touch = f"open({str(marker)!r}, 'w')"
    return {
        "dotted os.system": _call("torch.distributed.checkpoint.metadata", "os.system", _text(f"touch {marker}")),
        "builtins.eval": _call("builtins", "eval", _text(touch)),
        "subprocess.Popen": _call("subprocess", "Popen", b"]" + b"(" + _text("touch") + _text(str(marker)) + b"e"),
        # an allowed class's method reached by a dotted name, called on an allowed object
        "reduce through an allowed class": _call("pathlib", "PosixPath.touch", _call("pathlib", "PosixPath",
                                                                                      _text(str(marker)))),
    }


@pytest.mark.parametrize("gadget", ["dotted os.system", "builtins.eval", "subprocess.Popen",
                                    "reduce through an allowed class"])
def test_crafted_metadata_is_refused_and_runs_nothing(config, run_dir, tmp_path, gadget):
    step4 = run_dir / "checkpoints" / "step_00000004"
    marker = tmp_path / "code-ran"
    (step4 / ".metadata").write_bytes(b"\x80\x04" + _gadgets(marker)[gadget] + b".")
    # An attacker rewrites the file record too (it is plain JSON): only the unpickler stands in the way.
    state = json.loads((step4 / ckpt.TRAIN_STATE).read_text())
    state["files"].update(ckpt.record_files([step4 / ".metadata"]))
    (step4 / ckpt.TRAIN_STATE).write_text(json.dumps(state))

    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata is not DCP checkpoint metadata, refusing"):
        train.run(config("train.steps=4", "train.resume=auto"))
    export = subprocess.run([sys.executable, "scripts/export_hf.py", str(step4), str(tmp_path / "hf")], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 1 and "refusing" in export.stderr and "Traceback" not in export.stderr
    assert not marker.exists()


def test_the_allowlist_still_reads_real_metadata(run_dir):
    step4 = run_dir / "checkpoints" / "step_00000004"
    metadata = ckpt._SafeReader(str(step4)).read_metadata()
    assert "model.model.embed_tokens.weight" in metadata.state_dict_metadata


# ------------------------------------------------------------------------------------- resume: exact or refuse
def test_resume_into_another_model_is_refused_by_name(config, run_dir):
    with pytest.raises(ValueError, match=r"model\.arch\.num_hidden_layers: 2 -> 1.*allow_changes"):
        train.run(config("train.steps=4", "train.resume=auto", "model.arch.num_hidden_layers=1"))
    # Even when allowed, the keys must match the model: missing and unexpected are listed by name.
    with pytest.raises(ckpt.CheckpointError, match=r"not in the model \(\d+\): model\.model\.layers\.1\."):
        train.run(config("train.steps=4", "train.resume=auto", "model.arch.num_hidden_layers=1",
                                  "train.allow_changes=[model.arch]"))
    with pytest.raises(ckpt.CheckpointError, match=r"with another shape.*\[8, 32, 32\] in the checkpoint"):
        train.run(config("train.steps=4", "train.resume=auto", "model.arch.moe_intermediate_size=8",
                                  "train.allow_changes=[model.arch]"))
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 4


@pytest.mark.parametrize("change", ["optim.lr=1e-3", "train.steps=8", "data.seq_len=16", "train.seed=1",
                                    "train.local_batch_size=2"])
def test_a_change_of_what_is_trained_needs_allow_changes(config, run_dir, change):
    key = change.split("=")[0].replace("local_batch_size", "global_batch_size")
    with pytest.raises(ValueError, match=rf"would change what is trained: {key}.*allow_changes=\[{key}\]"):
        train.run(config("train.resume=auto", "train.steps=4", change))


def test_a_checkpoint_from_before_a_key_existed_resumes_at_its_default(config, run_dir):
    """A knob added after a checkpoint was written starts at its default, which is what that run did: missing from
    the checkpoint's config, it reads as its default (set to anything else, it is a change like any other)."""
    step2 = run_dir / "checkpoints" / "step_00000002"
    state = json.loads((step2 / ckpt.TRAIN_STATE).read_text())
    for group, key in [("optim", "schedule"), ("optim", "decay_fraction"), ("data", "val_fraction"),
                       ("train", "eval_every"), ("model", "arch")]:
        if group == "model":
            del state["config"]["model"]["arch"]["router_z_loss_coef"]
        else:
            del state["config"][group][key]
    (step2 / ckpt.TRAIN_STATE).write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"model\.arch\.router_z_loss_coef: 0\.0 -> 0\.01.*allow_changes"):
        train.run(config("train.steps=4", f"train.resume={step2}", "train.discard_newer=true",
                         "model.arch.router_z_loss_coef=0.01"))
    resumed = train.run(config("train.steps=4", f"train.resume={step2}", "train.discard_newer=true"))
    assert [m["step"] for m in resumed] == [3, 4]


def test_execution_settings_may_change_and_are_listed(config, run_dir, caplog):
    step2 = run_dir / "checkpoints" / "step_00000002"
    with caplog.at_level("INFO", logger="train"):
        resumed = train.run(config("train.steps=4", f"train.resume={step2}", "train.discard_newer=true",
                                   "train.gc_every=7", "logging.log_every=2"))
    assert [m["step"] for m in resumed] == [3, 4]
    assert "train.gc_every: 0 -> 7" in caplog.text and "logging.log_every: 1 -> 2" in caplog.text


@pytest.mark.parametrize("change", [("optim.lr=1e-3", "optim.lr"), ("train.steps=8", "train.steps")])
def test_a_deliberate_lr_or_steps_change_follows_the_new_schedule_from_the_first_resumed_step(tiny_run_config, change):
    override, key = change
    train.run(tiny_run_config("train.steps=4", "checkpoint.interval=2", "optim.warmup_steps=1"))
    run_dir = Path(tiny_run_config().train.output_dir)
    step2 = run_dir / "checkpoints" / "step_00000002"
    steps = 8 if key == "train.steps" else 4
    lr = 1e-3 if key == "optim.lr" else 3e-3
    resumed = train.run(tiny_run_config(f"train.steps={steps}", "optim.warmup_steps=1", f"train.resume={step2}",
                                        "train.discard_newer=true", override, f"train.allow_changes=[{key}]"))
    assert [m["step"] for m in resumed] == list(range(3, steps + 1))
    for m in resumed:  # lr(step) = new optim.lr x multiplier(updates so far; new total)
        assert m["lr"] == lr * lr_multiplier(m["step"] - 1, OptimConfig(warmup_steps=1, min_lr_ratio=0.1), steps)


# ------------------------------------------------------------------------------------- nothing overwritten
def test_a_failed_resume_rewrites_nothing_of_the_run(config, run_dir):
    before = _snapshot(run_dir)
    with pytest.raises(ValueError):
        train.run(config("train.resume=auto", "train.steps=4", "model.arch.num_hidden_layers=1"))
    with pytest.raises(ckpt.CheckpointError):
        train.run(config("train.resume=auto", "train.steps=4", "model.arch.num_hidden_layers=1",
                                  "train.allow_changes=[model.arch]"))
    assert _snapshot(run_dir) == before


def test_auto_resume_with_no_usable_checkpoint_refuses_and_rewrites_nothing(config, run_dir):
    before = _snapshot(run_dir)
    for step_dir in ckpt.step_dirs(run_dir / "checkpoints"):
        (step_dir / ckpt.TRAIN_STATE).unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"step_00000004 is damaged: it has no train_state.json"):
        train.run(config("train.resume=auto", "train.steps=4"))
    assert _snapshot(run_dir) == before


def test_a_fresh_start_does_not_overwrite_a_previous_run(config, run_dir):
    before = _snapshot(run_dir)
    with pytest.raises(ckpt.CheckpointError, match=r"already holds a run.*train.resume=auto.*train.output_dir"):
        train.run(config("train.steps=4"))
    assert _snapshot(run_dir) == before


def test_a_metrics_line_cut_short_by_a_kill_is_dropped_on_resume(config, run_dir, caplog):
    metrics = run_dir / "metrics.jsonl"
    reference = metrics.read_text().splitlines()
    metrics.write_text("\n".join(reference[:3]) + '\n{"step": 4, "lo')  # killed mid-line after step 3
    with caplog.at_level("WARNING", logger="train"):
        train.run(config("train.steps=4", f"train.resume={run_dir / 'checkpoints' / 'step_00000002'}",
                         "train.discard_newer=true"))
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4] and "dropping an unreadable line" in caplog.text
    assert [m["loss"] for m in lines] == [json.loads(line)["loss"] for line in reference]


def test_a_checkpoint_without_record_or_config_resumes_with_warnings(config, run_dir, caplog):
    """Checkpoints written before records existed still resume (exactly), saying what was not checked."""
    state_file = run_dir / "checkpoints" / "step_00000002" / ckpt.TRAIN_STATE
    state = json.loads(state_file.read_text())
    for key in ("files", "config", "global_batch_size"):
        del state[key]
    state_file.write_text(json.dumps(state))
    reference = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    with caplog.at_level("WARNING", logger="train"):
        resumed = train.run(config("train.steps=4", f"train.resume={state_file.parent}", "train.discard_newer=true"))
    assert [m["loss"] for m in resumed] == reference[2:]
    assert "has no file record" in caplog.text and "records no config" in caplog.text


# ------------------------------------------------------------------------------------- integrity
def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "zeroed":
        path.write_bytes(data[:100] + bytes(64) + data[164:])  # same size
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.unlink()


@pytest.mark.parametrize("how,says", [("zeroed", r"bytes \[0, \d+\) differ from what was written"),
                                      ("truncated", r"has \d+ bytes, \d+ were written"), ("deleted", "is missing")])
def test_a_damaged_newest_checkpoint_names_the_file_and_the_way_back(config, run_dir, how, says):
    reference = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    root = run_dir / "checkpoints"
    step2, step4 = root / "step_00000002", root / "step_00000004"
    _damage(next(step4.glob("*.distcp")), how)
    with pytest.raises(ckpt.CheckpointError) as refused:
        train.run(config("train.resume=auto", "train.steps=4"))
    message = str(refused.value)
    assert f"checkpoint {step4} is damaged: __0_0.distcp" in message and __import__("re").search(says, message)
    assert f"mv {step4} {step4}.damaged" in message and f"train.resume={step2}" in message
    # Following the message resumes from step 2 onto the uninterrupted curve.
    shutil.move(step4, f"{step4}.damaged")
    resumed = train.run(config("train.resume=auto", "train.steps=4"))
    assert [(m["step"], m["loss"]) for m in resumed] == [(m["step"], m["loss"]) for m in reference[2:]]


def test_an_incomplete_train_state_is_named(config, run_dir):
    state_file = run_dir / "checkpoints" / "step_00000004" / ckpt.TRAIN_STATE
    state = json.loads(state_file.read_text())
    del state["scheduler"]
    state_file.write_text(json.dumps(state))
    with pytest.raises(ckpt.CheckpointError, match=r"train_state.json lacks a valid scheduler.last_epoch"):
        train.run(config("train.resume=auto", "train.steps=4"))
    state_file.write_text(state_file.read_text()[:20])
    with pytest.raises(ckpt.CheckpointError, match=r"train_state.json is unreadable"):
        train.run(config("train.resume=auto", "train.steps=4"))


def test_a_damaged_init_from_directory_names_the_file(tiny_run_config, tmp_path):
    cfg = tiny_run_config("train.steps=1", "checkpoint.export_hf_at_end=true")
    train.run(cfg)
    hf = Path(cfg.train.output_dir) / "hf"
    weights = next(hf.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=rf"{weights} is not a readable safetensors file"):
        train.run(tiny_run_config("train.steps=1", f"model.init_from={hf}", f"train.output_dir={tmp_path / 'b'}"))
    (hf / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"{hf / 'config.json'} is not valid JSON"):
        train.run(tiny_run_config("train.steps=1", f"model.init_from={hf}", f"train.output_dir={tmp_path / 'c'}"))


# ------------------------------------------------------------------------------------- metrics
def test_skipped_steps_write_strict_json_and_show_on_the_console(tiny_run_config, giant_lr, caplog):
    cfg = tiny_run_config("train.steps=3", "optim.lr=1e30", "optim.weight_decay=0", "optim.warmup_steps=0",
                          "train.nonfinite=skip")
    with caplog.at_level("INFO", logger="train"):
        train.run(cfg)

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    lines = [json.loads(line, parse_constant=refuse)
             for line in (Path(cfg.train.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped"] for m in lines] == [False, True, True]
    assert lines[2]["grad_norm"] is None and "grad_norm" in lines[2]["nonfinite"]
    assert "nonfinite" not in lines[0] and math.isfinite(lines[0]["grad_norm"])
    assert "step 2 skipped" in caplog.text and "SKIPPED" in caplog.text


# ------------------------------------------------------------------------------------- one readable line
def _cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    data = write_tokens(tmp_path / "tokens.npy", 4096)
    cmd = [sys.executable, "train.py", *TINY_MODEL, "data=tokens", f"data.path={data}", "data.seq_len=32",
           f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path / 'run'}", "logging.tensorboard=false",
           "train.device=cpu", *overrides]  # CPU also on a GPU host: 2 ranks need no 2 GPUs
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("layout,says", [
    (["parallel=ep4"], r"parallel\.ep_size=4 must divide dp=2"),
    (["parallel=ep2", "model.arch.num_experts=3"], r"must divide model\.arch\.num_experts=3"),
    (["launch.nproc_per_node=3", "parallel=cp2", "parallel.cp_size=3", "data.seq_len=36"],
     r"model\.arch\.num_attention_heads=4 must be divisible by parallel\.cp_size=3"),
])
def test_an_impossible_layout_is_one_line_before_torchrun_starts(tmp_path, layout, says):
    out = _cli(tmp_path, "launch.nproc_per_node=2", *layout)  # a later launch.nproc_per_node wins
    assert out.returncode == 1
    assert "launching" not in out.stdout  # refused in the launching process
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and __import__("re").search(says, errors[0]), out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) <= 3, out.stderr


@pytest.mark.torch_apis
def test_an_error_inside_torchrun_children_is_one_line(tmp_path):
    first = _cli(tmp_path, "train.steps=2", "checkpoint.interval=2", "train.local_batch_size=2")
    assert first.returncode == 0, first.stderr[-2000:]
    shard = next((tmp_path / "run" / "checkpoints" / "step_00000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    out = _cli(tmp_path, "train.steps=3", "train.allow_changes=[train.steps]", "train.resume=auto",
               "launch.nproc_per_node=2", "parallel=fsdp2",
               "train.local_batch_size=1")
    assert out.returncode == 1
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "__0_0.distcp has 100 bytes" in errors[0], out.stderr[-3000:]
    assert len(out.stderr.splitlines()) <= 4, out.stderr[-3000:]
