"""The kernels in use for the ops that kernel functions call, not the model: the dispatch path's K-to-one gathers
and token permutes (``kernels.moe.permute``) and the grouped GEMM (``kernels.moe.grouped_mm``), per device type.

``kernels.registry`` chooses them from ``kernel_config`` with every other op, and ``apply_kernels`` (``install``)
puts its choice here; the model's ops go into its kernel slots instead. Until then, and for tensors on any other
device type, the functions run their torch references: the choice is made for one device, and a CPU tensor in a
CUDA run still takes the CPU path.
"""

from __future__ import annotations

from typing import Callable

import torch

_KERNELS: dict[tuple[str, str], Callable] = {}  # (device type, op) -> implementation


def kernel(op: str, tensor: torch.Tensor, reference: Callable) -> Callable:
    """The implementation of ``op`` installed for ``tensor``'s device type, else ``reference``."""
    return _KERNELS.get((tensor.device.type, op), reference)


def put(device_type: str, op: str, fn: Callable) -> None:
    _KERNELS[(device_type, op)] = fn


def snapshot() -> dict[tuple[str, str], Callable]:
    return dict(_KERNELS)


def restore(saved: dict[tuple[str, str], Callable]) -> None:
    _KERNELS.clear()
    _KERNELS.update(saved)
