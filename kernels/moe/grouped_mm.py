"""Grouped GEMM over contiguous token groups: ``y[rows of g] = x[rows of g] @ w[g]``: the experts' GEMMs.

``grouped_mm`` runs the kernel ``kernels/registry.py`` chose for the device (installed in ``kernels.installed``):
``native_grouped_mm`` on CUDA, ``torch._grouped_mm`` where this torch build supports it for the device and dtype
(probed at the first call with a tiny forward + backward, then cached) and the loop elsewhere; torch_npu's grouped
matmul on NPU (``kernels.moe.npu``); the reference ``per_group_mm``, an exact per-group loop of ``torch.mm``,
everywhere else (on CPU, torch's own ``_grouped_mm`` is that loop, to the bit).
Letters as in DEVELOPERS.md: M routed rows, G groups (local experts), i in-features, o out-features.
"""

from __future__ import annotations

import functools
import threading

import torch

from kernels.installed import kernel


@torch.compiler.assume_constant_result  # under torch.compile: called while tracing, its answer a constant
def _native_supported(dev: torch.device, dtype: torch.dtype) -> bool:
    return _native_probe(dev, dtype)


@functools.lru_cache(maxsize=None)
def _native_probe(dev: torch.device, dtype: torch.dtype) -> bool:
    """Probe the three products forward and backward need (y = x w, dx = dy w^T, dw = x^T dy) with tiny
    tensors. In a thread of its own: the first call can come inside a checkpointed forward, whose dispatch
    modes and autograd state (thread-local) must not see the probe's ops."""
    result: list[bool] = []
    probe = threading.Thread(target=lambda: result.append(_probe(dev, dtype)))
    probe.start()
    probe.join()
    return result[0]


@torch.no_grad()
def _probe(dev: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:  # an explicit device index: the current device is per thread
        x_Mi = torch.randn(4, 16, device=dev, dtype=dtype)
        w_Gio = torch.randn(2, 16, 16, device=dev, dtype=dtype)
        offs_G = torch.tensor([1, 4], device=dev, dtype=torch.int32)
        y_Mo = torch._grouped_mm(x_Mi, w_Gio, offs=offs_G)
        torch._grouped_mm(y_Mo, w_Gio.transpose(-2, -1), offs=offs_G)
        torch._grouped_mm(x_Mi.t(), y_Mo, offs=offs_G)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _aligned(*sizes_in_elements: int, dtype: torch.dtype) -> bool:
    # _grouped_mm needs 16-byte aligned row strides (e.g. multiples of 8 elements in bf16).
    itemsize = torch.empty((), dtype=dtype).element_size()
    return all(s * itemsize % 16 == 0 for s in sizes_in_elements)


def native_grouped_mm_ok(x_Mi: torch.Tensor, w_Gio: torch.Tensor) -> bool:
    return (
        x_Mi.dtype == w_Gio.dtype
        and _aligned(w_Gio.shape[1], w_Gio.shape[2], dtype=w_Gio.dtype)
        and _native_supported(x_Mi.device, x_Mi.dtype)
    )


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient dense: _grouped_mm's backward rejects the stride-0
    (expanded) gradient that e.g. ``y.sum().backward()`` produces."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_mm(x_Mi: torch.Tensor, w_Gio: torch.Tensor, counts_G: torch.Tensor,
               counts_host: list[int] | None = None) -> torch.Tensor:
    """Multiply each group of rows of ``x_Mi`` (sizes ``counts_G``, in order) by its matrix ``w_Gio[g]``, with the
    installed kernel. ``counts_host``: the same sizes as Python ints where the caller has them, so that a kernel
    needing them on the host takes no sync. Under autocast both operands are cast to its dtype first, as autocast
    does for ``torch.mm``."""
    device_type = x_Mi.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x_Mi, w_Gio = x_Mi.to(dtype), w_Gio.to(dtype)
    return kernel("grouped_mm", x_Mi, per_group_mm)(x_Mi, w_Gio, counts_G, counts_host)


def native_grouped_mm(x_Mi: torch.Tensor, w_Gio: torch.Tensor, counts_G: torch.Tensor,
                      counts_host: list[int] | None = None) -> torch.Tensor:
    """``torch._grouped_mm`` where this build supports the device and dtype (and the strides are aligned), else
    the per-group loop."""
    if native_grouped_mm_ok(x_Mi, w_Gio):
        offs_G = torch.cumsum(counts_G, dim=0, dtype=torch.int32)
        return _DenseGrad.apply(torch._grouped_mm(x_Mi, w_Gio, offs=offs_G))
    return per_group_mm(x_Mi, w_Gio, counts_G, counts_host)


def per_group_mm(x_Mi: torch.Tensor, w_Gio: torch.Tensor, counts_G: torch.Tensor,
                 counts_host: list[int] | None = None) -> torch.Tensor:
    """The exact reference: one ``torch.mm`` per non-empty group (one host sync for the sizes, unless given)."""
    chunks = x_Mi.split(counts_G.tolist() if counts_host is None else counts_host)
    outs = [chunk @ w_Gio[g] for g, chunk in enumerate(chunks) if chunk.shape[0] > 0]
    if not outs:  # no rows at all: an empty product still in the graph (zero gradients, as torch._grouped_mm gives)
        return x_Mi @ w_Gio[0] if w_Gio.shape[0] else x_Mi.new_zeros(0, w_Gio.shape[2])
    return torch.cat(outs)
