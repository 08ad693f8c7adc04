"""Every private torch API the project uses outside ``kernels/``, and every torch-version condition around one: the
one file to read, and to change, when a torch release moves something. The rest of the code imports these names
and never names a private torch module, function, class, op or attribute itself (``tests/test_torch_compat.py``
checks that, and that each shim still works on the torch it runs on).

Supported: torch 2.11 through 2.14 (``pyproject.toml``); CI runs the whole suite on 2.13 and the tests marked
``torch_apis`` on 2.11. Each shim says which of these versions need it and why. Where versions differ, the condition
is here: by ``TORCH_VERSION``, or by feature where torch gives no release boundary to rely on. A shim marked "2.11-2.14:
the same" works alike on every supported version (CI runs it on 2.11 and 2.13) and has no public equivalent in any of
them: its private name is the only way to do what it does.

What lives here, in this order: DeviceMesh's layout API (unflatten, flatten, concatenate); DTensor's _StridedShard and
shard geometry; the functional collectives and their ops, a Python process group's Work, the PREMUL_SUM factor (the one
condition that differs between supported versions) and a group's backend object; the composable DDP and activation
checkpoint; the foreach ops; the private aten and profiler ops selective checkpointing matches; Tensor, nn.Module and
OpOverload internals; pytrees; DCP's state-dict flattening and the globals of its metadata pickle.

What does not live here:

- Kernels' private ops (``torch._grouped_mm``, ``torch._scaled_grouped_mm``, ``torch.nn.attention.varlen`` and its
  arguments, FlexAttention): each is a kernel's implementation, in ``kernels/<group>/``, and whether this torch has it
  is that kernel's availability check in ``kernels/registry.py`` (``_needs_grouped_mm``, ``varlen_signature_problem``,
  ...), which logs the choice and its reason at start-up. The selective-checkpointing policy names the same ops'
  aten overloads: those handles are here (``SAC_PRIVATE_GEMM_OPS``, ``SAC_PRIVATE_ATTENTION_OPS``).
- torch_npu's version match (``core.device``): which torch a torch-npu release is built for, not a torch API.
- Public torch APIs whose behaviour a comment dates (FSDP2's ``set_gradient_divide_factor``,
  ``set_force_sum_reduction_for_comms`` and prefetch setters, all public in 2.11-2.14; the plan's reasons for using
  them stay beside their calls in ``parallelisms/parallelize.py``). No FSDP2 private hook is used anywhere.
- Tests, which may reach into torch to check what the code does (``tests/dist_utils.py``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _functional_collectives
import torch.nn as nn
import torch.utils._pytree as _pytree
from torch._C._distributed_c10d import _create_work_from_future
from torch.distributed._composable import checkpoint as _checkpoint
from torch.distributed._composable.replicate import replicate as _replicate
from torch.distributed.checkpoint import _nested_dict, _traverse
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import _utils as _dtensor_utils
from torch.distributed.tensor.placement_types import _StridedShard

# (major, minor) of the running torch: "2.13.0+cpu" -> (2, 13).
TORCH_VERSION: tuple[int, int] = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
MIN_TORCH, MAX_TORCH = (2, 11), (2, 14)  # pyproject.toml: torch>=2.11,<2.15

if TORCH_VERSION < MIN_TORCH:  # never run with the shims below: refused here, not on a missing private API later
    raise ImportError(f"torch {torch.__version__} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}, the oldest this project "
                      "supports (pyproject.toml): pip install -U 'torch>=2.11,<2.15'")


# ------------------------------------------------------------------------------------------ device meshes
# DeviceMesh's layout API: every mesh of parallelisms/dims.py is an unflattening of one world mesh (so they share a
# root, and FSDP2 can combine the expert FSDP mesh with the EP mesh), the expert HSDP replicate dim is a flattening of
# two dims that are not adjacent, and expert FSDP's mesh a concatenation. 2.11-2.14: the same, private (torchtitan uses
# them too); the tests build every layout, so a change shows up there first.

def unflatten_mesh(mesh: DeviceMesh, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``mesh`` with its dim ``dim`` split into dims of ``sizes``, named ``names`` (sharing ``mesh``'s root)."""
    return mesh._unflatten(dim, sizes, names)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s dims as one dim named ``name`` (sharing ``mesh``'s root)."""
    return mesh._flatten(name)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are ``meshes``' in order (submeshes of one root): what FSDP2 builds for a DTensor that is
    already sharded on another mesh."""
    return DeviceMesh._concatenate(meshes)


# ------------------------------------------------------------------------------------------ DTensor
# _StridedShard: the placement FSDP2 puts on a dim that is already Shard on an inner mesh (expert FSDP over EP's
# Shard(0)); the one-rank expert FSDP stand-in (parallelisms/expert_parallel.py) makes the same DTensors, so that
# checkpoints load across both. 2.11-2.14: the same, private (torch.distributed.tensor.placement_types).
StridedShard = _StridedShard

# The local shape and global offset of a DTensor's shard on this rank: models/init.py fills each shard with its slice
# of the full tensor's values. 2.11-2.14: the same, private (torch.distributed.tensor._utils).
compute_local_shape_and_global_offset = _dtensor_utils.compute_local_shape_and_global_offset


# ------------------------------------------------------------------------------------------ collectives
# Functional collectives: the all-to-alls of EP and CP and CP's all-gather, traceable and (the _autograd ones)
# differentiable; results are AsyncCollectiveTensors, waited on at first use. 2.11-2.14: the same, private
# (torch.distributed._functional_collectives; the public c10d calls are neither differentiable nor traceable).
AsyncCollectiveTensor = _functional_collectives.AsyncCollectiveTensor
all_gather_tensor = _functional_collectives.all_gather_tensor
all_to_all_single = _functional_collectives.all_to_all_single
all_to_all_single_autograd = _functional_collectives.all_to_all_single_autograd

# The ops under them, for the domino dispatcher's own start/wait autograd nodes and for selective checkpointing's
# policy (saved, never recomputed). 2.11-2.14: the same (the _c10d_functional op namespace).
C10D_FUNCTIONAL = torch.ops._c10d_functional


def work_from_future(future: torch.futures.Future) -> dist.Work:
    """A completed ``dist.Work`` holding ``future``'s result: what a process group written in Python (the loopback
    world, parallelisms/loopback.py) returns from each collective. 2.11-2.14: the same, private (torch._C)."""
    return _create_work_from_future(future)


def group_ranks_named(name: str) -> list[int] | None:
    """The global ranks of the process group c10d registered under ``name`` (what a Python backend, the loopback
    world's, knows of its own group), or None where none is. 2.11-2.14: the same, private (c10d's _world)."""
    group = next((pg for pg, pg_name in dist.distributed_c10d._world.pg_names.items() if pg_name == name), None)
    return None if group is None else dist.get_process_group_ranks(group)


def premul_sum_factor(op: Any) -> float | None:
    """The factor of a PREMUL_SUM ``ReduceOp`` (FSDP2's custom gradient divide factor, as NCCL applies it), or None
    where torch does not expose it to Python. torch 2.13 does (``ReduceOp.factor``, pytorch/pytorch#185863); 2.11
    keeps it in C++; looked up by feature, as a 2.12 or 2.14 build has it or not. Where it is None the loopback world
    refuses the op (parallelisms/loopback.py), and FSDP's reduce-scatter is forced to a sum and a divide there
    (parallelisms/parallelize.py), on every version alike."""
    return getattr(op, "factor", None)


def backend_of(group: dist.ProcessGroup, device: torch.device) -> Any:
    """``group``'s backend object for ``device`` (the HCCL backend, whose communicator name the MC2 ops take).
    2.11-2.14: the same, private (ProcessGroup._get_backend)."""
    return group._get_backend(device)


# ------------------------------------------------------------------------------------------ composable wrappers
# The composable DDP and activation checkpoint: they hook the module in place, so parameter names (state dicts,
# loaders, FSDP units) stay as without them. 2.11-2.14: the same, private (torch.distributed._composable; the public
# DDP and checkpoint_wrapper add a prefix to every name).
checkpoint = _checkpoint
replicate = _replicate


# ------------------------------------------------------------------------------------------ ops and tensors
# Multi-tensor (foreach) ops: one launch per list, as torch's own optimizers and clip_grad_norm_ use them (the cast of
# the compute copies; the grad norm and the clip). 2.11-2.14: the same, private by name.
foreach_copy_ = torch._foreach_copy_
foreach_mul_ = torch._foreach_mul_
foreach_norm = torch._foreach_norm

# Selective activation checkpointing matches aten overloads: the private ones among what it saves (attention's SDPA
# backends; the bf16 and FP8 GEMMs whose kernels are kernels/'s) and the profiler's range markers, which it must ignore.
# 2.11-2.14: all registered (the module is imported on 2.11 in CI, where a missing overload fails at import).
SAC_PRIVATE_ATTENTION_OPS = frozenset({
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
})
SAC_PRIVATE_GEMM_OPS = frozenset({
    torch.ops.aten._grouped_mm.default,
    torch.ops.aten._scaled_mm.default,  # train.float8: Float8Linear's GEMM
    torch.ops.aten._scaled_grouped_mm.default,  # train.float8: the experts' FP8 grouped GEMM
})
PROFILER_RANGE_OPS = frozenset({torch.ops.profiler._record_function_enter_new.default,
                                torch.ops.profiler._record_function_exit._RecordFunction})


def op_schema_name(op: torch._ops.OpOverload) -> str:
    """An op overload's qualified name without the overload (``npu::npu_grouped_matmul``), for ops matched by name
    where their namespace exists only once a plugin is imported. 2.11-2.14: the same, private (OpOverload._schema)."""
    return op._schema.name


def version_counter(t: torch.Tensor) -> int:
    """The in-place version counter autograd keeps on ``t`` (bumped by every in-place write through it), read without
    a device sync. 2.11-2.14: the same, private (Tensor._version)."""
    return t._version


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose storage ``t`` views (the root of a chain of views), or None where ``t`` is no view.
    2.11-2.14: the same, private (Tensor._base)."""
    return t._base


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameter slots (not its submodules'), as registered, even while an entry of the module's
    ``__dict__`` shadows one for attribute reads (``parallelisms/compute_copy.py``). 2.11-2.14: the same, private
    (nn.Module._parameters; ``named_parameters`` drops None and duplicates, ``get_parameter`` sees the shadow)."""
    return module._parameters


# ------------------------------------------------------------------------------------------ pytrees
# Map over the tensors of nested args / outputs (the one-rank stand-in for FSDP2's input and output casts).
# 2.11-2.14: the same, private (torch.utils._pytree).
tree_map_only = _pytree.tree_map_only


# ------------------------------------------------------------------------------------------ distributed checkpoint
# DCP's flattening of a nested state dict to its checkpoint keys ("model.layers.0...") and the inverse assignment
# (training/checkpoint.py: the key and shape check before a load; the weights-only load planner, whose load_bytes
# mirrors DefaultLoadPlanner's). 2.11-2.14: the same, private (torch.distributed.checkpoint._nested_dict, _traverse).
flatten_state_dict = _nested_dict.flatten_state_dict
set_element = _traverse.set_element

# Every torch global DCP's .metadata pickle is made of, as exact (module, name) pairs, for the allowlist unpickler
# (training/checkpoint.py adds pathlib's, which depend on the Python version). Checked on torch 2.11 and 2.13: private
# names among them (_StorageInfo, _MEM_FORMAT_ENCODING, _get_layout) that a release may rename, which makes every
# checkpoint of it unreadable here, naming the global it refused.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
DCP_METADATA_GLOBALS = frozenset({
    (_DCP_METADATA, "Metadata"), (_DCP_METADATA, "MetadataIndex"), (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "TensorStorageMetadata"), (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"), (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    *(("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)),
})
