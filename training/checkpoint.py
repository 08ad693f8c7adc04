"""Checkpoints: DCP for model + optimizer (resharding, so a run resumes on another layout), a small JSON
train state (step, schedule, data position, RNG), atomic directory renames, keep-last-N; and the final
weights as one safetensors file.

Layout: ``<root>/step_00000012/`` holds DCP's files plus ``train_state.json``, written last. A directory is
complete iff it has that name: saves go to ``<root>/.tmp-step_...`` and are renamed into place, so a crash
mid-save leaves the previous checkpoint usable. Nothing here unpickles: the train state is JSON and the
model/optimizer tensors are read by DCP, whose metadata pickle goes through an allowlist unpickler and whose
non-tensor items load with ``torch.load(weights_only=True)``: a crafted checkpoint cannot run code.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
import torch.nn as nn
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

logger = logging.getLogger("train")

TRAIN_STATE = "train_state.json"
PREFIX = "step_"


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N optimizer steps (0: never; a SIGTERM still saves when dir is known)
    dir: str | None = None  # None: <run_dir>/checkpoints
    keep_last: int = 3  # complete checkpoints kept (older ones are deleted)
    export_hf_at_end: bool = False  # also write <run_dir>/hf (sharded safetensors + config.json)


# What DCP's metadata pickle is made of (checked on torch 2.11-2.13): nothing else may be unpickled.
_METADATA_CLASSES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if ((module, name) in _METADATA_CLASSES or module == "torch.distributed.checkpoint.metadata"
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which DCP metadata never "
                                     "does; refusing to unpickle it")


class _SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read through the allowlist unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(Path(self.path) / name, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor items (optimizer hyper-parameters) loaded weights-only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _encode_rng(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state(dev_type: str) -> dict[str, str]:
    from training import device

    states = {"cpu": _encode_rng(torch.get_rng_state())}
    if dev_type != "cpu":
        states[dev_type] = _encode_rng(device.module(dev_type).get_rng_state().cpu())
    return states


def set_rng_state(states: dict[str, str], dev_type: str) -> None:
    from training import device

    torch.set_rng_state(_decode_rng(states["cpu"]))
    if dev_type != "cpu" and dev_type in states:
        device.module(dev_type).set_rng_state(_decode_rng(states[dev_type]))


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / TRAIN_STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def save_checkpoint(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    train_state: dict[str, Any], keep_last: int, is_writer: bool) -> Path:
    """Collective: every rank writes its shards; rank 0 publishes the directory by renaming it."""
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}"
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    _barrier()
    if is_writer:
        (tmp / TRAIN_STATE).write_text(json.dumps({"step": step, **train_state}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in complete_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("saved checkpoint %s", final)
    _barrier()
    return final


def resolve_resume(resume: str, root: Path) -> Path | None:
    """``none`` -> None; ``auto`` -> newest complete checkpoint under root (None if there is none); else a path."""
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / TRAIN_STATE).is_file():
        raise FileNotFoundError(f"train.resume={resume}: not a complete checkpoint (no {TRAIN_STATE} in it)")
    return path


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load model (and optimizer) state in place, resharding to the current layout; returns the train state."""
    try:
        train_state = json.loads((path / TRAIN_STATE).read_text())
        model_sd, optim_sd = get_state_dict(model, optimizer) if optimizer else (get_state_dict(model, [])[0], None)
        state = {"model": model_sd} if optim_sd is None else {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=_SafeReader(str(path)), planner=_SafePlanner())
    # DCP reports mismatches as assorted exception types (CheckpointException is a BaseException).
    except (Exception, CheckpointException) as e:
        raise RuntimeError(f"checkpoint {path} is corrupt or does not match this model/optimizer "
                           f"(was it saved with another model config?): {type(e).__name__}: {e}") from e
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return train_state


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
