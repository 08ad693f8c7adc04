"""The run directory: one run at a time holds it (a lock), it keeps its own record (``run.json``: where its
checkpoints are, how far it got, whether it finished), and a start in it continues that run or refuses.

- ``lock_run_dir``: an exclusive ``fcntl.flock`` on ``<run_dir>/run.lock``, taken before the run's first write
  and held to its exit (the OS releases it when the process dies, however it dies). The holder's pid, host and
  start time are written into the file, so a second run names it. ``lock_checkpoint_dir`` holds a checkpoint.dir
  outside the run directory the same way, its line also naming the run, which stays there as the directory's owner.
- ``check_apart``: an output directory that is, holds or lies inside an input (model.init_from, data) is refused.
- ``check_run_dir``, ``check_checkpoint_dir``: a run directory is new, empty (but for what Hydra writes before
  train.py runs) or a run of this trainer; a checkpoint.dir new, empty or one of this trainer's. Anything else (``/``,
  a home directory, a user's folder with a config.yaml of its own) is refused before anything is written.
- ``find_start``: what ``train.resume`` continues (after ``check_run_dir``), decided from the checkpoints (under
  checkpoint.dir and every directory the record names that is the run's own: ``own_roots``) and the record, before
  anything is rewritten:
  ``none`` refuses a directory that holds a run; ``auto`` takes the newest checkpoint, or (none written) the
  run's config.yaml to compare against, or a fresh start in an empty directory; a path to an older checkpoint
  of this run refuses unless ``train.discard_newer=true``; another run's checkpoint refuses a directory that holds
  a run, or that overlaps it; a checkpoint.dir that holds another run's checkpoints refuses. Nothing the record
  names outside the run directory is read or deleted unless it is checkpoint.dir or its lock names this run; a
  checkpoint folder that is a symbolic link (to another run's) is never read or pruned.
- ``check_not_moved``: a run's config.yaml used as the primary config of a run that would write elsewhere (the
  run was moved or copied; its absolute train.output_dir still names the old place) is refused.

A run that failed before its first step leaves no record, no checkpoint and no metric line: it does not count as
a run, so the retry starts.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from omegaconf import OmegaConf

from core.files import LockHeld, atomic_write_text, hold_lock_file, remove, stale_temporaries
from training.checkpoint import (TRAIN_STATE, CheckpointError, damaged_message, linked_step_dirs, read_train_state,
                                 step_dirs, step_of, weights_record)
from training.metrics import METRICS_FILE, read_step_lines

logger = logging.getLogger("train")

LOCK_FILE = "run.lock"
RECORD_FILE = "run.json"
CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"
HF_DIR = "hf"
# The first line of every config.yaml a run writes (training.startup.rerunnable_config): how a run directory of this
# trainer is told from a folder that holds a config.yaml of its own.
CONFIG_HEADER = "# Re-run: python train.py"


# ------------------------------------------------------------------------------------------ the lock
def lock_run_dir(run_dir: Path) -> IO[str]:
    """Hold ``run_dir`` for this process (the returned file; closing it, or dying, releases it); CheckpointError
    naming the holder if another process holds it."""
    return _hold(run_dir, str(run_dir), "train.output_dir", "")


def lock_checkpoint_dir(ckpt_root: Path, run_dir: Path) -> IO[str]:
    """Hold a checkpoint.dir outside the run directory as the run directory is held, the holder's line also
    naming its run directory: it stays in the file, the directory's owner, which ``find_start`` names to a later
    run (``_check_checkpoint_dir``)."""
    return _hold(ckpt_root, f"checkpoint.dir={ckpt_root}", "checkpoint.dir", f"; run {run_dir.resolve()}")


def _hold(directory: Path, what: str, key: str, owner: str) -> IO[str]:
    directory.mkdir(parents=True, exist_ok=True)
    try:
        return hold_lock_file(directory / LOCK_FILE, owner)
    except LockHeld as e:
        raise CheckpointError(f"{what} is in use by another run ({e.holder}); wait for it to end, or give this "
                              f"run another {key}") from None


def outside(path: Path, directory: Path) -> bool:
    """Whether ``path`` is neither ``directory`` nor inside it (symlinks and ``..`` resolved)."""
    path, directory = path.resolve(), directory.resolve()
    return path != directory and directory not in path.parents


def check_apart(outputs: dict[str, Path], inputs: list[tuple[str, Path]]) -> None:
    """Refuse an output directory (key -> path) that is an input, or inside or around one (symlinks, ``..`` and
    trailing slashes resolved): the run would write over its own source."""
    for out_key, out in outputs.items():
        for in_key, path in inputs:
            if not (outside(out, path) and outside(path, out)):
                where = ("is" if out.resolve() == path.resolve() else "is inside" if outside(path, out) else
                         "contains")
                raise ValueError(f"{out_key}={out} {where} {in_key}={path} ({path.resolve()}): the run would write "
                                 f"over what it reads; choose a {out_key} apart from its inputs")


# ------------------------------------------------------------------------------------------ what a run directory is
def hydra_entries() -> set[str]:
    """What Hydra writes into its run directory before train.py runs: its job's log file (``train.log``) and, where a
    user turns it back on (conf/config.yaml turns it off), its ``.hydra/`` output subdirectory."""
    names = {"train.log", ".hydra"}
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            hydra_cfg = HydraConfig.get()
            names.add(f"{hydra_cfg.job.name}.log")
            if hydra_cfg.output_subdir:
                names.add(str(hydra_cfg.output_subdir))
    except Exception:  # noqa: BLE001  (resolved while Hydra composes its config: what is known then)
        pass
    return names


def _listed(names: list[str]) -> str:
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def _foreign_entries(directory: Path, tolerated: set[str], key: str) -> list[str]:
    """The entries of ``directory`` that are not ``tolerated`` and not an empty folder (which holds nothing a run would
    replace), a folder's name ending in ``/``."""
    try:
        entries = sorted(directory.iterdir())
        foreign = []
        for path in entries:
            if path.name in tolerated:
                continue
            folder = path.is_dir() and not path.is_symlink()
            if folder and not any(path.iterdir()):
                continue
            foreign.append(path.name + ("/" if folder else ""))
    except OSError as e:
        raise ValueError(f"{key}={directory} cannot be read ({e.strerror}: {e.filename}); choose a directory this "
                         "user can read and write") from None
    return foreign


def _starts_with(path: Path, prefix: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(prefix)) == prefix.encode()
    except OSError:
        return False


def _lock_line(directory: Path) -> str | None:
    """The holder's line of ``directory``'s run.lock as ``_hold`` writes it (empty: taken, not yet written); None if
    there is none, or it is not one of this trainer's."""
    path = directory / LOCK_FILE
    if not path.is_file() or path.is_symlink():
        return None
    try:
        line = path.read_text(errors="replace").strip()
    except OSError:
        return None
    return line if line == "" or line.startswith("pid ") else None


def _lock_owner(directory: Path) -> str | None:
    """The run directory a checkpoint.dir's lock names (``lock_checkpoint_dir``: its last holder's), or None."""
    line = _lock_line(directory)
    return line.rpartition("; run ")[2] if line and "; run " in line else None


def run_markers(run_dir: Path, ckpt_root: Path | None = None) -> list[str]:
    """What makes ``run_dir`` a run of this trainer: its record, its lock, a config.yaml this trainer wrote (its
    first line), the final weights' record, a checkpoint (under ``<run_dir>/checkpoints`` or ``ckpt_root``)."""
    found = [name for name, here in (
        (RECORD_FILE, (run_dir / RECORD_FILE).is_file()), (LOCK_FILE, _lock_line(run_dir) is not None),
        (CONFIG_FILE, (run_dir / CONFIG_FILE).is_file() and _starts_with(run_dir / CONFIG_FILE, CONFIG_HEADER)),
        (weights_record(run_dir / WEIGHTS_FILE).name, weights_record(run_dir / WEIGHTS_FILE).is_file())) if here]
    roots = [run_dir / "checkpoints", *([ckpt_root] if ckpt_root is not None else [])]
    found += [str(steps[-1]) for steps in map(step_dirs, roots) if steps]
    return found


def check_run_dir(run_dir: Path, ckpt_root: Path | None = None) -> None:
    """Read-only: ``run_dir`` (train.output_dir) is new, empty but for what Hydra writes before train.py runs
    (``hydra_entries``) and empty folders, or a run of this trainer (``run_markers``); anything else is refused (a
    run writes config.yaml, metrics.jsonl, its weights and checkpoints there, replacing files of those names)."""
    if not run_dir.is_dir():
        return  # new (a file is refused by training.startup.run_path)
    foreign = _foreign_entries(run_dir, hydra_entries(), "train.output_dir")
    if foreign and not run_markers(run_dir, ckpt_root):
        raise ValueError(f"train.output_dir={run_dir} is neither empty nor a run directory of this trainer: it holds "
                         f"{_listed(foreign)} and no run of train.py ({RECORD_FILE}, a {CONFIG_FILE} written by "
                         "train.py, a checkpoint); a run writes config.yaml, metrics.jsonl, its weights and "
                         "checkpoints there, over files of those names: choose a new or empty train.output_dir")


_CHECKPOINT_NAME = re.compile(r"^(\.tmp-)?step_\d+")  # a save's folder, its temporary, one moved aside (.damaged)


def check_checkpoint_dir(ckpt_root: Path, run_dir: Path) -> None:
    """Read-only: a checkpoint.dir set explicitly is new, empty, or a checkpoint directory of this trainer (it holds
    checkpoint folders or a run's lock; the run directory itself, or the way to it where it lies inside, aside):
    a run prunes and resumes what it finds there."""
    if not ckpt_root.is_dir() or ckpt_root.resolve() == run_dir.resolve():
        return
    foreign = [name for name in _foreign_entries(ckpt_root, set(), "checkpoint.dir")
               if outside(run_dir, ckpt_root / name.rstrip("/"))]
    ours = _lock_line(ckpt_root) is not None or any(_CHECKPOINT_NAME.match(p.name) for p in ckpt_root.iterdir())
    if foreign and not ours:
        raise ValueError(f"checkpoint.dir={ckpt_root} is neither empty nor a checkpoint directory of this trainer: it "
                         f"holds {_listed(foreign)} and no checkpoint (step_N) or {LOCK_FILE} of a run; a run writes, "
                         "prunes and resumes checkpoints there: choose a new or empty checkpoint.dir")


def checkpoint_area(path: Path) -> Path | None:
    """The checkpoint directory (or checkpoint) that ``path`` is or lies inside, if any: a folder named like a
    checkpoint, one that holds checkpoints or a checkpoint.dir's lock, a run's ``checkpoints/``. What a run resumes
    from and prunes there is its own: an export written into it would be taken for a damaged checkpoint."""
    resolved = path.resolve()
    for folder in (resolved, *resolved.parents):
        if (step_of(folder) is not None or step_of(Path(folder.name.removeprefix(".tmp-"))) is not None
                or step_dirs(folder) or _lock_owner(folder) is not None
                or (folder.name == "checkpoints" and run_markers(folder.parent))):
            return folder
    return None


def own_roots(record: RunRecord | None, run_dir: Path, ckpt_root: Path) -> list[Path]:
    """The checkpoint directories ``record`` names that are this run's to read (and prune): inside the run directory
    (symlinks resolved), checkpoint.dir itself, or one whose lock names this run (``lock_checkpoint_dir``). Any other
    (an edited record's ``../../victim``, a copied run's original's) is said and left alone."""
    if record is None:
        return []
    mine, roots = str(run_dir.resolve()), []
    for root in record.roots(run_dir):
        if not outside(root, run_dir) or root.resolve() == ckpt_root.resolve() or _lock_owner(root) == mine:
            roots.append(root)
        else:
            owner = _lock_owner(root)
            logger.warning("%s names the checkpoint directory %s (%s), outside the run directory, neither "
                           "checkpoint.dir nor held by this run (%s): not read. If it holds this run's checkpoints, "
                           "set checkpoint.dir=%s", run_dir / RECORD_FILE, root, root.resolve(),
                           f"its {LOCK_FILE} names the run in {owner}" if owner else f"it has no {LOCK_FILE}",
                           root.resolve())
    return roots


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


class RunDir:
    """The run directory, held (locked) by rank 0 for the run: where it writes, where its checkpoints go, what
    this start continues (``start``) and the run's record (``run.json``, rank 0's)."""

    def __init__(self, path: Path, ckpt_root: Path, start: Start) -> None:
        self.path, self.ckpt_root, self.start = path, ckpt_root, start
        self.record = new_record(path, ckpt_root, start.record, 0)

    def begin(self, step: int, is_writer: bool) -> None:
        """The run starts (or continues) after ``step``: record it; drop what train.discard_newer discards."""
        self.record.step, self.record.finished = step, False
        if self.start.checkpoint is not None:
            self.record.checkpoint = str(self.start.checkpoint)
        if not is_writer:
            return
        for path in stale_temporaries(self.path):  # under the run's lock: no live writer of this run is left
            logger.warning("removing %s, left by a save whose process is gone (killed while writing)", path)
            remove(path)
        for path in self.start.discard:  # a symbolic link goes alone: what it points to is not this run's to remove
            logger.warning("train.discard_newer: removing %s%s (trained after the resumed step %d)", path,
                           f", a link to {path.readlink()} (kept)" if path.is_symlink() else "", step)
            remove(path)
        write_record(self.path, self.record)

    def saved(self, step: int, checkpoint: Path, is_writer: bool) -> None:
        self.record.step, self.record.checkpoint = step, str(checkpoint)
        if is_writer:
            write_record(self.path, self.record)

    def finished(self, step: int, is_writer: bool) -> None:
        self.record.step, self.record.finished = step, True
        if is_writer:
            write_record(self.path, self.record)


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
    _check_checkpoint_dir(ckpt_root, run_dir, record)
    roots = list(dict.fromkeys([ckpt_root, *own_roots(record, run_dir, ckpt_root)]))
    for link in (link for root in roots for link in linked_step_dirs(root)):
        logger.warning("%s is a symbolic link (to %s), and a checkpoint of this run is a folder: not read. To start "
                       "from that checkpoint, set train.resume=%s in a new train.output_dir", link,
                       link.resolve(), link.resolve())
    found = sorted((d for root in roots for d in step_dirs(root)), key=step_of)
    logged = _logged_steps(run_dir)
    # What counts as a run: a start that failed before its first step (a record at step 0, an empty
    # metrics.jsonl, a config.yaml) does not, so its retry starts.
    trained = record is not None and (record.step > 0 or record.finished)
    previous = [str(p) for p in (*([run_dir / RECORD_FILE] if trained else []), *found)]
    previous += [str(run_dir / METRICS_FILE)] if logged else []
    if resume == "none":
        check_run_dir(run_dir, ckpt_root)
        if previous:
            raise CheckpointError(f"{run_dir} already holds a run ({', '.join(previous[:3])}); continue it with "
                                  "train.resume=auto, or start afresh in another train.output_dir")
        return Start()
    if resume == "auto":
        check_run_dir(run_dir, ckpt_root)
        if found:
            newest = found[-1]
            if not (newest / TRAIN_STATE).is_file():
                raise CheckpointError(damaged_message(newest, f"it has no {TRAIN_STATE}"))
            _check_no_links_out(newest)
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
    if path.resolve().parent not in {r.resolve() for r in roots}:  # another run's checkpoint: this run starts from it
        _check_other_runs_checkpoint(path, state, run_dir, previous)
        check_run_dir(run_dir, ckpt_root)
        return Start(checkpoint=path, state=state, record=record)
    check_run_dir(run_dir, ckpt_root)
    _check_no_links_out(path)
    return Start(checkpoint=path, state=state, record=record,
                 discard=_newer_than(path, state["step"], found, logged, run_dir, record, discard_newer))


def _check_checkpoint_dir(ckpt_root: Path, run_dir: Path, record: RunRecord | None) -> None:
    """A checkpoint.dir outside the run directory that holds checkpoints its record does not name is another
    run's: this run's saves would prune them and a resume=auto take them for its own."""
    owner = _lock_owner(ckpt_root)  # lock_checkpoint_dir's last holder
    named = record is not None and ckpt_root.resolve() in {r.resolve() for r in record.roots(run_dir)}
    if not outside(ckpt_root, run_dir) or (named and owner in (None, str(run_dir.resolve()))):
        return  # the record's word counts only where no other run's lock says otherwise
    found = step_dirs(ckpt_root)
    if found and owner != str(run_dir.resolve()):
        whose = f"the run in {owner}" if owner else ", ".join(str(p) for p in found[:3])
        raise CheckpointError(f"checkpoint.dir={ckpt_root} holds another run's checkpoints ({whose}); this run would "
                              "prune them and resume from them as its own: choose another checkpoint.dir")


def _check_no_links_out(checkpoint: Path) -> None:
    """A checkpoint of this run holds the files its save wrote: a symbolic link in it to a file elsewhere (another
    run's) is refused."""
    links = [p for p in checkpoint.iterdir() if p.is_symlink() and outside(p, checkpoint)]
    if links:
        link = links[0]
        raise CheckpointError(damaged_message(checkpoint, f"{link.name} is a symbolic link to {link.resolve()}, "
                                                          "outside it (a save writes its own files)"))


def _check_other_runs_checkpoint(path: Path, state: dict[str, Any], run_dir: Path, previous: list[str]) -> None:
    """train.resume=<another run's checkpoint> starts the run directory from it: refused where the two overlap, and
    where the directory holds a run (its checkpoints, weights and record would be replaced, the rest pruned;
    train.discard_newer discards only a run's own newer steps)."""
    other = (state.get("config") or {}).get("train", {}).get("output_dir")
    of = f"a checkpoint of the run in {other}" if other else "another run's checkpoint"
    if not outside(path, run_dir) or not outside(run_dir, path):
        where = "contains it" if not outside(path, run_dir) else "is inside it"
        raise CheckpointError(f"train.resume={path} is {of}, and train.output_dir={run_dir} {where}: this run would "
                              "write over what it starts from; choose a train.output_dir apart from it")
    if previous:
        raise CheckpointError(f"train.resume={path} is {of}, but {run_dir} already holds another run "
                              f"({', '.join(previous[:3])}), whose checkpoints and weights it would replace "
                              "(train.discard_newer discards only a run's own newer steps): start from it in a new "
                              f"train.output_dir, or continue the run in {run_dir} with train.resume=auto")


def _newer_than(path: Path, step: int, found: list[Path], logged: int, run_dir: Path, record: RunRecord | None,
                discard_newer: bool) -> list[Path]:
    """What this run trained after ``path`` (one of its checkpoints at ``step``): refused unless discard_newer."""
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

