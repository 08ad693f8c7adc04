"""Expert parallelism: split a ``GroupedExperts`` module's experts over the ep ranks and install the
dispatcher that moves tokens to them; and, where the expert FSDP would span one rank, what it would still do
(``replace_single_rank_fsdp``)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from core.torch_compat import StridedShard, concatenate_meshes
from models.moe import GroupedExperts
from parallelisms.compute_copy import ComputeCopies, install_compute_copies, unit_slots
from parallelisms.dispatchers import DispatcherConfig, dispatcher_class
from parallelisms.dispatchers.base import Dispatcher


def apply_expert_parallel(experts: GroupedExperts, ep_mesh: DeviceMesh, dispatcher: DispatcherConfig) -> None:
    """Each ep rank keeps E/ep experts (dim 0 of every expert weight). The weights become DTensors,
    Shard(0) on the ep mesh, so they keep their global shape [E, ...]: state dicts, checkpoints and weight
    loaders see the whole tensor while each rank stores its slice. ``dispatcher``: the ``dispatcher`` group."""
    num_experts = experts.num_experts
    for name, param in list(experts.named_parameters(recurse=False)):
        # src_data_rank=None: each rank takes its chunk of its own tensor, no broadcast (and none is
        # possible on the meta device, where models are parallelized before they are materialised).
        sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    experts.num_experts = num_experts // ep_mesh.size()  # the model's convention: E is the local count under EP
    experts.dispatcher = dispatcher_class(dispatcher.name)(ep_mesh.get_group(), num_experts)
    experts.dispatcher.configure(dispatcher)


def may_drop_rows(model: nn.Module) -> bool:
    """Whether an EP dispatcher of ``model`` can drop rows in a step (dispatcher=capacity): the host then knows
    only after the step's read whether the step may be applied."""
    return any(isinstance(module, GroupedExperts) and isinstance(module.dispatcher, Dispatcher)
               and module.dispatcher.drops_rows for module in model.modules())


def raise_if_dispatch_overflowed(model: nn.Module) -> None:
    """Raise if an EP dispatcher dropped rows in this step (dispatcher=capacity past its capacity): called after
    the step's host sync, so the overflowed step is never applied."""
    for module in model.modules():
        if isinstance(module, GroupedExperts) and isinstance(module.dispatcher, Dispatcher):
            module.dispatcher.raise_if_overflowed()


def replace_single_rank_fsdp(experts: GroupedExperts, expert_fsdp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy,
                             divide_factor: float, copies: ComputeCopies) -> None:
    """Stand-in for ``fully_shard(experts, mesh=expert_fsdp_mesh, mp_policy=..., shard_placement_fn=Shard(0))``
    followed by ``set_gradient_divide_factor(divide_factor)`` where that mesh has one rank (after EP: the
    weights' Shard(0) DTensors on the ep mesh), with the same numerics and the same parameters, minus FSDP's
    per-step all-gather and reduce-scatter buffers and copies.

    - The parameters become the DTensors FSDP would make: global shape, on the (expert_fsdp, ep) mesh,
      placements (StridedShard(0, ep), Shard(0)); so state dicts, DCP checkpoints, the optimizer and
      ``clip_grad_norm_`` see exactly what they see under FSDP, and checkpoints load across both paths.
    - In forward the module reads what FSDP would unshard: each weight in ``mp_policy.param_dtype`` as a
      Shard(0) DTensor on the ep mesh, from ``copies``, which casts it once per optimizer step
      (``parallelisms.compute_copy``); floating inputs are cast as FSDP casts them.
    - Backward: the gradient reaches the fp32 parameter in ``reduce_dtype`` divided by ``divide_factor``, per
      backward (so accumulation over micro-batches adds the same terms as FSDP's sharded gradient does).
    """
    ep_mesh = next(experts.parameters()).device_mesh
    mesh = concatenate_meshes([expert_fsdp_mesh, ep_mesh])  # what FSDP builds for an EP DTensor
    placements = (StridedShard(0, split_factor=ep_mesh.size()), Shard(0))
    for name, param in list(experts.named_parameters(recurse=False)):
        spmd = DTensor.from_local(param.to_local().detach(), mesh, placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
        experts.register_parameter(name, nn.Parameter(spmd, requires_grad=param.requires_grad))

    def as_read(w: torch.Tensor, param: torch.Tensor) -> DTensor:
        return DTensor.from_local(w, ep_mesh, (Shard(0),), run_check=False, shape=param.shape, stride=param.stride())

    install_compute_copies(experts, unit_slots(experts, set()), copies, mp_policy, divide_factor, as_read)
