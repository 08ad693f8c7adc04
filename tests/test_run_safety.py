"""Nothing of a run is lost (issue 31): one run holds its directory at a time, train.resume=auto continues the run
its record names (or says it is finished, or refuses), an older checkpoint is resumed only when the newer steps are
deliberately discarded, a full disk is one line and leaves the run resumable, Ctrl-C checkpoints, a killed rank is
one line, a resume needs no model.init_from, and bad starts are one line that leaves nothing behind.
docs/reliability.md lists each case with its test."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train
from tests.conftest import TINY_MODEL, compose_config, write_tokens
from tests.dist_utils import run_distributed
from training import checkpoint as ckpt
from training.config import COMPILE_VERDICT, config_warnings
from training.launch import failure_line
from training.loop_controls import StopSignal
from training.run_dir import RECORD_FILE, find_start, lock_run_dir

REPO = Path(__file__).resolve().parents[1]


def _args(tmp_path: Path, *overrides: str) -> list[str]:
    data = tmp_path / "tokens.npy"
    if not data.exists():
        write_tokens(data, 4096)
    return [sys.executable, str(REPO / "train.py"), *TINY_MODEL, "data=tokens", f"data.path={data}",
            "data.seq_len=32", "train.local_batch_size=2", f"data.cache_dir={tmp_path / 'cache'}",
            f"train.output_dir={tmp_path / 'run'}", "logging.tensorboard=false", "train.device=cpu", *overrides]


def _cli(tmp_path: Path, *overrides: str, cwd: Path = REPO, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(_args(tmp_path, *overrides), cwd=cwd, capture_output=True, text=True, timeout=300, **kwargs)


def _one_error(out: subprocess.CompletedProcess) -> str:
    """The process's one ``error:`` line; no traceback."""
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return errors[0]


def _losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name not in ("train.log", "run.lock")}


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen (exit code {proc.poll()})")


def _logged(run_dir: Path, n: int) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and len(metrics.read_text().splitlines()) >= n


def _signalled_after_step_2(tmp_path: Path, signum: int) -> tuple[subprocess.Popen, str, Path]:
    """A long tiny run in tmp_path/run sent ``signum`` once it has logged step 2: the finished process, its
    stderr and the run directory."""
    proc = subprocess.Popen(_args(tmp_path, "train.steps=100000"), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "run"
    _wait_for(lambda: _logged(run_dir, 2), proc, "step 2")
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    return proc, stderr, run_dir


# ------------------------------------------------------------------------------------- 2: one run per directory
def test_a_second_run_into_a_held_directory_is_one_line_naming_the_holder(tmp_path):
    first = subprocess.Popen(_args(tmp_path, "train.steps=100000"), cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    run_dir = tmp_path / "run"
    try:
        _wait_for(lambda: _logged(run_dir, 1), first, "the first run's first step")
        config = (run_dir / "config.yaml").read_bytes()
        second = _cli(tmp_path, "train.steps=1", "optim.lr=1e-4", "train.resume=auto")
        assert second.returncode == 1
        line = _one_error(second)
        assert f"{run_dir} is in use by another run (pid {first.pid} on " in line and "started 20" in line, line
        assert (run_dir / "config.yaml").read_bytes() == config
    finally:
        first.kill()
        first.wait()
    with lock_run_dir(run_dir):  # the OS released the killed holder's lock
        pass


# ------------------------------------------------------------------------------------- 3: the run's own record
def test_auto_resume_of_a_finished_run_says_so_and_a_changed_config_is_refused(tiny_run_config):
    cfg = tiny_run_config("train.steps=2")
    train.run(cfg)  # checkpoint.interval=0: the end still checkpoints the last step (checkpoint.at_end)
    run_dir = Path(cfg.train.output_dir)
    before = _files(run_dir)
    assert [p.name for p in ckpt.complete_checkpoints(run_dir / "checkpoints")] == ["step_00000002"]
    assert json.loads((run_dir / RECORD_FILE).read_text())["finished"] is True
    assert train.run(tiny_run_config("train.steps=2", "train.resume=auto")) == []  # finished: nothing to do
    with pytest.raises(ValueError, match=r"would change what is trained: optim.lr: 0.003 -> 0.001; train.seed: 0 -> 1"):
        train.run(tiny_run_config("train.steps=2", "train.resume=auto", "optim.lr=1e-3", "train.seed=1"))
    assert _files(run_dir) == before


def test_auto_resume_without_a_checkpoint_compares_the_runs_config_yaml(tiny_run_config):
    cfg = tiny_run_config("train.steps=2", "checkpoint.at_end=false")
    train.run(cfg)
    run_dir = Path(cfg.train.output_dir)
    before = _files(run_dir)
    with pytest.raises(ValueError, match=rf"resuming from {run_dir / 'config.yaml'} would change what is trained: "
                                         r"optim.lr: 0.003 -> 0.001"):
        train.run(tiny_run_config("train.steps=2", "train.resume=auto", "optim.lr=1e-3"))
    assert train.run(tiny_run_config("train.steps=2", "train.resume=auto")) == []  # finished
    assert _files(run_dir) == before


def test_a_changed_checkpoint_dir_finds_the_runs_checkpoints_through_its_record(tiny_run_config, tmp_path):
    cfg = tiny_run_config("train.steps=2", "checkpoint.interval=1")
    first = train.run(cfg)
    whole = train.run(tiny_run_config("train.steps=3", f"train.output_dir={tmp_path / 'whole'}"))
    resumed = train.run(tiny_run_config("train.steps=3", "train.resume=auto", "train.allow_changes=[train.steps]",
                                        f"checkpoint.dir={tmp_path / 'elsewhere'}"))
    assert [m["step"] for m in resumed] == [3]  # from the run's checkpoints/step_00000002
    assert [m["loss"] for m in first + resumed] == [m["loss"] for m in whole]
    assert ckpt.complete_checkpoints(tmp_path / "elsewhere")[-1].name == "step_00000003"
    # The record now names both directories: the next resume finds the newest in either.
    assert find_start("auto", False, Path(cfg.train.output_dir) / "checkpoints",
                      Path(cfg.train.output_dir)).checkpoint == tmp_path / "elsewhere" / "step_00000003"


def test_a_moved_runs_config_yaml_does_not_start_a_run_at_the_old_place(tiny_run_config, tmp_path):
    old = tmp_path / "old"
    train.run(tiny_run_config("train.steps=1", f"train.output_dir={old}"))
    moved = tmp_path / "moved"
    old.rename(moved)
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config-path", str(moved), "--config-name",
                          "config", "train.resume=auto"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    line = _one_error(out)
    assert f"is the config of the run in {moved}, but its train.output_dir={old}" in line, line
    assert f"train.output_dir={moved} train.resume=auto" in line
    assert not old.exists()


# ------------------------------------------------------------------------------------- 4: an older checkpoint
def test_resuming_an_older_checkpoint_needs_discard_newer_and_removes_only_the_newer(tiny_run_config):
    cfg = tiny_run_config("train.steps=4", "checkpoint.interval=2")
    whole = train.run(cfg)
    run_dir = Path(cfg.train.output_dir)
    step2, step4 = run_dir / "checkpoints" / "step_00000002", run_dir / "checkpoints" / "step_00000004"
    before = _files(run_dir)
    with pytest.raises(ckpt.CheckpointError, match=rf"train.resume={step2} is step 2 of a run that has trained to "
                                                   r"step 4 .*train.discard_newer=true"):
        train.run(tiny_run_config("train.steps=4", f"train.resume={step2}"))
    # A resume that is refused later (a config change) discards nothing either.
    with pytest.raises(ValueError, match="optim.lr"):
        train.run(tiny_run_config("train.steps=4", f"train.resume={step2}", "train.discard_newer=true",
                                  "optim.lr=1e-3"))
    assert _files(run_dir) == before
    with pytest.raises(ValueError, match="train.discard_newer=true .* train.resume=auto"):
        train.run(tiny_run_config("train.steps=4", "train.resume=auto", "train.discard_newer=true"))
    resumed = train.run(tiny_run_config("train.steps=4", f"train.resume={step2}", "train.discard_newer=true"))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in whole[2:]]  # the same steps again, exactly
    assert sorted(_losses(run_dir)) == [1, 2, 3, 4]
    assert step2.is_dir() and (step4 / ckpt.TRAIN_STATE).is_file()  # step 4 written again by the resumed run


# ------------------------------------------------------------------------------------- 5: a full disk
def _fsize_limit(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so that a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_disk_too_small_for_the_saves_is_said_at_start_up(tiny_run_config, tmp_path, monkeypatch, caplog):
    """The GPU machine's 64 GiB held a 4-layer Qwen3.5 checkpoint (49 GiB) but not the final weights after it: a run
    that cannot write its saves says so before its first step, with what it needs and the fixes."""
    cfg = tiny_run_config("train.steps=2", "optim.state_dtype=bfloat16")
    model = torch.nn.Linear(10, 10)  # 110 fp32 parameters: 440 bytes, bf16 moments 440 more
    assert ckpt.save_sizes(model, torch.bfloat16) == (880, 440)
    out = Path(cfg.train.output_dir)
    # Both under tmp_path, one file system: added up; a folder not made yet is measured at its nearest parent.
    assert ckpt.space_warnings({out / "checkpoints": 1, out: 1}) == []
    free = shutil.disk_usage(tmp_path).free
    (line,) = ckpt.space_warnings({out / "checkpoints": free // 2 + 1, out: free // 2 + 1})
    assert f"GiB free on {tmp_path}" in line and "train.save_final=false" in line

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    with caplog.at_level("WARNING", logger="train"):
        train.run(cfg)
    (warning,) = [r.message for r in caplog.records if "GiB free" in r.message]
    assert "but this run writes" in warning
    caplog.clear()
    monkeypatch.setattr(shutil, "disk_usage", real)
    with caplog.at_level("WARNING", logger="train"):
        train.run(tiny_run_config("train.steps=2", f"train.output_dir={tmp_path / 'roomy'}"))
    assert caplog.records and not [r for r in caplog.records if "GiB free" in r.message]  # the warmup warning only


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_the_previous_stays_usable(tiny_run_config, tmp_path):
    cfg = tiny_run_config("train.steps=2", "checkpoint.interval=2", f"data.path={tmp_path / 'tokens.npy'}",
                          "train.local_batch_size=2", f"data.cache_dir={tmp_path / 'cache'}")
    train.run(cfg)
    run_dir = Path(cfg.train.output_dir)
    step2 = run_dir / "checkpoints" / "step_00000002"
    shard = max(p.stat().st_size for p in step2.iterdir())
    out = _cli(tmp_path, "train.steps=4", "checkpoint.interval=2", "train.resume=auto",
               "train.allow_changes=[train.steps]", preexec_fn=_fsize_limit(shard // 2))
    assert out.returncode == 1
    line = _one_error(out)
    assert (f"no space or file too large while writing checkpoint {run_dir / 'checkpoints' / 'step_00000004'}: "
            "file too large") in line, line
    assert f"the previous checkpoint {step2} is intact" in line
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000002"]  # no partial directory left
    ckpt.verify_files(step2, ckpt.read_train_state(step2)["files"])


def test_final_weights_that_cannot_be_written_leave_a_checkpoint_that_writes_them(tiny_run_config, tmp_path,
                                                                                    monkeypatch):
    reference = tiny_run_config("train.steps=3", f"train.output_dir={tmp_path / 'reference'}")
    train.run(reference)
    real = ckpt.write_safetensors

    def too_large(*args, **kwargs):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(ckpt, "write_safetensors", too_large)
    cfg = tiny_run_config("train.steps=3")
    run_dir = Path(cfg.train.output_dir)
    with pytest.raises(ckpt.CheckpointError, match=rf"no space or file too large while writing "
                                                   rf"{run_dir / 'model.safetensors'}: file too large .*; the trained "
                                                   rf"state is in checkpoint {run_dir / 'checkpoints'}/step_00000003"):
        train.run(cfg)
    assert not (run_dir / "model.safetensors").exists()
    monkeypatch.setattr(ckpt, "write_safetensors", real)
    assert train.run(tiny_run_config("train.steps=3", "train.resume=auto")) == []  # no step: only the weights
    assert (run_dir / "model.safetensors").read_bytes() == (tmp_path / "reference" / "model.safetensors").read_bytes()
    assert json.loads((run_dir / RECORD_FILE).read_text())["finished"] is True


def test_final_weights_past_a_file_size_limit_name_the_file(tmp_path):
    out = _cli(tmp_path, "train.steps=1", "checkpoint.at_end=false", preexec_fn=_fsize_limit(64 << 10))
    assert out.returncode == 1
    line = _one_error(out)
    assert f"no space or file too large while writing {tmp_path / 'run' / 'model.safetensors'}: file too large" in line
    assert "no checkpoint holds the last step (checkpoint.at_end=false)" in line


# ------------------------------------------------------------------------------------- 10: Ctrl-C
def test_ctrl_c_checkpoints_and_exits_130_with_one_line(tmp_path):
    proc, stderr, run_dir = _signalled_after_step_2(tmp_path, signal.SIGINT)
    assert proc.returncode == 130, stderr[-3000:]
    stopped = max(_losses(run_dir))
    saved = ckpt.complete_checkpoints(run_dir / "checkpoints")[-1]
    assert saved.name == f"step_{stopped:08d}"
    assert "Traceback" not in stderr and f"interrupted: Ctrl-C: stopped after saving checkpoint {saved}" in stderr
    assert len([line for line in stderr.splitlines() if line.startswith("interrupted:")]) == 1


def _stop_calls(rank: int, world_size: int) -> list[bool]:
    dims = type("Dims", (), {"world_size": world_size})()
    stop = StopSignal(dims, torch.device("cpu"))
    try:
        answers = []
        for call in range(5):
            if rank == 1 and call == 2:
                stop.signum = signal.SIGTERM  # as its handler would: this rank alone got the signal
            answers.append(stop.requested())
        every_rank = [None] * world_size
        torch.distributed.all_gather_object(every_rank, answers)
        return every_rank
    finally:
        stop.restore()


@pytest.mark.torch_apis
def test_ranks_stop_at_one_step_on_one_ranks_signal():
    """Several ranks: a signal that reaches one rank during step 3 stops every rank after step 4 (the flag is read
    a step late, so the read never waits for the step's update on the device)."""
    assert run_distributed(_stop_calls, 2) == [[False, False, False, True, True]] * 2


def test_a_second_ctrl_c_stops_at_once():
    dims = type("Dims", (), {"world_size": 1})()
    stop = StopSignal(dims, torch.device("cpu"))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested() and stop.name == "SIGINT"
        with pytest.raises(KeyboardInterrupt, match="a second Ctrl-C: stopped at once, without a checkpoint"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here
    finally:
        stop.restore()


# ------------------------------------------------------------------------------------- 11: a rank killed
def _child_with_rank(parent: int, rank: int) -> int | None:
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                if f"RANK={rank}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                    return int(proc.name)
        except (OSError, IndexError, ValueError):
            continue
    return None


@pytest.mark.torch_apis
def test_a_rank_killed_under_torchrun_is_one_line_naming_it_and_the_checkpoint(tmp_path):
    proc = subprocess.Popen(_args(tmp_path, "train.steps=100000", "checkpoint.interval=1", "launch.nproc_per_node=2",
                                  "parallel=ep2", "train.local_batch_size=1"),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "run"
    _wait_for(lambda: len(ckpt.complete_checkpoints(run_dir / "checkpoints")) >= 1, proc, "a checkpoint")
    os.kill(_child_with_rank(proc.pid, 1), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert "rank 1 of the torchrun job was killed by SIGKILL (signal 9)" in errors[0]
    assert f"train.resume=auto continues from the last checkpoint, {run_dir / 'checkpoints'}/step_" in errors[0]
    assert "Traceback" not in stderr and len(stderr.splitlines()) <= 4, stderr[-3000:]


# ------------------------------------------------------------------------------------- 12: init_from gone
def test_a_resume_needs_no_init_from_directory(tiny_run_config, tmp_path):
    source = tiny_run_config("train.steps=1", "checkpoint.export_hf_at_end=true",
                             f"train.output_dir={tmp_path / 'source'}")
    train.run(source)
    hf = tmp_path / "hf"
    shutil.move(tmp_path / "source" / "hf", hf)

    def config(*overrides: str):  # model=hf: the architecture is init_from's config.json
        return compose_config(["model=hf", f"model.init_from={hf}", "data=tokens", f"data.path={source.data.path}",
                               "data.seq_len=32", f"data.cache_dir={tmp_path / 'cache'}", "train.device=cpu",
                               f"train.output_dir={tmp_path / 'run'}", "logging.tensorboard=false", *overrides])

    first = train.run(config("train.steps=2", "checkpoint.interval=2"))
    shutil.rmtree(hf)
    resumed = train.run(config("train.steps=3", "train.resume=auto", "train.allow_changes=[train.steps]"))
    assert [m["step"] for m in first + resumed] == [1, 2, 3]


# ------------------------------------------------------------------------------------- 13: bad starts
@pytest.mark.parametrize("override,says", [
    ("train.device=cuda", "train.device=cuda but no CUDA device is visible"),
    ("train.seed=-1", r"train.seed=-1 must be in [0, 2**32)"),
])
def test_a_bad_start_is_one_line_and_leaves_nothing_that_blocks_a_retry(tmp_path, override, says):
    if override == "train.device=cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    out = _cli(tmp_path, "train.steps=1", override)
    assert out.returncode == 1 and says in _one_error(out), out.stderr[-2000:]
    run_dir = tmp_path / "run"
    assert {p.name for p in run_dir.iterdir()} <= {"train.log", "run.lock"}
    assert find_start("none", False, run_dir / "checkpoints", run_dir).checkpoint is None  # a retry starts


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "run").write_text("mine")
    out = _cli(tmp_path, "train.steps=1", cwd=tmp_path)
    assert out.returncode == 1
    assert f"train.output_dir={tmp_path / 'run'} is a file, not a directory" in _one_error(out)
    assert (tmp_path / "run").read_text() == "mine" and not (tmp_path / "outputs").exists()


def test_warmup_longer_than_the_run_is_named(tiny_run_config, caplog):
    with caplog.at_level("WARNING", logger="train"):
        train.run(tiny_run_config("train.steps=2", "optim.warmup_steps=5"))
    assert "optim.warmup_steps=5 is more than train.steps=2: the lr rises for the whole run" in caplog.text


def test_train_compile_says_what_it_measured() -> None:
    """The start-up warning of train.compile=true quotes the measurement (docs/results.md has the row)."""
    assert config_warnings(compose_config(["train.compile=true"])) == [COMPILE_VERDICT]
    assert config_warnings(compose_config([])) == []
    assert "99,627" in COMPILE_VERDICT and "99,627" in (REPO / "docs" / "results.md").read_text()


def test_a_sweep_with_a_fixed_output_dir_puts_each_job_under_it(tmp_path):
    command = _args(tmp_path, "train.seed=0,1", "train.steps=1")  # train.output_dir=<tmp>/run
    out = subprocess.run([*command[:2], "-m", *command[2:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()
    for job in (0, 1):
        run_dir = tmp_path / "run" / str(job)
        assert sorted(_losses(run_dir)) == [1]
        assert f"output_dir: {run_dir}\n" in (run_dir / "config.yaml").read_text()
        assert f"seed: {job}\n" in (run_dir / "config.yaml").read_text()


def _failure(exitcode: int, timestamp: int, message: str = ""):
    """A stand-in for torchrun's ProcessFailure: what failure_line reads (``message``: what the rank wrote to its
    error file; none written: torchrun's made-up message and an empty error_file_data)."""
    made_up = f"Signal {-exitcode} received by PID 1" if exitcode < 0 else "To enable traceback see: ..."
    data = {"message": message, "timestamp": timestamp} if message else {"message": "<NONE>"}
    return type("Failure", (), {"exitcode": exitcode, "timestamp": timestamp, "message": message or made_up,
                                "error_file_data": data})()


def test_the_failed_rank_is_told_apart_from_the_ranks_torchrun_stopped(tmp_path):
    # rank 1 raised; torchrun then stopped rank 0 with SIGTERM, which can land first (a race seen under load)
    raised = {0: _failure(-signal.SIGTERM, 1), 1: _failure(1, 2, "ValueError: the checkpoint is damaged")}
    assert failure_line(raised, tmp_path) == ("rank 1 of the torchrun job failed (exit code 1): ValueError: the "
                                              "checkpoint is damaged")
    # ... or aborted on its way out when torchrun stopped it (seen under load in CI)
    aborted = {0: _failure(1, 2, "ValueError: the checkpoint is damaged"), 1: _failure(-signal.SIGABRT, 2)}
    assert failure_line(aborted, tmp_path).startswith("rank 0 of the torchrun job failed (exit code 1): ValueError")
    # rank 1 killed; rank 0 raised on the lost peer (its error file written before torchrun saw the kill)
    killed = {0: _failure(1, 1, "lost a peer rank (its process ended): RuntimeError: Connection reset by peer"),
              1: _failure(-signal.SIGKILL, 2)}
    assert failure_line(killed, tmp_path).startswith("rank 1 of the torchrun job was killed by SIGKILL (signal 9)")
    # ... and then aborted on its way out, in the same second as torchrun saw the kill (seen in the full suite)
    lost_then_aborted = {0: _failure(-signal.SIGABRT, 2, "lost a peer rank (its process ended): RuntimeError: ..."),
                         1: _failure(-signal.SIGKILL, 2)}
    assert failure_line(lost_then_aborted, tmp_path).startswith(
        "rank 1 of the torchrun job was killed by SIGKILL (signal 9)")
    # both raised; rank 1 aborted before it wrote its error, and torchrun stopped rank 0 after it wrote its own
    both = {0: _failure(-signal.SIGTERM, 2, "CheckpointError: the checkpoint is damaged"),
            1: _failure(-signal.SIGABRT, 1)}
    assert failure_line(both, tmp_path) == ("rank 0 of the torchrun job failed: CheckpointError: the checkpoint is "
                                            "damaged")
    # a rank whose Python traceback is on stderr wrote no one-line error
    crashed = {0: _failure(1, 1), 1: _failure(-signal.SIGTERM, 2)}
    assert failure_line(crashed, tmp_path) == "rank 0 of the torchrun job failed (exit code 1): its traceback is above"
    stopped = {0: _failure(-signal.SIGTERM, 2), 1: _failure(-signal.SIGTERM, 1)}  # the job itself was stopped
    assert failure_line(stopped, tmp_path).startswith("rank 1 of the torchrun job was killed by SIGTERM (signal 15)")
