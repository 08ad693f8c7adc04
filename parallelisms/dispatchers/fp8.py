"""``dispatcher.fp8_dispatch``: the dispatch all-to-all in e4m3. The routed rows leave as e4m3 rows with one
power-of-two fp32 scale each (``kernels.float8``'s rowwise quantisation, the registry's ``gather_quantize_rows``
kernel), packed into one [rows, D + 4] byte buffer so each dispatch stays one all-to-all (D + 4 bytes a row instead
of 2 D in bf16), and are dequantised to the compute dtype on arrival. The combine and every backward all-to-all stay
in the compute dtype; the gradient passes the quantisation straight through (as FP8 training's casts do), so the
backward is the bf16 dispatch's. fused and dedup send with ``fp8_all_to_all``, domino with ``Fp8InFlight``.

Error: one rounding to e4m3 (3 mantissa bits: 2^-4 relative at most per element, scaled rowwise so a row's largest
element sits in [224, 448]) of the rows the experts read; nothing else changes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from core.torch_compat import C10D_FUNCTIONAL
from kernels.float8.grouped_mm import FP8
from kernels.float8.permute import gather_quantize_rows

_all_to_all = C10D_FUNCTIONAL.all_to_all_single
_wait = C10D_FUNCTIONAL.wait_tensor
SCALE_BYTES = 4


def fp8_configured(cfg, device_type: str) -> bool:
    """``dispatcher.fp8_dispatch`` for a dispatcher on ``device_type``: not on NPU (the e4m3 casts are CUDA's and the
    CPU's here)."""
    if cfg.fp8_dispatch and device_type == "npu":
        raise NotImplementedError("dispatcher.fp8_dispatch=true runs on CUDA/CPU; on NPU set it false")
    return bool(cfg.fp8_dispatch)


def pack(x_MD: torch.Tensor) -> torch.Tensor:
    """x_MD -> [M, D + 4] bytes: its e4m3 rows, then each row's fp32 scale."""
    index = torch.arange(x_MD.shape[0], device=x_MD.device)
    data_MD, scale_M1 = gather_quantize_rows(x_MD, index)
    return torch.cat([data_MD.view(torch.uint8), scale_M1.contiguous().view(torch.uint8)], 1)


def unpack(packed_RB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``pack``'s bytes -> the rows dequantised to ``dtype`` (the scales are powers of two: the division is exact)."""
    D = packed_RB.shape[1] - SCALE_BYTES
    data_RD = packed_RB[:, :D].contiguous().view(FP8)
    scale_R1 = packed_RB[:, D:].contiguous().view(torch.float32)
    return (data_RD.float() / scale_R1).to(dtype)


class _Fp8Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.meta = recv, send, group.group_name
        return unpack(_wait(_all_to_all(pack(x_MD), recv, send, group.group_name)), x_MD.dtype)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        recv, send, group_name = ctx.meta
        return _wait(_all_to_all(grad_RD.contiguous(), send, recv, group_name)), None, None, None


def fp8_all_to_all(x_MD: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """``all_to_all_single_autograd(x_MD, recv, send, group)`` with the rows sent in e4m3 (the dispatch of fused and
    dedup under dispatcher.fp8_dispatch); the gradient comes back in x's dtype."""
    return _Fp8Dispatch.apply(x_MD, recv, send, group)


class _Box:
    """Shared by one in-flight dispatch's start and wait nodes: the packed rows in flight forward, the gradient
    in flight backward."""

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None


class _Start(torch.autograd.Function):
    """Quantise and issue the all-to-all; the output is a token linking the wait to x in the graph (the rows travel
    in the box: autograd does not carry bytes)."""

    @staticmethod
    def forward(ctx, x_MD: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str,
                box: _Box) -> torch.Tensor:
        ctx.box = box
        box.packed = _all_to_all(pack(x_MD), out_splits, in_splits, group_name)
        return x_MD.new_empty(0)

    @staticmethod
    def backward(ctx, _token: torch.Tensor):
        grad, ctx.box.grad = _wait(ctx.box.grad), None  # sent back by _Wait.backward
        return grad, None, None, None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str,
                box: _Box, dtype: torch.dtype) -> torch.Tensor:
        ctx.meta, ctx.box = (out_splits, in_splits, group_name), box
        packed, box.packed = _wait(box.packed), None
        return unpack(packed, dtype)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        out_splits, in_splits, group_name = ctx.meta
        ctx.box.grad = _all_to_all(grad_RD.contiguous(), in_splits, out_splits, group_name)
        return grad_RD.new_zeros(0), None, None, None, None, None


class Fp8InFlight:
    """domino's ``_InFlight`` for a dispatch in e4m3: issued now, waited for (and dequantised) at ``wait()``; its
    gradient goes back in the compute dtype, issued when the wait's backward runs, waited for at the start's."""

    def __init__(self, x_MD: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup):
        self.args = (out_splits, in_splits, group.group_name, _Box())
        self.dtype = x_MD.dtype
        self.token = _Start.apply(x_MD.contiguous(), *self.args)

    def wait(self) -> torch.Tensor:
        return _Wait.apply(self.token, *self.args, self.dtype)
