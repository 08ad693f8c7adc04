"""What the training loop controls besides the step: stopping on a signal (with a checkpoint; ranks agree) and
Python's garbage collector."""

from __future__ import annotations

import gc
import logging
import signal
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import parallelisms
from core import device

logger = logging.getLogger("train")


class ManualGC:
    """train.gc_every: Python's automatic GC pauses one rank at a time, and every other rank waits on it; instead,
    young generations only every gc_every steps (as torchtitan: cheap, at the same step on every rank)."""

    def __init__(self, every: int) -> None:
        self.every = every
        if every:
            gc.collect()
            gc.disable()

    def step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            gc.collect(1)

    def restore(self) -> None:
        if self.every:
            gc.enable()


class StopSignal:
    """SIGTERM (slurm preemption, torchrun shutdown), SIGHUP (the terminal or ssh session closed) and a first Ctrl-C
    (SIGINT) ask to stop after the current step, with a checkpoint; ranks agree. A second Ctrl-C stops at once
    (KeyboardInterrupt), without one."""

    _SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

    def __init__(self, dims: parallelisms.ParallelDims, dev: torch.device) -> None:
        self._dims, self._dev = dims, dev
        self.signum: int | None = None
        self.path: Path | None = None  # the checkpoint saved on the signal
        self._pending: Callable[[], torch.Tensor] | None = None  # the flag the last call queued (several ranks)
        self._previous = {s: signal.signal(s, self._handle) for s in self._SIGNALS}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a peer rank's signal"

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt("a second Ctrl-C: stopped at once, without a checkpoint; train.resume=auto "
                                    "continues from the last one")
        self.signum = signum
        if signum == signal.SIGINT:
            logger.warning("Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again stops at once)")

    def requested(self) -> bool:
        """Whether to stop after this step. With several ranks any rank's signal stops all of them, through a flag
        all-reduced each step and read one step late: reading this step's flag would wait for everything queued
        before its all-reduce (the step's update), so each call queues its own and reads the one the call before
        queued, long complete. Every rank reads the same flags at the same calls: all stop at one step, the one
        after the signal's."""
        if self._dims.world_size == 1:
            return self.signum is not None
        flag = torch.full((1,), float(self.signum is not None), device=self._dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        previous, self._pending = self._pending, device.queued_read(flag)
        return previous is not None and previous().tolist()[0] > 0

    def restore(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)

    def raise_if_interrupted(self) -> None:
        """After a Ctrl-C stop: KeyboardInterrupt, so the process exits 130 as an interrupted command does."""
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt(f"Ctrl-C: stopped after saving checkpoint {self.path}; train.resume=auto "
                                    "continues from it")
