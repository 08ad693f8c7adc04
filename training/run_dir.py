"""The run directory: one run at a time holds it (a lock), it keeps its own record (``run.json``: where its
checkpoints are, how far it got, whether it finished), and a start in it continues that run or refuses.

- ``lock_run_dir``: an exclusive ``fcntl.flock`` on ``<run_dir>/run.lock``, taken before the run's first write
  and held to its exit (the OS releases it when the process dies, however it dies). The holder's pid, host and
  start time are written into the file, so a second run names it.
- ``find_start``: what ``train.resume`` continues, decided from the checkpoints (under checkpoint.dir and every
  directory the record names) and the record, before anything is rewritten:
  ``none`` refuses a directory that holds a run; ``auto`` takes the newest checkpoint, or (none written) the
  run's config.yaml to compare against, or a fresh start in an empty directory; a path to an older checkpoint
  of this run refuses unless ``train.discard_newer=true``.
- ``check_not_moved``: a run's config.yaml used as the primary config of a run that would write elsewhere (the
  run was moved or copied; its absolute train.output_dir still names the old place) is refused.

A run that failed before its first step leaves no record, no checkpoint and no metric line: it does not count as
a run, so the retry starts.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from omegaconf import OmegaConf

from core.files import atomic_write_text
from training.checkpoint import TRAIN_STATE, CheckpointError, damaged_message, read_train_state, step_dirs, step_of
from training.metrics import METRICS_FILE, read_step_lines

logger = logging.getLogger("train")

LOCK_FILE = "run.lock"
RECORD_FILE = "run.json"
CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"
HF_DIR = "hf"


# ------------------------------------------------------------------------------------------ the lock
def lock_run_dir(run_dir: Path) -> IO[str]:
    """Hold ``run_dir`` for this process (the returned file; closing it, or dying, releases it); CheckpointError
    naming the holder if another process holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that has not written its name yet"
        handle.close()
        raise CheckpointError(f"{run_dir} is in use by another run ({holder}); wait for it to end, or give this "
                              "run another train.output_dir") from None
    handle.seek(0)
    handle.truncate()
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
    handle.flush()
    return handle


# ------------------------------------------------------------------------------------------ the record
@dataclass
class RunRecord:
    """<run_dir>/run.json. Checkpoint directories inside the run directory are kept relative to it, so a moved
    run finds its own (and a copied one never its original's)."""
    run_dir: str
    checkpoint_dirs: list[str] = field(default_factory=list)
    step: int = 0  # the last step trained (as of the last checkpoint, or the end)
    checkpoint: str | None = None  # the newest checkpoint written
    finished: bool = False  # every step of train.steps trained and the final weights written
    simulated: str | None = None  # "rank r of N": a loopback simulation's (launch.simulate_world), no weights

    def roots(self, run_dir: Path) -> list[Path]:
        return [run_dir / d for d in self.checkpoint_dirs]


def read_record(run_dir: Path) -> RunRecord | None:
    path = run_dir / RECORD_FILE
    if not path.is_file():
        return None
    try:
        return RunRecord(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path} is not a run record ({e}); move it aside if it is not this run's") from None


def write_record(run_dir: Path, record: RunRecord) -> None:
    atomic_write_text(run_dir / RECORD_FILE, json.dumps(record.__dict__, indent=1) + "\n")


def new_record(run_dir: Path, ckpt_root: Path, previous: RunRecord | None, step: int) -> RunRecord:
    """The record of a run starting (or continuing) at ``step`` with its checkpoints under ``ckpt_root``."""
    root = os.path.relpath(ckpt_root.resolve(), run_dir.resolve())
    root = str(ckpt_root.resolve()) if root.startswith("..") else root
    dirs = previous.checkpoint_dirs if previous else []
    return RunRecord(run_dir=str(run_dir.resolve()), checkpoint_dirs=[*(d for d in dirs if d != root), root],
                     step=step, checkpoint=previous.checkpoint if previous else None)


# ------------------------------------------------------------------------------------------ what a start continues
@dataclass
class Start:
    """What a start in the run directory continues (all empty: a fresh run)."""
    checkpoint: Path | None = None
    state: dict[str, Any] | None = None  # the checkpoint's train state
    previous_config: dict[str, Any] | None = None  # no checkpoint, but a run was here: its config.yaml
    record: RunRecord | None = None
    discard: list[Path] = field(default_factory=list)  # train.discard_newer: removed once the resume is good

    @property
    def resumed_config(self) -> dict[str, Any] | None:
        """The resumed checkpoint's config (None: none resumed, or written before configs were recorded)."""
        return self.state.get("config") if self.state is not None else None


def _logged_steps(run_dir: Path) -> int:
    """The last step in metrics.jsonl (0: none; a line cut short by a kill is left to MetricLogger to drop)."""
    path = run_dir / METRICS_FILE
    return max((step for step, _ in read_step_lines(path)[0]), default=0) if path.is_file() else 0


def read_run_config(run_dir: Path) -> dict[str, Any] | None:
    """The resolved config of config.yaml (the Hydra sections dropped), or None."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return None
    tree = OmegaConf.to_container(OmegaConf.load(path))
    return {k: v for k, v in tree.items() if k not in ("defaults", "hydra")}


def find_start(resume: str, discard_newer: bool, ckpt_root: Path, run_dir: Path) -> Start:
    """Read-only: what ``train.resume`` continues in ``run_dir`` (see the module docstring); refuses
    (CheckpointError) rather than guess."""
    record = read_record(run_dir)
    roots = list(dict.fromkeys([ckpt_root, *(record.roots(run_dir) if record else [])]))
    found = sorted((d for root in roots for d in step_dirs(root)), key=step_of)
    logged = _logged_steps(run_dir)
    # What counts as a run: a start that failed before its first step (a record at step 0, an empty
    # metrics.jsonl, a config.yaml) does not, so its retry starts.
    trained = record is not None and (record.step > 0 or record.finished)
    previous = [str(p) for p in (*([run_dir / RECORD_FILE] if trained else []), *found)]
    previous += [str(run_dir / METRICS_FILE)] if logged else []
    if resume == "none":
        if previous:
            raise CheckpointError(f"{run_dir} already holds a run ({', '.join(previous[:3])}); continue it with "
                                  "train.resume=auto, or start afresh in another train.output_dir")
        return Start()
    if resume == "auto":
        if found:
            newest = found[-1]
            if not (newest / TRAIN_STATE).is_file():
                raise CheckpointError(damaged_message(newest, f"it has no {TRAIN_STATE}"))
            if newest.parent.resolve() != ckpt_root.resolve():
                logger.info("train.resume=auto: the run's newest checkpoint is %s (under a checkpoint directory "
                            "its record names, not checkpoint.dir=%s)", newest, ckpt_root)
            return Start(checkpoint=newest, state=read_train_state(newest), record=record)
        if not previous:
            logger.info("train.resume=auto: no checkpoint under %s, starting from step 1", ckpt_root)
            return Start()
        config = read_run_config(run_dir)
        if config is None:
            raise CheckpointError(f"{run_dir} holds a run ({', '.join(previous[:3])}) without its config.yaml and "
                                  "without a checkpoint to continue; start afresh in another train.output_dir")
        return Start(previous_config=config, record=record)
    path = Path(resume)
    if not (path / TRAIN_STATE).is_file():
        raise FileNotFoundError(f"train.resume={resume}: not a complete checkpoint (no {TRAIN_STATE} in it)")
    state = read_train_state(path)
    return Start(checkpoint=path, state=state, record=record,
                 discard=_newer_than(path, state["step"], roots, found, logged, run_dir, record, discard_newer))


def _newer_than(path: Path, step: int, roots: list[Path], found: list[Path], logged: int, run_dir: Path,
                record: RunRecord | None, discard_newer: bool) -> list[Path]:
    """What this run trained after ``path`` (one of its checkpoints at ``step``): refused unless discard_newer."""
    if path.resolve().parent not in {r.resolve() for r in roots}:
        return []  # another run's checkpoint: this run directory starts from it
    newer = [d for d in found if step_of(d) > step]
    later_weights = [run_dir / n for n in (WEIGHTS_FILE, HF_DIR) if (run_dir / n).exists()
                     and (record is None or record.step > step)]
    trained_to = max([logged, record.step if record else 0, *(step_of(d) for d in newer)])
    if trained_to <= step:
        return []
    if not discard_newer:
        what = ", ".join(str(p) for p in (newer + later_weights)[:3]) or f"{run_dir / METRICS_FILE}"
        raise CheckpointError(f"train.resume={path} is step {step} of a run that has trained to step {trained_to} "
                              f"({what}); resuming there would overwrite the newer steps. Resume the newest with "
                              "train.resume=auto, or discard the newer steps with train.discard_newer=true")
    return newer + later_weights


def check_not_moved(config_dir: Path, output_dir: str | None) -> None:
    """A run's own config.yaml as the primary config (``--config-path <run dir> --config-name config``) whose
    train.output_dir, not given on the command line (None: it was), names another directory: the run was moved
    or copied, and the re-run would write a run at the old place."""
    if output_dir is None or not (config_dir / CONFIG_FILE).is_file() or not (
            (config_dir / RECORD_FILE).is_file() or (config_dir / METRICS_FILE).is_file()):
        return
    if Path(output_dir).resolve() != config_dir.resolve():
        raise ValueError(f"{config_dir / CONFIG_FILE} is the config of the run in {config_dir}, but its "
                         f"train.output_dir={output_dir} is another directory (the run was moved or copied): "
                         f"continue it in place with train.output_dir={config_dir} train.resume=auto, or start a "
                         "new run with train.output_dir=<new dir>")

