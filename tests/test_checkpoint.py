"""Checkpoints: exact resume (in process, after SIGTERM, after SIGKILL), atomicity, keep-last-N, non-finite
policies, HF export at the end of training. Crafted, damaged and mismatched checkpoints: test_reliability.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train
from tests.conftest import TINY_MODEL, write_tokens
from training import checkpoint as ckpt
from training.run_dir import find_start

REPO = Path(__file__).resolve().parents[1]


def losses(history: list[dict]) -> dict[int, tuple[float, float]]:
    return {m["step"]: (m["loss"], m["grad_norm"]) for m in history}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.torch_apis  # DCP's save and load, exactly
def test_resume_reproduces_the_uninterrupted_run_exactly(tiny_run_config, tmp_path):
    full = train.run(tiny_run_config("train.steps=6", f"train.output_dir={tmp_path / 'a'}"))
    train.run(tiny_run_config("train.steps=6", "checkpoint.interval=3", f"train.output_dir={tmp_path / 'b'}"))
    step3 = tmp_path / "b" / "checkpoints" / "step_00000003"
    resumed = train.run(tiny_run_config("train.steps=6", f"train.resume={step3}", f"train.output_dir={tmp_path / 'c'}"))
    assert [m["step"] for m in resumed] == [4, 5, 6]
    for step in (4, 5, 6):  # bit-for-bit: same weights, optimizer moments, schedule and data position
        assert losses(resumed)[step] == losses(full)[step]


def test_keep_last_n_and_auto_resume_picks_the_newest_complete(tiny_run_config, tmp_path):
    cfg = tiny_run_config("train.steps=5", "checkpoint.interval=1", "checkpoint.keep_last=2")
    train.run(cfg)
    root = Path(cfg.train.output_dir) / "checkpoints"
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000004", "step_00000005"]
    # A crash mid-save leaves a temporary directory: it does not count.
    (root / ".tmp-step_00000006").mkdir()
    assert find_start("auto", False, root, root.parent).checkpoint.name == "step_00000005"
    assert find_start("auto", False, tmp_path / "nothing-here", tmp_path / "empty").checkpoint is None


@pytest.mark.torch_apis  # dcp.save
def test_a_failed_save_leaves_the_previous_checkpoint_usable(tiny_run_config, monkeypatch):
    cfg = tiny_run_config("train.steps=4", "checkpoint.interval=2")
    calls = {"n": 0}
    real_save = ckpt.dcp.save

    def dying_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt.dcp, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        train.run(cfg)
    root = Path(cfg.train.output_dir) / "checkpoints"
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002"]
    monkeypatch.setattr(ckpt.dcp, "save", real_save)
    resumed = train.run(tiny_run_config("train.steps=4", "train.resume=auto"))
    assert [m["step"] for m in resumed] == [3, 4]


def test_resume_from_a_path_that_is_not_a_checkpoint_names_the_key(tiny_run_config):
    cfg = tiny_run_config("train.steps=2", "checkpoint.interval=2")
    train.run(cfg)
    with pytest.raises(FileNotFoundError, match="train.resume"):
        train.run(tiny_run_config("train.steps=2", f"train.resume={Path(cfg.train.output_dir) / 'checkpoints'}"))


@pytest.mark.parametrize("policy", ["stop", "skip"])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])  # torch's AdamW; ours, queued before the read
def test_non_finite_steps_follow_the_policy(tiny_run_config, tmp_path, giant_lr, policy, state_dtype):
    cfg = tiny_run_config("train.steps=4", "optim.lr=1e30", "optim.weight_decay=0", "optim.warmup_steps=0",
                          f"train.nonfinite={policy}", f"optim.state_dtype={state_dtype}", "checkpoint.interval=1",
                          "checkpoint.keep_last=4")
    if policy == "stop":
        with pytest.raises(FloatingPointError, match="non-finite"):
            train.run(cfg)
        return
    history = train.run(cfg)
    assert not history[0]["skipped"]  # step 1 is finite; its giant update breaks everything after it
    assert all(m["skipped"] for m in history[1:])
    # The skipped steps changed nothing: the weights and optimizer state of step 4's checkpoint are step 1's.
    first, last = (_saved_tensors(Path(cfg.train.output_dir) / "checkpoints" / f"step_{s:08d}", tmp_path)
                   for s in (1, 4))
    assert first.keys() == last.keys() and any("exp_avg_sq" in key for key in first)
    for key in first:
        assert torch.equal(first[key], last[key]), key


def _saved_tensors(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds (weights, optimizer state and step counters), by its key path."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.utils._pytree import tree_flatten_with_path, keystr

    dcp_to_torch_save(checkpoint, tmp_path / "flat.pt")
    leaves, _ = tree_flatten_with_path(torch.load(tmp_path / "flat.pt", weights_only=True))
    return {keystr(path): leaf for path, leaf in leaves if isinstance(leaf, torch.Tensor)}
    assert all(json.loads(line)["step"] for line in (Path(cfg.train.output_dir) / "metrics.jsonl").open())


def test_hf_export_at_end_loads_in_transformers_with_the_same_logits(tiny_run_config):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_run_config("train.steps=2", "checkpoint.export_hf_at_end=true")
    train.run(cfg)
    run_dir = Path(cfg.train.output_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf", torch_dtype=torch.float32).eval()
    from models import build_args, get_spec
    from safetensors.torch import load_file
    ours = get_spec("qwen3_moe").model_cls(build_args("qwen3_moe", dict(cfg.model.arch)))
    ours.load_state_dict(load_file(run_dir / "model.safetensors"))
    ids = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.torch_apis  # DCP's reader
def test_export_script_accepts_a_dcp_checkpoint(tiny_run_config, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_run_config("train.steps=2", "checkpoint.interval=2")
    train.run(cfg)
    run_dir = Path(cfg.train.output_dir)
    out = subprocess.run([sys.executable, "scripts/export_hf.py", str(run_dir / "checkpoints" / "step_00000002"),
                          str(tmp_path / "hf")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    from safetensors.torch import load_file
    final = load_file(run_dir / "model.safetensors")  # the checkpoint at the last step = the final weights
    torch.testing.assert_close(hf.model.embed_tokens.weight, final["model.embed_tokens.weight"])


def _train_cli(run_dir: Path, data: Path, *extra: str) -> list[str]:
    return [sys.executable, "train.py", *TINY_MODEL, "data=tokens", f"data.path={data}", "data.seq_len=32",
            f"data.cache_dir={run_dir.parent / 'cache'}", f"train.output_dir={run_dir}", "train.local_batch_size=4",
            "logging.tensorboard=false", "train.steps=60", "checkpoint.interval=5", *extra]


def _wait_for_steps(run_dir: Path, proc: subprocess.Popen, n: int) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"training did not reach step {n} (exit code {proc.poll()})")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, list]:
    """The token file and the losses of the run that no signal interrupts, shared by both signals' tests."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    data = write_tokens(tmp_path / "tokens.npy", 4096)
    reference = subprocess.run(_train_cli(tmp_path / "ref", data), cwd=REPO, capture_output=True, text=True)
    assert reference.returncode == 0, reference.stderr[-2000:]
    return data, losses(read_metrics(tmp_path / "ref"))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_resumes_step_for_step(tmp_path, uninterrupted, sig):
    data, reference_losses = uninterrupted
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(_train_cli(run_dir, data), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _wait_for_steps(run_dir, proc, 12)
    os.kill(proc.pid, sig)
    _, stderr = proc.communicate(timeout=120)
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:  # SIGTERM: the trainer saves a checkpoint at the step it is on and exits cleanly
        assert proc.returncode == 0, stderr[-2000:]
        stopped_at = len(read_metrics(run_dir))
        assert ckpt.complete_checkpoints(run_dir / "checkpoints")[-1].name == f"step_{stopped_at:08d}"
    assert len(read_metrics(run_dir)) < 60

    resumed = subprocess.run(_train_cli(run_dir, data, "train.resume=auto"), cwd=REPO, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr + resumed.stdout
    assert losses(read_metrics(run_dir)) == reference_losses
