"""``train.compile``: torch.compile per decoder block, as torchtitan compiles its MoE blocks.

Every submodule of a block is compiled with ``fullgraph=True`` except the routed experts (``ModelSpec.experts``)
and the modules on the way to them, whose own code stays eager: the experts run the EP dispatcher, which reads
its all-to-all split sizes on the host (``.tolist()``: a data-dependent graph break) and whose module is an FSDP
unit of its own, or carries the hooks that stand in for a one-rank FSDP (hooks break the graph too). Left out of the graph, every dispatcher runs exactly as
without compile, and so does the per-group GEMM loop that syncs the same way.

Only hook-free modules are compiled (``nn.Module.compile``, in place: parameter names keep no ``_orig_mod``):
the block's FSDP and activation-checkpointing hooks run eagerly around the compiled pieces, so compile composes
with both in any order. Compiled code under checkpointing recomputes as eager code does (its saved tensors go
through the same hooks); under selective checkpointing, ops the compiler fused are recomputed, not saved.
Compilation is lazy (the first forward), after the kernel registry has filled the kernel slots.

On one rank (``LocalDispatcher``, no hooks on the experts) the MoE path reads nothing back to the host, and the MoE
block compiles in one graph with the CUDA grouped GEMM (tests/test_compile.py); whole blocks, experts included, are
not compiled: on one H200 this per-submodule compile measured no faster than eager (docs/results.md#compile), the eager
path's elementwise work being Triton kernels already.
"""

from __future__ import annotations

import torch.nn as nn

from models import ModelSpec


def apply_compile(model: nn.Module, spec: ModelSpec, backend: str = "inductor") -> list[str]:
    """Compile, in place, each submodule of every block outside the path to its experts; returns their names
    (relative to the model)."""
    compiled = []
    for index, block in enumerate(model.get_submodule(spec.blocks)):
        prefix = f"{spec.blocks}.{index}"
        module, path = block, spec.experts.split(".")
        for depth, eager_child in enumerate(path):  # descend towards the experts, compiling the siblings
            for name, child in module.named_children():
                if name != eager_child and not _is_torch_builtin(child):
                    child.compile(backend=backend, fullgraph=True)
                    compiled.append(".".join([prefix, *path[:depth], name]))
            module = module.get_submodule(eager_child)
    return compiled


def _is_torch_builtin(module: nn.Module) -> bool:
    """A torch.nn module (a lone ``nn.Linear`` gate): one op, nothing to fuse, and dynamo skips torch.nn's own
    frames, so compiling it with fullgraph=True fails with "found no compiled frames"."""
    return type(module).__module__.startswith("torch.")
