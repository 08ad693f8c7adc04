"""Global gradient-norm clipping across meshes.

Expert gradients and the others are DTensors on different meshes (and DDP's are plain tensors), so one
``torch.nn.utils.clip_grad_norm_`` over all of them fails. Instead: group the parameters by the process
groups their shards are split over, sum the squares of each group's local shards in fp32, all-reduce each
sum over exactly those groups (never over replicas, which would count a shard twice), add, take the root,
and scale every gradient by the same ``min(max_norm / (norm + 1e-6), 1)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from core.torch_compat import foreach_mul_, foreach_norm
from parallelisms.dims import ParallelDims


def _sharded_over(param: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """Process groups over which ``param``'s shards differ: its mesh dims that are not Replicate
    (Shard, or the StridedShard that FSDP puts on top of EP's Shard(0))."""
    if not isinstance(param, DTensor):
        return ()
    mesh = param.device_mesh
    return tuple(mesh.get_group(d) for d, placement in enumerate(param.placements) if not placement.is_replicate())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _grads_by_groups(model: nn.Module) -> tuple[dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]], torch.device]:
    """Every local gradient, keyed by the process groups its parameter is sharded over (parameter order, hence the
    order of the collectives, is the same on every rank; a group whose parameters have no gradient keeps an empty
    list, so every rank still runs its all-reduce); and the device of the parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads_by_groups: dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]] = {}
    for p in params:
        grads = grads_by_groups.setdefault(_sharded_over(p), [])
        if p.grad is not None:
            grads.append(_local(p.grad))
    return grads_by_groups, _local(params[0]).device


@torch.no_grad()
def grad_norm(model: nn.Module, dims: ParallelDims) -> torch.Tensor:
    """Total L2 norm (fp32) of the gradients of ``model``, equal to the norm of the unsharded gradients: one
    ``_foreach_norm`` pass over each mesh group's local gradients, one all-reduce per process group of its sum of
    squares. ``dims`` keeps the parallelisms API uniform: the layout is read from the parameters themselves, so DDP,
    FSDP, EP and one process all take this path.

    Collective: every rank must call it. The groups come from the parameters, not from their gradients, and
    a missing gradient counts as zero, so all ranks run the same collectives even before any backward: one
    call at start-up (the warm-up) creates every communicator it needs outside the training loop.
    """
    grads_by_groups, device = _grads_by_groups(model)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for groups, grads in grads_by_groups.items():
        sq = (torch.stack(foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum() if grads
              else torch.zeros_like(total))
        for group in groups:
            dist.all_reduce(sq, group=group)
        total += sq
    return total.sqrt()


def clip_coefficient(max_norm: float, norm: torch.Tensor | float) -> torch.Tensor | float:
    """What clipping to ``max_norm`` scales every gradient by, given the total norm (1 where it is within)."""
    coef = max_norm / (norm + 1e-6)
    return coef.clamp(max=1.0) if isinstance(coef, torch.Tensor) else min(coef, 1.0)


@torch.no_grad()
def scale_grads_(model: nn.Module, coef: torch.Tensor | float) -> None:
    """Every local gradient times ``coef``, in one ``_foreach_mul_`` (no collective: the coefficient is global)."""
    grads = [g for gs in _grads_by_groups(model)[0].values() for g in gs]
    if grads:
        foreach_mul_(grads, coef)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, dims: ParallelDims) -> torch.Tensor:
    """``grad_norm``; with ``max_norm > 0`` also clips the gradients in place to it, on the device (the trainer, which
    reads the norm on the host anyway, scales only the steps that clip: ``grad_norm`` + ``scale_grads_``)."""
    norm = grad_norm(model, dims)
    if max_norm > 0:
        scale_grads_(model, clip_coefficient(max_norm, norm))
    return norm
