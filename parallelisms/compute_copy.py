"""FSDP2's mixed precision without FSDP, where its mesh would have one rank: what ``fully_shard`` with a
``MixedPrecisionPolicy`` still does there (cast the parameters to ``param_dtype`` for forward, hand the
gradient back in ``reduce_dtype`` divided by the divide factor), minus its all-gather and reduce-scatter buffers
and copies, and with each parameter's compute copy cast once per optimizer step instead of at every all-gather
(forward, and again in backward after a reshard or under activation checkpointing).

Used for the whole model in one process under bf16 (``parallelize``: backend none) and for the experts over a
one-rank expert FSDP mesh (``expert_parallel.replace_single_rank_fsdp``, world = ep).

The compute copies live in persistent buffers (one per parameter: 2 bytes per parameter in bf16) and are re-cast,
in one foreach copy per unit, at the first forward after the parameter changed: after any optimizer step (a
process-wide step hook: torch's fused AdamW does not bump the version counters) or any in-place write that bumps
them (initialisation, a checkpoint load). An optimizer may instead write the copies itself beside its update
(``copies_to_write`` / ``copies_written``: ``training.optim.AdamW``'s Triton pass does, sparing the forward a read
of every fp32 parameter). The backward of every use (all micro-batches, the recompute under activation
checkpointing) reads the same copy.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from core.torch_compat import foreach_copy_, own_parameters, tree_map_only, version_counter
from kernels.optim.cast import cast_gradient

# Optimizer steps taken in this process, by any optimizer (an unrelated one's step costs a re-cast, never a stale
# copy): process-wide and registered at import, as every optimizer's step must be seen.
_generation = 0


def _count_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global _generation
    _generation += 1


register_optimizer_step_post_hook(_count_step)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def cast_copies_(copies: list[torch.Tensor], params: list[torch.Tensor]) -> None:
    """Cast ``params`` into their compute copies (one foreach launch; tests count its calls)."""
    foreach_copy_(copies, params)


def _stamp(param: torch.Tensor, local: torch.Tensor, generation: int) -> tuple[int, ...]:
    # Host-side fields only, no device sync: a step, a version bump (of the DTensor or of its local tensor, which a
    # write through to_local() bumps alone), new storage (to_empty).
    return generation, version_counter(param), version_counter(local), local.data_ptr()


_INSTANCES: weakref.WeakSet = weakref.WeakSet()  # every ComputeCopies, for the optimizers that write copies


class ComputeCopies:
    """Each parameter's copy in ``dtype`` (None: the parameter's own, no copy), shared by every unit that reads it
    (a tied weight is cast once), re-cast only where the parameter changed since its last cast."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self._entries: dict[torch.Tensor, tuple[tuple[int, ...], torch.Tensor]] = {}  # param -> (stamp, copy)
        _INSTANCES.add(self)

    @torch.no_grad()
    def get(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The compute copies of ``params`` (of their local tensors under DTensor), cast first where stale."""
        locals_ = [_local(p) for p in params]
        if self.dtype is None or all(local.dtype == self.dtype for local in locals_):
            return locals_
        stale: list[tuple[torch.Tensor, tuple[int, ...], torch.Tensor, torch.Tensor]] = []
        for param, local in zip(params, locals_):
            stamp = _stamp(param, local, _generation)
            entry = self._entries.get(param)
            if entry is None or entry[0] != stamp:
                copy = entry[1] if entry is not None and entry[0][3] == stamp[3] else torch.empty_like(
                    local, dtype=self.dtype)
                stale.append((param, stamp, local, copy))
        if stale:
            cast_copies_([copy for *_, copy in stale], [local for _, _, local, _ in stale])
            self._entries.update({param: (stamp, copy) for param, stamp, _, copy in stale})
        return [self._entries[p][1] for p in params]


def copies_to_write(params: list[torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
    """For an optimizer step that writes compute copies: param -> its compute copy (the local tensor's, in the copy
    dtype) for each of ``params`` that has one. The step writes each updated parameter, rounded, into its copy,
    then calls ``copies_written``."""
    return {param: entry[1] for copies in _INSTANCES for param in params
            if (entry := copies._entries.get(param)) is not None}


def copies_written(params: list[torch.Tensor]) -> None:
    """Inside an optimizer step: the copies of ``params`` hold the updated parameters, so they are current once the
    step ends (its step hook counts the step: the stamp taken here is the one after it)."""
    for copies in _INSTANCES:
        for param in params:
            if (entry := copies._entries.get(param)) is not None:
                copies._entries[param] = (_stamp(param, _local(param), _generation + 1), entry[1])


class _ComputeCopy(torch.autograd.Function):
    """Forward: the parameter's compute copy (a view of the cached buffer, or of the parameter when the dtypes
    agree). Backward: FSDP's one-rank reduce-scatter and the cast to the sharded gradient: the gradient in the
    reduce dtype, in the parameter's layout (cast and layout in one copy: a transposed use of the weight would
    otherwise cost autograd another copy), divided by the divide factor, then in the parameter's dtype. Once per
    backward, so micro-batches accumulate the same fp32 terms into ``.grad`` as FSDP's sharded gradient does."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, copy: torch.Tensor, reduce_dtype: torch.dtype,
                factor: float) -> torch.Tensor:
        ctx.w_dtype, ctx.w_stride, ctx.reduce_dtype, ctx.factor = w.dtype, w.stride(), reduce_dtype, factor
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        reduced = cast_gradient(g, ctx.reduce_dtype, ctx.w_stride, ctx.factor)
        return reduced.to(ctx.w_dtype), None, None, None


Slot = tuple[nn.Module, str]  # a module and the name of one of its own parameters


def unit_slots(unit: nn.Module, other_units: set[nn.Module]) -> list[Slot]:
    """The parameters a unit holds, as fully_shard would: its own and its submodules', except inside other units."""
    slots: list[Slot] = []
    modules = [unit]
    while modules:
        module = modules.pop(0)
        slots += [(module, name) for name, param in own_parameters(module).items() if param is not None]
        modules += [child for child in module.children() if child not in other_units]
    return slots


def install_compute_copies(unit: nn.Module, slots: list[Slot], copies: ComputeCopies, mp_policy: MixedPrecisionPolicy,
                           divide_factor: float,
                           as_read: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Stand-in for ``fully_shard(unit, mp_policy=...)`` + ``set_gradient_divide_factor(divide_factor)`` over a
    one-rank mesh, for the parameters ``slots`` name (which keep their objects, dtypes and placements: state dicts,
    checkpoints, the optimizer and the grad norm see them unchanged). For ``unit``'s forward each slot reads the
    parameter's compute copy (set in its module's ``__dict__``, which shadows ``_parameters`` for attribute reads
    only, and removed after forward); floating inputs and outputs are cast as the policy says. ``as_read(copy,
    param)``: what the module reads, given the local compute copy (e.g. a DTensor over a smaller mesh); default the
    copy. ``copies.dtype`` must be the policy's param_dtype."""

    def unshard(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        params = [own_parameters(owner)[name] for owner, name in slots]  # the parameters, never a forward's shadow
        for (owner, name), param, copy in zip(slots, params, copies.get(params)):
            w = _ComputeCopy.apply(_local(param), copy, mp_policy.reduce_dtype or copy.dtype, divide_factor)
            owner.__dict__[name] = as_read(w, param) if as_read else w
        if mp_policy.cast_forward_inputs and mp_policy.param_dtype is not None:
            args, kwargs = tree_map_only(torch.Tensor, lambda x: _cast_float(x, mp_policy.param_dtype), (args, kwargs))
        return args, kwargs

    def reshard(module: nn.Module, args: tuple, output: Any) -> Any:
        for owner, name in slots:
            owner.__dict__.pop(name, None)
        if mp_policy.output_dtype is not None:
            output = tree_map_only(torch.Tensor, lambda x: _cast_float(x, mp_policy.output_dtype), output)
        return output

    unit.register_forward_pre_hook(unshard, with_kwargs=True)
    unit.register_forward_hook(reshard, always_call=True)


def _cast_float(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if torch.is_floating_point(x) and x.dtype != dtype else x
