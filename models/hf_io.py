"""Hugging Face interop for every registered family: config.json <-> Args, safetensors <-> our parameters.

Generic over the ``ModelSpec`` registry. What a family spells differently lives in its ``hf_names`` module
(``ModelSpec.hf_names``, e.g. ``models/qwen3_moe/hf_names.py``), which provides:

- ``EXPERT_WEIGHTS``: fused expert parameter -> per-expert on-disk tensors (``<experts>.J.<part>``) that are
  concatenated along dim 0 and stacked over J to make it;
- ``arch_from_config(cfg) -> dict`` (Args fields) and ``config_from_arch(args) -> dict`` (config.json keys);
- ``unsupported(cfg) -> list[str]``: features switched on in config.json that the family does not implement.

On-disk prefixes that differ from ours (multimodal nesting) come from ``ModelSpec.hf_prefixes``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Shard

from models import ModelSpec, build_args, get_spec

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def _hf_names(spec: ModelSpec) -> ModuleType:
    return importlib.import_module(spec.hf_names.format(model_type=spec.model_type))


# ---------------------------------------------------------------------------------------------- config.json


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir}")
    return json.loads(path.read_text())


def args_from_hf_config(cfg: dict[str, Any]) -> tuple[str, Any]:
    """(model_type, the family's Args) from a config.json dict; keys we do not model are ignored, features
    we do not implement raise."""
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ValueError("config.json has no model_type")
    names = _hf_names(get_spec(model_type))
    problems = names.unsupported(cfg)
    if problems:
        raise ValueError(f"config.json ({model_type}) uses features not implemented here: {'; '.join(problems)}")
    return model_type, build_args(model_type, names.arch_from_config(cfg))


def preset_differences(args: Any, cfg: dict[str, Any]) -> list[str]:
    """'field: preset X vs config.json Y' for every Args field where ``args`` and config.json disagree."""
    model_type, hf_args = args_from_hf_config(cfg)
    if type(hf_args) is not type(args):
        return [f"model_type: preset {type(args).__name__} vs config.json {model_type}"]
    return [f"{f.name}: preset {getattr(args, f.name)!r} vs config.json {getattr(hf_args, f.name)!r}"
            for f in dataclasses.fields(args) if getattr(args, f.name) != getattr(hf_args, f.name)]


# ---------------------------------------------------------------------------------------------- names


def _to_ours(spec: ModelSpec, disk_name: str) -> str | None:
    for disk, ours in spec.hf_prefixes:
        if disk_name.startswith(disk):
            return ours + disk_name[len(disk):]
    return None  # not part of our model (e.g. a vision tower or an MTP head of a multimodal checkpoint)


def _to_disk(spec: ModelSpec, name: str) -> str:
    for disk, ours in spec.hf_prefixes:
        if name.startswith(ours):
            return disk + name[len(ours):]
    raise ValueError(f"{name} is under none of the {spec.model_type} hf_prefixes {spec.hf_prefixes}")


def _experts_module_re(spec: ModelSpec) -> str:
    return rf"{re.escape(spec.blocks)}\.\d+\.{re.escape(spec.experts)}"


# ---------------------------------------------------------------------------------------------- reading


def _checkpoint_files(hf_dir: Path) -> list[Path]:
    if (hf_dir / INDEX).is_file():
        weight_map = json.loads((hf_dir / INDEX).read_text())["weight_map"]
        return [hf_dir / name for name in sorted(set(weight_map.values()))]
    if (hf_dir / SAFETENSORS).is_file():
        return [hf_dir / SAFETENSORS]
    raise FileNotFoundError(f"neither {INDEX} nor {SAFETENSORS} in {hf_dir}")


def load_hf_state_dict(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face directory in our names (family from its config.json). Per-expert
    tensors are stacked into the fused ones; fused tensors on disk are taken as they are."""
    hf_dir = Path(hf_dir)
    spec = get_spec(read_hf_config(hf_dir)["model_type"])
    expert_weights: dict[str, tuple[str, ...]] = _hf_names(spec).EXPERT_WEIGHTS
    part_of = {part: (fused, i) for fused, parts in expert_weights.items() for i, part in enumerate(parts)}
    per_expert_re = re.compile(rf"^({_experts_module_re(spec)})\.(\d+)\.(.+)$")
    state: dict[str, torch.Tensor] = {}
    # fused name -> {(part index, expert): [rows, cols]}
    per_expert: dict[str, dict[tuple[int, int], torch.Tensor]] = defaultdict(dict)
    for path in _checkpoint_files(hf_dir):
        with safe_open(path, framework="pt") as f:
            for disk_name in f.keys():
                name = _to_ours(spec, disk_name)
                if name is None:
                    continue
                match = per_expert_re.match(name)
                if match and match[3] in part_of:
                    fused, i = part_of[match[3]]
                    per_expert[f"{match[1]}.{fused}"][i, int(match[2])] = f.get_tensor(disk_name)
                else:
                    state[name] = f.get_tensor(disk_name)
    state.update(_stack_experts(per_expert, expert_weights))
    return state


def _stack_experts(per_expert: dict[str, dict[tuple[int, int], torch.Tensor]],
                   expert_weights: dict[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """{fused name: {(part, expert): [R, C]}} -> {fused name: [E, parts x R, C]}; raises on any gap."""
    stacked, gaps = {}, []
    for name, tensors in per_expert.items():
        module, fused = name.rsplit(".", 1)
        parts = expert_weights[fused]
        num_experts = 1 + max(j for _, j in tensors)
        absent = [f"{module}.{j}.{part}" for j in range(num_experts) for i, part in enumerate(parts)
                  if (i, j) not in tensors]
        if absent:
            gaps += absent
            continue
        stacked[name] = torch.stack([torch.cat([tensors[i, j] for i in range(len(parts))])
                                     for j in range(num_experts)])
    if gaps:
        raise ValueError(f"checkpoint lacks {len(gaps)} per-expert tensors (our names): {', '.join(gaps)}")
    return stacked


# ---------------------------------------------------------------------------------------------- loading


def check_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise one ValueError listing every missing, unexpected and mis-shaped tensor (global shapes)."""
    shapes: dict[str, torch.Size] = {}
    tied: dict[int, list[str]] = defaultdict(list)  # one tensor under several names: any one name will do
    for name, param in model.named_parameters(remove_duplicate=False):
        shapes[name] = param.shape
        tied[id(param)].append(name)
    missing = [names[0] for names in tied.values() if not any(n in state_dict for n in names)]
    unexpected = sorted(set(state_dict) - set(shapes))
    misshaped = [f"{n} (checkpoint {tuple(state_dict[n].shape)}, model {tuple(shape)})"
                 for n, shape in shapes.items() if n in state_dict and state_dict[n].shape != shape]
    if missing or unexpected or misshaped:
        lines = [f"{label} ({len(names)}): {', '.join(names)}"
                 for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
                 if names]
        raise ValueError("state dict does not match the model:\n  " + "\n  ".join(lines))


def local_slice(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's part of ``full`` laid out like ``param``: every Shard(d) placement narrows dim d to this
    rank's chunk on that mesh dim, as torch.chunk does (ceil(size / n) each, so tail chunks may be short or
    empty); Replicate keeps the dim whole. Placements apply left to right, as DTensor's do."""
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"rank {dist.get_rank()} is not in the parameter's mesh {mesh}")
    local = full
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard:  # _StridedShard (FSDP over TP) and Partial lay data out differently
            raise NotImplementedError(f"loading into a DTensor placed {placement} on mesh dim {mesh_dim}")
        size = local.shape[placement.dim]
        chunk = -(-size // mesh.size(mesh_dim))
        start = min(coordinate[mesh_dim] * chunk, size)
        local = local.narrow(placement.dim, start, min(chunk, size - start))
    return local


@torch.no_grad()
def load_into_model(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors (our names) into the model's parameters, plain or DTensor (this rank's slice).
    Checks everything first, so a mismatch raises before any parameter changes."""
    check_state_dict(model, state_dict)
    for name, param in model.named_parameters(remove_duplicate=False):
        if name not in state_dict:
            continue  # a tied alias, filled under its other name
        if isinstance(param, DTensor):
            local, src = param.to_local(), local_slice(state_dict[name], param)
            if local.shape != src.shape:  # copy_ would broadcast instead of failing
                raise RuntimeError(f"{name}: local shard {tuple(local.shape)} but slice {tuple(src.shape)}")
            local.copy_(src)
        else:
            param.copy_(state_dict[name])


# ---------------------------------------------------------------------------------------------- export


def _disk_tensors(spec: ModelSpec, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict in on-disk names, fused experts split per expert (views: no copies yet)."""
    expert_weights: dict[str, tuple[str, ...]] = _hf_names(spec).EXPERT_WEIGHTS
    fused_re = re.compile(rf"^({_experts_module_re(spec)})\.({'|'.join(map(re.escape, expert_weights))})$")
    out = {}
    for name in sorted(state):
        match = fused_re.match(name)
        if match is None:
            out[_to_disk(spec, name)] = state[name]
            continue
        parts = expert_weights[match[2]]
        for j, w_RC in enumerate(state[name]):  # R = parts x rows of one part
            for part, w_part in zip(parts, w_RC.chunk(len(parts), dim=0)):
                out[_to_disk(spec, f"{match[1]}.{j}.{part}")] = w_part
    return out


def _plan_shards(tensors: dict[str, torch.Tensor], dtype: torch.dtype, max_shard_bytes: int) -> list[list[str]]:
    """Consecutive names packed greedily into shards of at most max_shard_bytes (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_checkpoint(out_dir: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                      max_shard_bytes: int) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index when over max_shard_bytes."""
    shards = _plan_shards(tensors, dtype, max_shard_bytes)
    files = ([SAFETENSORS] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, names in zip(files, shards):
        # Own contiguous copies: safetensors refuses tensors that share storage (our per-expert views do).
        shard = {n: tensors[n].to(dtype=dtype, memory_format=torch.contiguous_format, copy=True) for n in names}
        save_file(shard, out_dir / file, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * dtype.itemsize for t in tensors.values())},
                 "weight_map": {n: file for file, names in zip(files, shards) for n in names}}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _replace_dir(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Write into a temporary sibling, then rename it to out_dir: nobody sees a half-written directory."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
    except BaseException:
        shutil.rmtree(tmp)
        raise
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
        os.rename(out_dir, old / out_dir.name)
        os.rename(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out_dir)


def export_state_dict_hf(state_dict: Mapping[str, torch.Tensor], model_type: str, args: Any,
                         out_dir: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                         dtype: torch.dtype | None = None) -> None:
    """Write full tensors in our names as a directory ``transformers.AutoModelForCausalLM.from_pretrained``
    loads: safetensors in on-disk names (sharded past max_shard_bytes) and config.json. ``dtype``: cast to
    it (default: keep the state dict's)."""
    spec = get_spec(model_type)
    with torch.device("meta"):
        check_state_dict(spec.model_cls(args), state_dict)
    dtype = dtype or next(iter(state_dict.values())).dtype
    config = {"architectures": [spec.hf_architecture], "model_type": model_type,
              **_hf_names(spec).config_from_arch(args), "torch_dtype": str(dtype).removeprefix("torch.")}
    tensors = _disk_tensors(spec, state_dict)

    def write(tmp: Path) -> None:
        _write_checkpoint(tmp, tensors, dtype, max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    _replace_dir(Path(out_dir), write)


def export_hf(model: nn.Module, model_type: str, out_dir: str | os.PathLike, *,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: torch.dtype | None = None) -> None:
    """``export_state_dict_hf`` of a live model. DTensor parameters are gathered one at a time, a collective:
    with a sharded model call this on every rank; global rank 0 writes."""
    writer = not dist.is_initialized() or dist.get_rank() == 0
    state = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if writer:
            state[name] = full.detach().cpu()
    if writer:
        export_state_dict_hf(state, model_type, model.args, out_dir, max_shard_bytes=max_shard_bytes, dtype=dtype)
