"""Where each rank's log lines go: one run directory holds them all.

Rank 0's log is ``<run_dir>/train.log`` (Hydra's file handler, moved there when Hydra picked another directory:
under a plain ``torchrun`` each rank's Hydra clock names its own ``outputs/<date>/<time>``, and the run directory is
rank 0's). Other ranks write no file unless ``logging.all_ranks=true``, then ``<run_dir>/logs/rank_<r>.log``; a
rank's own Hydra directory that ended up unused and empty is removed, so no stray ``outputs/`` folders remain.
Handlers that Hydra did not make (a user's, pytest's) are left alone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's default file format


def log_file(run_dir: Path, rank: int) -> Path:
    return run_dir / "train.log" if rank == 0 else run_dir / "logs" / f"rank_{rank}.log"


def _hydra_log() -> Path | None:
    """The file Hydra's job logging writes (``<hydra run dir>/<job name>.log``), when under Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    return (Path(hydra_cfg.runtime.output_dir) / f"{hydra_cfg.job.name}.log").resolve()


@contextlib.contextmanager
def run_logs(run_dir: Path, rank: int, all_ranks: bool) -> Iterator[None]:
    """Route this rank's file log into the run directory for the duration of a run; restore the level after."""
    root = logging.getLogger()
    target = log_file(run_dir, rank).resolve()
    hydra_log = _hydra_log()
    hydra_handlers = [h for h in root.handlers
                      if isinstance(h, logging.FileHandler) and Path(h.baseFilename).resolve() == hydra_log]
    keep = hydra_log == target and bool(hydra_handlers)
    if not keep:
        for handler in hydra_handlers:
            root.removeHandler(handler)
            handler.close()
        if hydra_handlers and not hydra_log.is_relative_to(run_dir.resolve()):
            _remove_unused_hydra_dir(hydra_log)
    added, level = None, root.level
    if not keep and (rank == 0 or all_ranks):
        target.parent.mkdir(parents=True, exist_ok=True)
        added = logging.FileHandler(target, mode="a")
        added.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(added)
        root.setLevel(min(level, logging.INFO) if level else logging.INFO)
    try:
        yield
    finally:
        if added is not None:
            root.removeHandler(added)
            added.close()
            root.setLevel(level)


def _remove_unused_hydra_dir(hydra_log: Path) -> None:
    """Remove Hydra's log file when nothing was written to it (a regular file, empty), and its run directory when
    that leaves it empty."""
    with contextlib.suppress(OSError):
        if hydra_log.is_symlink() or not hydra_log.is_file() or hydra_log.stat().st_size:
            return
        hydra_log.unlink()
        hydra_log.parent.rmdir()  # fails, harmlessly, unless empty
