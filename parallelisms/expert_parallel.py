"""Expert parallelism: split a ``GroupedExperts`` module's experts over the ep ranks and install the
dispatcher that moves tokens to them."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from models.moe import GroupedExperts
from parallelisms.dispatchers import DispatcherConfig, dispatcher_class


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
