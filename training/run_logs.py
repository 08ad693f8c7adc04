"""Where each rank's log lines go: one run directory holds them all.

Rank 0's log is ``<run_dir>/train.log`` (Hydra's file handler, moved there when Hydra picked another directory:
under a plain ``torchrun`` each rank's Hydra clock names its own ``outputs/<date>/<time>``, and the run directory is
rank 0's). Other ranks write no file unless ``logging.all_ranks=true``, then ``<run_dir>/logs/rank_<r>.log``; a
rank's own Hydra directory that ended up unused and empty is removed, so no stray ``outputs/`` folders remain.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's default file format


def log_file(run_dir: Path, rank: int) -> Path:
    return run_dir / "train.log" if rank == 0 else run_dir / "logs" / f"rank_{rank}.log"


@contextlib.contextmanager
def run_logs(run_dir: Path, rank: int, all_ranks: bool) -> Iterator[None]:
    """Route the root logger's file output into the run directory for the duration of a run; restore it after."""
    root = logging.getLogger()
    previous = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    target = log_file(run_dir, rank)
    keep = [h for h in previous if Path(h.baseFilename) == target.resolve()]
    for handler in previous:
        if handler not in keep:
            root.removeHandler(handler)
            handler.close()
            _remove_if_unused(Path(handler.baseFilename), run_dir)
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


def _remove_if_unused(file: Path, run_dir: Path) -> None:
    """Remove a log file that nothing was written to, and its directory when that leaves it empty (never the run
    directory or anything inside it)."""
    with contextlib.suppress(OSError):
        if file.resolve().is_relative_to(run_dir.resolve()) or file.stat().st_size:
            return
        file.unlink()
        file.parent.rmdir()  # fails, harmlessly, unless empty
