"""Atomic file writes: a reader (or a resume after a crash) sees the old file or the new one, never half of one.
No torch here: the tokenizer's worker processes import this."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` beside ``path``, then rename: readers see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))


def atomic_write_npy(path: Path, array: np.ndarray) -> None:
    """Write ``array`` atomically as the .npy file ``path``."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.save would append .npy to a path
            np.save(f, array)

    atomic_write(path, write)
