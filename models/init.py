"""Layout-independent initialisation: a parameter's initial values depend only on the seed and its name,
never on how it is sharded, so every parallel layout starts from the same model as one process.

Each full tensor is drawn on this rank's device from a generator seeded by (seed, parameter name), and
the rank keeps its slice. One full parameter exists at a time (the largest expert tensor, not the model).
"""

from __future__ import annotations

import zlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from core.torch_compat import compute_local_shape_and_global_offset

Fill = Callable[[torch.Tensor, torch.Generator], object]


def normal(std: float) -> Fill:
    return lambda t, g: t.normal_(0.0, std, generator=g)


def constant(value: float) -> Fill:
    return lambda t, g: t.fill_(value)


def local_box(param: torch.Tensor) -> tuple[slice, ...]:
    """Where this rank's shard of ``param`` lies in the global tensor: the whole tensor for a plain one; for
    a DTensor the box DTensor itself computes from its placements (Shard chunks as torch.chunk does, ceil
    sizes with short or empty tails; nested shards of one dim, e.g. FSDP over EP, included)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    if param.device_mesh.get_coordinate() is None:
        raise ValueError(f"rank {dist.get_rank()} is not in the parameter's mesh {param.device_mesh}")
    for placement in param.placements:
        if placement.is_partial():
            raise NotImplementedError(f"a DTensor parameter with a {placement} placement")
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


class ShardedInit:
    """``init(param, fill)`` fills ``param`` (plain or DTensor) with ``fill`` applied to its full tensor."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        self._seed = seed
        self._names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}

    @torch.no_grad()
    def __call__(self, param: torch.Tensor, fill: Fill) -> None:
        local = param.to_local() if isinstance(param, DTensor) else param
        full = torch.empty(param.shape, dtype=local.dtype, device=local.device)
        generator = torch.Generator(device=local.device)
        generator.manual_seed(self._seed * 1_000_003 + zlib.crc32(self._names[id(param)].encode()))
        fill(full, generator)
        local.copy_(full[local_box(param)])
