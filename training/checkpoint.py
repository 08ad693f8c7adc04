"""Writing model weights: full (unsharded) tensors in safetensors, written atomically."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full CPU tensor. Collective under sharding: every rank must call it."""
    out = {}
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        out[name] = tensor.detach().to("cpu").contiguous()
    if getattr(getattr(model, "args", None), "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)  # safetensors refuses shared storage; it is embed_tokens.weight
    return out


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
                            ) -> None:
    """Write to a temporary file beside ``path`` and rename: a crash never leaves a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_model_weights(model: nn.Module, path: Path, is_writer: bool) -> None:
    tensors = full_state_dict(model)
    if is_writer:
        atomic_save_safetensors(tensors, path, metadata={"format": "pt"})
