"""Activation checkpointing of the decoder blocks: none, full (recompute the whole block in backward), selective
(keep the outputs of the expensive ops, recompute the cheap elementwise ones) or full_keep_exchange (recompute the
whole block but its exchanges: what each all-to-all received, EP's and CP's, is kept from the forward, so the
recompute sends nothing again; its counts' host read reads the kept counts). full_keep_exchange keeps, per token
and layer, full's block input and the exchanges' outputs: selective's all-to-all part (training/planner.py).

The composable ``checkpoint`` hooks the block in place, so parameter names (and with them state dicts,
loaders and FSDP units) stay exactly as without checkpointing; a wrapper module would add a prefix.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from core.torch_compat import (C10D_FUNCTIONAL, PROFILER_RANGE_OPS, SAC_PRIVATE_ATTENTION_OPS, SAC_PRIVATE_GEMM_OPS,
                               checkpoint, op_schema_name)

# Saved under selective checkpointing: matmuls and attention (the FLOPs) and the collectives (recomputing an
# all-to-all would repeat the communication and its host sync in backward).
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    *SAC_PRIVATE_ATTENTION_OPS,  # SDPA's backends
    *SAC_PRIVATE_GEMM_OPS,  # the experts' grouped GEMM; train.float8: Float8Linear's and the experts' FP8 GEMMs
    C10D_FUNCTIONAL.all_to_all_single.default,
}
# torch_npu's ops of the same kinds (the grouped matmul; the MC2 all-to-alls fused with it), by name: torch.ops.npu
# exists only once torch_npu is imported, which machines without an NPU never do.
_SAVED_NPU_OPS = {"npu::npu_grouped_matmul", "npu::npu_alltoallv_gmm", "npu::npu_gmm_alltoallv"}


# Profiler ranges are markers, nothing to save or recompute, yet SAC counts them as ops and fails a recompute that
# opens more of them than the forward did. A block's FSDP pre-forward hook opens one outside the checkpointed
# forward but inside its recompute (bf16: FSDP's input cast); while the experts were FSDP units the ranges of
# their own hooks inside the forward happened to cover it (seen with torch 2.13). Process-wide, set at import.
SAC_IGNORED_OPS.update(PROFILER_RANGE_OPS)


# Kept under full_keep_exchange: the exchanges alone (MC2's fuse the exchange into a grouped matmul: kept whole).
_EXCHANGE_OPS = {C10D_FUNCTIONAL.all_to_all_single.default}
_EXCHANGE_NPU_OPS = {"npu::npu_alltoallv_gmm", "npu::npu_gmm_alltoallv"}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    saved = op in _SAVED_OPS or (op.namespace == "npu" and op_schema_name(op) in _SAVED_NPU_OPS)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _exchange_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    saved = op in _EXCHANGE_OPS or (op.namespace == "npu" and op_schema_name(op) in _EXCHANGE_NPU_OPS)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(blocks: list[nn.Module] | nn.ModuleList, mode: str) -> None:
    """Checkpoint every block as ``mode`` says (a validated parallel.activation_checkpoint)."""
    if mode == "none":
        return
    policy = {"selective": _policy, "full_keep_exchange": _exchange_policy}.get(mode)
    context_fn = partial(create_selective_checkpoint_contexts, policy) if policy else None
    for block in blocks:
        checkpoint(block, context_fn=context_fn)
