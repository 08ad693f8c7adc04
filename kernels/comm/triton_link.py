"""Triton (CUDA) kernels of ``kernels.comm.link``'s timer: the GPU's global timer (%globaltimer, ns) read into a
tensor in stream order, and a hold of ``sms`` programs that each spin on it until a deadline. The programs run 16
warps (512 threads, about NCCL's CTA) and touch no memory after their first load: like NCCL's CTAs they take SM
slots from the kernels beside them, and share an SM with those whose registers and shared memory still fit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _clock_kernel(OUT):
    tl.store(OUT, _now())


@triton.jit
def _hold_kernel(START, ns):
    deadline = tl.load(START) + ns
    now = _now()
    while now < deadline:
        now = _now()


class LinkTimer:
    """``kernels.comm.link.TorchLinkTimer`` on the device: nothing waits on the host."""

    def clock(self, like: torch.Tensor) -> torch.Tensor:
        out = torch.empty(1, dtype=torch.int64, device=like.device)
        _clock_kernel[(1,)](out, num_warps=1)
        return out

    def hold(self, start: torch.Tensor, ns: int, sms: int, like: torch.Tensor | None = None) -> None:
        _hold_kernel[(sms,)](start, ns, num_warps=16)
