"""A collective's link time, spent where the collective runs. The loopback world (``parallelisms/loopback.py``) makes
each collective a local copy; with ``launch.links.emulate`` it also holds the collective's stream until the time the
real collective would take on the links has passed since it started:

    timer = link_timer(like)            # the registry's choice for like's device
    start = timer.clock(like)           # when the collective starts, in stream order (before its copy)
    ... the copy ...
    timer.hold(start, ns, sms)          # until start + ns, in a kernel on sms SMs

so the stream is held max(copy, link time), and the SMs a real collective's kernel takes (NCCL's channels, DeepEP's
SMs) are taken from the compute beside it. The torch reference is the host's: its clock and a sleep in the caller,
so no collective overlaps anything. That is the CPU's emulation; on an accelerator without the device kernel
(``triton_link``) it first waits for the device, which keeps the time right and overlaps nothing.
"""

from __future__ import annotations

import time

import torch

from core import device
from kernels.installed import kernel


class TorchLinkTimer:
    """The reference: the host's clock (ns) and a sleep until the deadline; on an accelerator the host first waits
    for the device, so the clock reads when the work queued before it is done."""

    def clock(self, like: torch.Tensor) -> torch.Tensor:
        if like.device.type != "cpu":
            device.synchronize(like.device.type)
        return torch.tensor([time.perf_counter_ns()], dtype=torch.int64)

    def hold(self, start: torch.Tensor, ns: int, sms: int, like: torch.Tensor | None = None) -> None:
        if like is not None and like.device.type != "cpu":
            device.synchronize(like.device.type)
        left = int(start[0]) + ns - time.perf_counter_ns()
        if left > 0:
            time.sleep(left / 1e9)


TORCH_LINK_TIMER = TorchLinkTimer()


def link_timer(like: torch.Tensor):
    """The timer installed for ``like``'s device (``kernels/registry.py``: link_timer), else the reference."""
    return kernel("link_timer", like, TORCH_LINK_TIMER)
