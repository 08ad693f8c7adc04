"""Hugging Face interop for every registered family: config.json <-> Args, safetensors <-> our parameters.

Generic over the ``ModelSpec`` registry. Every family's experts are ``GroupedExperts`` (fused ``gate_up_proj``,
``down_proj``), stored per expert on disk as ``EXPERT_WEIGHTS`` below says. What a family spells differently lives
in its ``hf_names`` module (``ModelSpec.hf_names``, e.g. ``models/qwen3_moe/hf_names.py``), which provides:

- ``arch_from_config(cfg) -> dict`` (Args fields) and ``config_from_arch(args) -> dict`` (config.json keys);
- ``unsupported(cfg) -> list[str]``: features switched on in config.json that the family does not implement.

On-disk prefixes that differ from ours (multimodal nesting) come from ``ModelSpec.hf_prefixes``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import signal
import stat
import struct
import tempfile
import threading
from collections import defaultdict
from pathlib import Path
from types import ModuleType
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from core.files import LockHeld, hold_lock_file, remove, stale_temporaries, write_failure
from core.safetensors_stream import TensorLayout, stream_gathered, torch_dtype, write_safetensors
from models import ModelSpec, build_args, get_spec
from models.init import local_box
from models.moe import TopKRouter

logger = logging.getLogger(__name__)

# Fused expert parameter -> the per-expert on-disk tensors (under ``<experts>.J.``) that are concatenated along
# dim 0 and stacked over J to make it (hub checkpoints and transformers 5's save_pretrained).
EXPERT_WEIGHTS: dict[str, tuple[str, ...]] = {
    "gate_up_proj": ("gate_proj.weight", "up_proj.weight"),
    "down_proj": ("down_proj.weight",),
}

# A per-expert on-disk tensor -> (the fused parameter it is part of, its place among the parts).
_PART_OF = {part: (fused, i) for fused, parts in EXPERT_WEIGHTS.items() for i, part in enumerate(parts)}

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
HF_FORMAT_VERSION = "5.24.0"  # config.json's transformers_version: the oldest transformers the export is tested with
# Written into every export, listing its files: an export replaces its directory wholesale, so only a directory that
# holds nothing but an earlier export (the files its record lists) may be replaced; a run, its parent, or a user's
# files never are.
EXPORT_RECORD = ".hf_export.json"


def _hf_names(spec: ModelSpec) -> ModuleType:
    return importlib.import_module(spec.hf_names.format(model_type=spec.model_type))


# ---------------------------------------------------------------------------------------------- config.json


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir}")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); is model.init_from a Hugging Face model directory?") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{path} has no model_type; is model.init_from a Hugging Face model directory?")
    return config


def args_from_hf_config(cfg: dict[str, Any], vision: bool = False) -> tuple[str, Any]:
    """(model_type, the family's Args) from a config.json dict; keys we do not model are ignored, features
    we do not implement raise. ``vision``: with its vision tower (``models.build_args``)."""
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ValueError("config.json has no model_type")
    names = _hf_names(get_spec(model_type))
    problems = names.unsupported(cfg)
    if problems:
        raise ValueError(f"config.json ({model_type}) uses features not implemented here: {'; '.join(problems)}")
    return model_type, build_args(model_type, names.arch_from_config(cfg), vision)


def preset_differences(args: Any, cfg: dict[str, Any]) -> list[str]:
    """'field: preset X vs config.json Y' for every Args field where ``args`` and config.json disagree, by name."""
    model_type, hf_args = args_from_hf_config(cfg)
    if type(hf_args) is not type(args):
        return [f"model_type: preset {type(args).__name__} vs config.json {model_type}"]
    return [f"{f.name}: preset {getattr(args, f.name)!r} vs config.json {getattr(hf_args, f.name)!r}"
            for f in sorted(dataclasses.fields(args), key=lambda f: f.name)
            if getattr(args, f.name) != getattr(hf_args, f.name)]


# ---------------------------------------------------------------------------------------------- names


def _to_ours(spec: ModelSpec, disk_name: str, mtp: bool = True, vision: bool = True) -> str | None:
    """Our name of a checkpoint's tensor; None: not part of our model (``mtp`` False: the MTP head, for a model built
    without one; ``vision`` False: the vision tower, likewise)."""
    for disk, ours in spec.hf_prefixes:
        if disk_name.startswith(disk) and (mtp or not _is_mtp(spec, ours)) and (vision or not _is_vision(spec, ours)):
            return ours + disk_name[len(disk):]
    return None


def _is_vision(spec: ModelSpec, name: str) -> bool:
    """Whether our ``name`` (or prefix) is the vision tower's: built only where the run trains it."""
    return spec.vision is not None and name.startswith(spec.vision + ".")


def _is_mtp(spec: ModelSpec, name: str) -> bool:
    """Whether our ``name`` (or prefix) is the MTP head's: built only where the model trains it."""
    return spec.mtp_blocks is not None and name.startswith(spec.mtp_blocks.partition(".")[0] + ".")


def _to_disk(spec: ModelSpec, name: str) -> str:
    for disk, ours in spec.hf_prefixes:
        if name.startswith(ours):
            return disk + name[len(ours):]
    raise ValueError(f"{name} is under none of the {spec.model_type} hf_prefixes {spec.hf_prefixes}")


def _experts_module_re(spec: ModelSpec) -> str:
    blocks = "|".join(re.escape(name) for name in (spec.blocks, spec.mtp_blocks) if name)
    return rf"(?:{blocks})\.\d+\.{re.escape(spec.experts)}"


# ---------------------------------------------------------------------------------------------- reading


def _open_safetensors(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (named by {path.parent / INDEX})")
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # safetensors reports a damaged header as its own error type
        raise ValueError(f"{path} is not a readable safetensors file ({e}); is it truncated?") from None


def source_roots(hf_dir: str | os.PathLike) -> list[Path]:
    """Where the files of a Hugging Face directory may lie: in it (symbolic links resolved), and for a snapshot of
    the hub's cache (``models--org--name/snapshots/<revision>``, whose files are links into the repository's
    ``blobs/``), in that ``blobs/`` too. Nothing a checkpoint names is read from anywhere else."""
    root = Path(hf_dir).resolve()
    blobs = root.parent.parent / "blobs"
    return [root, blobs] if root.parent.name == "snapshots" and blobs.is_dir() else [root]


def _within(path: Path, roots: Sequence[Path]) -> bool:
    resolved = path.resolve()
    return any(resolved == root or root in resolved.parents for root in roots)


def check_inside_source(hf_dir: str | os.PathLike, path: Path, named_by: str) -> Path:
    """``path`` (named by ``named_by``), refused unless it lies inside ``hf_dir`` (``source_roots``): an index entry
    ``../x.safetensors``, an absolute path, a symbolic link out of it."""
    if not _within(path, source_roots(hf_dir)):
        raise ValueError(f"{named_by} names {path}, which resolves to {path.resolve()}, outside {hf_dir}: a checkpoint "
                         "is read only from its own directory; put the file in it (not a link out of it)")
    return path


def _weight_map(hf_dir: Path) -> dict[str, Path] | None:
    """The index's tensor name -> its shard (each checked to lie in ``hf_dir``), or None without an index."""
    if not (hf_dir / INDEX).is_file():
        return None
    try:
        weight_map = json.loads((hf_dir / INDEX).read_text())["weight_map"]
        files = {file: None for file in weight_map.values()}  # a TypeError where it is not a mapping of strings
        if not all(isinstance(name, str) and isinstance(file, str) for name, file in weight_map.items()):
            raise TypeError("its entries are not strings")
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{hf_dir / INDEX} is not a safetensors index with a weight_map ({e!r})") from None
    for file in files:
        if Path(file).is_absolute() or ".." in Path(file).parts:
            raise ValueError(f"{hf_dir / INDEX} names the shard {file!r}, outside {hf_dir}: a checkpoint is read "
                             "only from its own directory; name its shards by their file names")
        check_inside_source(hf_dir, hf_dir / file, str(hf_dir / INDEX))
    return {name: hf_dir / file for name, file in weight_map.items()}


def _checkpoint_files(hf_dir: Path, weight_map: dict[str, Path] | None = None) -> list[Path]:
    weight_map = weight_map or _weight_map(hf_dir)
    if weight_map is not None:
        return sorted(set(weight_map.values()))
    if (hf_dir / SAFETENSORS).is_file():
        return [check_inside_source(hf_dir, hf_dir / SAFETENSORS, f"{hf_dir} (its {SAFETENSORS})")]
    raise FileNotFoundError(f"neither {INDEX} nor {SAFETENSORS} in {hf_dir}")


def _shard_tensors(hf_dir: Path, stack: contextlib.ExitStack) -> Iterator[tuple[Path, Any, list[str]]]:
    """(shard, its open safetensors, the names to read from it) for every shard of ``hf_dir``. With an index, its
    mapping is the truth: a tensor in two shards, one the index names but its shard lacks, or one it does not list
    is refused by name (before: the copy of the other file won, or the tensor was dropped)."""
    weight_map = _weight_map(hf_dir)
    opened = {path: stack.enter_context(_open_safetensors(path)) for path in _checkpoint_files(hf_dir, weight_map)}
    keys = {path: list(f.keys()) for path, f in opened.items()}
    if weight_map is not None:
        problems = []
        for path, names in keys.items():
            for name in names:
                if name not in weight_map:
                    problems.append(f"{path.name} holds {name}, which the index does not list")
                elif weight_map[name] != path:
                    problems.append(f"{name} is in {path.name} and in {weight_map[name].name}, which the index names "
                                    "(a tensor is stored once)")
        held = {path: set(names) for path, names in keys.items()}
        problems += [f"{name} is not in {path.name}, where the index puts it" for name, path in weight_map.items()
                     if name not in held[path]]
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise ValueError(f"{hf_dir / INDEX} does not match its shards: {shown}. Its weight_map must name each "
                             "tensor once, in the shard that holds it: repair the checkpoint (or download it again)")
    for path, f in opened.items():
        yield path, f, keys[path]


@dataclass(frozen=True)
class _Source:
    """One of our tensors as stored on disk: its global shape and a reader of any box of it, so that each
    rank reads only the slice it owns (safetensors slices are read lazily from the memory-mapped file)."""

    shape: tuple[int, ...]
    read: Callable[[tuple[slice, ...]], torch.Tensor]
    dtype: str  # as safetensors names it (F32, BF16, I8, ...); a fused tensor: a non-floating part's, if any


def _floating(safetensors_dtype: str) -> bool:
    return safetensors_dtype.startswith(("F", "BF"))  # F64 ... F8_E5M2, BF16; not I*, U*, BOOL, C64


def _non_floating_dtype(value: Any) -> str | None:
    """The dtype of a full tensor or an on-disk _Source that holds no floating-point values; None if it does."""
    if isinstance(value, _Source):
        return None if _floating(value.dtype) else value.dtype
    return None if value.dtype.is_floating_point else str(value.dtype).removeprefix("torch.")


def _whole(shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def _direct_source(f: Any, disk_name: str) -> _Source:
    handle = f.get_slice(disk_name)
    return _Source(tuple(handle.get_shape()), lambda box: handle[box], handle.get_dtype())


def _fused_source(parts_by_expert: list[list[Any]]) -> _Source:
    """Experts stored one by one, part by part ([rows, cols] each), seen as the fused [E, parts x rows, cols]."""
    rows, cols = parts_by_expert[0][0].get_shape()
    num_parts = len(parts_by_expert[0])

    def read(box: tuple[slice, ...]) -> torch.Tensor:
        experts, row_range, col_range = box
        stacked = []
        for parts in parts_by_expert[experts]:
            pieces = []
            for i, part in enumerate(parts):  # the rows of part i are [i*rows, (i+1)*rows) of the fused expert
                lo, hi = max(row_range.start, i * rows), min(row_range.stop, (i + 1) * rows)
                if lo < hi:
                    pieces.append(part[lo - i * rows:hi - i * rows, col_range])
            stacked.append(torch.cat(pieces) if pieces else torch.empty(0, col_range.stop - col_range.start))
        return torch.stack(stacked) if stacked else torch.empty(0, row_range.stop - row_range.start,
                                                                 col_range.stop - col_range.start)

    dtypes = [part.get_dtype() for parts in parts_by_expert for part in parts]
    dtype = next((d for d in dtypes if not _floating(d)), dtypes[0])
    return _Source((len(parts_by_expert), num_parts * rows, cols), read, dtype)


@contextlib.contextmanager
def _disk_sources(hf_dir: str | os.PathLike, mtp: bool = False, vision: bool = False) -> Iterator[dict[str, _Source]]:
    """Our name -> _Source for every tensor of a Hugging Face directory that belongs to our model (family
    from its config.json; ``mtp``: with its MTP head; ``vision``: with its vision tower). Per-expert tensors become
    one fused source; raises listing any missing expert."""
    hf_dir = Path(hf_dir)
    spec = get_spec(read_hf_config(hf_dir)["model_type"])
    per_expert_re = re.compile(rf"^({_experts_module_re(spec)})\.(\d+)\.(.+)$")
    sources: dict[str, _Source] = {}
    per_expert: dict[str, dict[tuple[int, int], Any]] = defaultdict(dict)  # fused name -> {(part, expert): slice}
    skipped: list[str] = []
    with contextlib.ExitStack() as stack:
        for _, f, disk_names in _shard_tensors(hf_dir, stack):
            for disk_name in disk_names:
                name = _to_ours(spec, disk_name, mtp, vision)
                if name is None:
                    skipped.append(disk_name)
                    continue
                match = per_expert_re.match(name)
                if match and match[3] in _PART_OF:
                    fused, i = _PART_OF[match[3]]
                    per_expert[f"{match[1]}.{fused}"][i, int(match[2])] = f.get_slice(disk_name)
                else:
                    sources[name] = _direct_source(f, disk_name)
        gaps = []
        for name, handles in per_expert.items():
            module, fused = name.rsplit(".", 1)
            parts = EXPERT_WEIGHTS[fused]
            num_experts = 1 + max(j for _, j in handles)
            absent = [f"{module}.{j}.{part}" for j in range(num_experts) for i, part in enumerate(parts)
                      if (i, j) not in handles]
            gaps += absent
            if not absent:
                sources[name] = _fused_source([[handles[i, j] for i in range(len(parts))]
                                               for j in range(num_experts)])
        if gaps:
            raise ValueError(f"checkpoint lacks {len(gaps)} per-expert tensors (our names): {', '.join(gaps)}")
        if skipped:
            groups = sorted({".".join(name.split(".")[:2]) for name in skipped})
            logger.info("%s: %d tensors are not part of the %s model built and are not trained (%s); an export of "
                        "the run copies them from here unchanged", hf_dir, len(skipped), spec.model_type,
                        ", ".join(groups))
        yield sources


def load_hf_state_dict(hf_dir: str | os.PathLike, mtp: bool = False, vision: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face directory in our names, as full tensors (``mtp``: the MTP head's too; ``vision``:
    the vision tower's too). Per-expert tensors are stacked into the fused ones; fused tensors on disk are taken as
    they are."""
    with _disk_sources(hf_dir, mtp, vision) as sources:
        return {name: src.read(_whole(src.shape)) for name, src in sources.items()}


# ---------------------------------------------------------------------------------------------- loading


def check_state_dict(model: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Raise one ValueError listing every missing, unexpected and mis-shaped tensor (global shapes), and every
    non-floating one for a floating parameter. Values need only a ``shape`` and a ``dtype``: full tensors, or the
    on-disk sources of a checkpoint not yet read."""
    shapes: dict[str, torch.Size] = {}
    dtypes: dict[str, torch.dtype] = {}
    tied: dict[int, list[str]] = defaultdict(list)  # one tensor under several names: any one name will do
    for name, param in model.named_parameters(remove_duplicate=False):
        shapes[name], dtypes[name] = param.shape, param.dtype
        tied[id(param)].append(name)
    missing = [names[0] for names in tied.values() if not any(n in state_dict for n in names)]
    unexpected = sorted(set(state_dict) - set(shapes))
    misshaped = [f"{n} (checkpoint {tuple(state_dict[n].shape)}, model {tuple(shape)})"
                 for n, shape in shapes.items() if n in state_dict and tuple(state_dict[n].shape) != tuple(shape)]
    # A copy into a floating parameter casts integers silently: quantized weights would load as their codes.
    integral = [f"{n} ({dtype} for a {str(dtypes[n]).removeprefix('torch.')} parameter)" for n in shapes
                if n in state_dict and dtypes[n].is_floating_point
                and (dtype := _non_floating_dtype(state_dict[n])) is not None]
    if missing or unexpected or misshaped or integral:
        lines = [f"{label} ({len(names)}): {', '.join(names)}"
                 for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped),
                                      ("not floating-point (quantized? dequantize it first)", integral))
                 if names]
        raise ValueError("state dict does not match the model:\n  " + "\n  ".join(lines))


def local_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` laid out like ``param``."""
    return full[local_box(param)]


@torch.no_grad()
def _copy_into(model: nn.Module, sources: Mapping[str, Any], read: Callable[[Any, tuple[slice, ...]], torch.Tensor]
               ) -> None:
    check_state_dict(model, sources)  # everything first: a mismatch raises before any parameter changes
    filled: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if name not in sources or id(param) in filled:
            continue  # a tied alias, filled under its first name (the embedding's: a stale lm_head.weight is not read)
        filled.add(id(param))
        local = param.to_local() if isinstance(param, DTensor) else param
        src = read(sources[name], local_box(param))
        if local.shape != src.shape:  # copy_ would broadcast instead of failing
            raise RuntimeError(f"{name}: local shard {tuple(local.shape)} but slice {tuple(src.shape)}")
        local.copy_(src)
    for module in model.modules():  # training state no Hugging Face checkpoint holds starts afresh
        if isinstance(module, TopKRouter):
            module.reset_expert_bias()


def load_into_model(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors (our names) into the model's parameters, plain or DTensor (this rank's slice)."""
    _copy_into(model, state_dict, lambda full, box: full[box])


def check_hf_into_model(model: nn.Module, hf_dir: str | os.PathLike) -> None:
    """``load_hf_into_model``'s check (names, global shapes, dtypes) against the safetensors headers alone, on the
    model still on the meta device: a config.json that its weights disagree with (vocab_size=2e8 beside 256 rows)
    is refused before its model is allocated."""
    with _disk_sources(hf_dir, mtp=model.mtp is not None, vision=_has_vision(model)) as sources:  # what loads
        try:
            check_state_dict(model, sources)
        except ValueError as e:
            raise ValueError(f"model.init_from={hf_dir}: its weights do not match the model its config.json describes "
                             f"(with model=hf; else model.arch): {e}") from None


def load_hf_into_model(model: nn.Module, hf_dir: str | os.PathLike) -> None:
    """Fill the model from a Hugging Face directory, each rank reading from disk only the slices it owns:
    host memory stays near one rank's share instead of the whole checkpoint."""
    spec = get_spec(read_hf_config(hf_dir)["model_type"])
    with _disk_sources(hf_dir, mtp=model.mtp is not None, vision=_has_vision(model)) as sources:
        if model.mtp is not None and not any(_is_mtp(spec, name) for name in sources):
            raise ValueError(f"model.arch.mtp_loss_weight={model.args.mtp_loss_weight} trains the MTP head, and "
                             f"{hf_dir} has none (no mtp.* tensors): start from a checkpoint that has one, or set "
                             "model.arch.mtp_loss_weight=0")
        _copy_into(model, sources, lambda src, box: src.read(box))


def _has_vision(model: nn.Module) -> bool:
    """Whether the model was built with its vision tower (``MoeCausalLM.visual``, model.vision=true)."""
    return getattr(model, "visual", None) is not None


# ---------------------------------------------------------------------------------------------- export


@dataclass(frozen=True)
class _DiskTensor:
    """One on-disk tensor of an export: ``full[index]`` of our tensor ``source`` (a contiguous view of it), or, for
    a tensor copied from the run's source checkpoint, that checkpoint's tensor ``source`` (index ``()``)."""

    name: str
    source: str
    index: tuple[int | slice, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def layout(self) -> TensorLayout:
        return TensorLayout(self.shape, self.dtype)


def _disk_tensors(spec: ModelSpec, shapes: Mapping[str, Sequence[int]], dtype: torch.dtype) -> list[_DiskTensor]:
    """Our tensors (global shapes) in on-disk names, fused experts split per expert, in the order they are
    written: our names sorted, each one's experts (and parts) in turn, so one tensor of ours at a time."""
    fused_re = re.compile(rf"^({_experts_module_re(spec)})\.({'|'.join(map(re.escape, EXPERT_WEIGHTS))})$")
    out = []
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        match = fused_re.match(name)
        if match is None:
            out.append(_DiskTensor(_to_disk(spec, name), name, (), shape, dtype))
            continue
        parts = EXPERT_WEIGHTS[match[2]]
        num_experts, rows, cols = shape  # rows: the parts' rows concatenated
        part_rows = rows // len(parts)
        for j in range(num_experts):
            for i, part in enumerate(parts):
                out.append(_DiskTensor(_to_disk(spec, f"{match[1]}.{j}.{part}"), name,
                                       (j, slice(i * part_rows, (i + 1) * part_rows)), (part_rows, cols), dtype))
    return out


def _plan_shards(tensors: list[_DiskTensor], max_shard_bytes: int) -> list[list[_DiskTensor]]:
    """Consecutive tensors packed greedily into shards of at most max_shard_bytes (a bigger tensor alone)."""
    shards: list[list[_DiskTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.layout.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.layout.nbytes
    return shards


def _disk_views(tensors: list[_DiskTensor], sources: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The on-disk tensors in order, as views of our full tensors, taken from ``sources`` (one per distinct
    ``source``, in order) when the first view of each is needed; the previous one is dropped then."""
    source, full = None, None
    for t in tensors:
        if t.source != source:
            source, full = t.source, None  # the previous one is not held while the next is gathered
            full = next(sources)
        yield full[t.index]


class ExportError(OSError):
    """A write of an export that failed (a full disk, a file-size limit), named in one line."""


@contextlib.contextmanager
def _named_failure(final: Path) -> Iterator[None]:
    """A failed write of the export's file ``final`` (written under its temporary name) as one ExportError naming it."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        message = write_failure(e, str(final), final.parent)
        if message is None or isinstance(e, ExportError):
            raise
        raise ExportError(f"{message}; nothing of the export was kept ({final.parent} is as it was)") from e


def _write_checkpoint(out_dir: Path, groups: list[tuple[list[_DiskTensor], Iterator[torch.Tensor]]],
                      max_shard_bytes: int, final: Path | None = None) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index when over max_shard_bytes, streamed: each
    group's (tensors, values) goes into shards of its own, ``values`` yielding the on-disk tensors in order, each
    written out before the next is taken. Within a group the tensors are in descending item size (one dtype: ours;
    the source's copied tensors sorted so)."""
    planned = [(shard, values) for tensors, values in groups for shard in _plan_shards(tensors, max_shard_bytes)]
    files = ([SAFETENSORS] if len(planned) == 1 else
             [f"model-{i + 1:05d}-of-{len(planned):05d}.safetensors" for i in range(len(planned))])
    final = final or out_dir  # where the files will be: what a failure names
    for file, (shard, values) in zip(files, planned):
        with _named_failure(final / file):
            write_safetensors(out_dir / file, {t.name: t.layout for t in shard}, values, metadata={"format": "pt"})
    if len(planned) > 1:
        index = {"metadata": {"total_size": sum(t.layout.nbytes for shard, _ in planned for t in shard)},
                 "weight_map": {t.name: file for file, (shard, _) in zip(files, planned) for t in shard}}
        with _named_failure(final / INDEX):
            (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")


# Files of the run's source directory an export copies as they are, beside its weights: the configs, the tokenizer's
# and the multimodal processors' (fnmatch patterns).
SOURCE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
                "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.json",
                "chat_template.jinja", "preprocessor_config.json", "video_preprocessor_config.json",
                "processor_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


@dataclass(frozen=True)
class ExportSource:
    """The Hugging Face directory a run started from (model.init_from), exported in its layout: its model_type's
    names (multimodal ``model.language_model.*``), its config and tokenizer files, and every tensor the run does not
    train, copied byte for byte (``untrained``: on-disk name -> (file, shape, dtype))."""

    path: Path
    spec: ModelSpec
    untrained: dict[str, tuple[Path, tuple[int, ...], torch.dtype]]

    def files(self) -> list[Path]:
        """The source's files an export copies; a symbolic link out of the source (``-> /etc/shadow``) is refused."""
        found = sorted(p for p in self.path.iterdir() if p.name in SOURCE_FILES and (p.is_file() or p.is_symlink()))
        for path in found:
            if not _within(path, source_roots(self.path)):
                raise ValueError(f"{path} is a symbolic link to {path.resolve()}, outside the source directory "
                                 f"{self.path}: an export copies no file from outside its source; replace the link "
                                 "with the file it stands for, or remove it")
        return [p for p in found if p.is_file()]

    def has_tokenizer(self) -> bool:
        return any((self.path / name).is_file() for name in _TOKENIZER_FILES)


def check_export_source(hf_dir: str | os.PathLike, model_type: str, args: Any) -> str:
    """The model_type of ``hf_dir``, a run's source directory, after checking that an export can carry it: it exists
    and its config.json describes the run's architecture (the same family, the same config.json keys), so that its
    config and the tensors the run does not train can be exported beside the trained ones. Raises ValueError."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ValueError(f"the run's source directory {hf_dir} (model.init_from) is gone, and an export copies the "
                         "tensors the run does not train from it: restore it, or export with scripts/export_hf.py "
                         "--source NEW_DIR (where it is now) or --source none (the trained model alone)")
    config = read_hf_config(hf_dir)
    # A run without the source's vision tower carries it: the text model is compared; with it, the tower too.
    source_type, source_args = args_from_hf_config(config, vision=getattr(args, "vision_config", None) is not None)
    names = _hf_names(get_spec(model_type))
    if (get_spec(source_type).args_cls is not get_spec(model_type).args_cls
            or names.config_from_arch(source_args) != names.config_from_arch(args)):
        raise ValueError(f"the run's architecture is not the one {hf_dir}/config.json describes "
                         f"({'; '.join(preset_differences(args, config))}), so an export cannot carry that "
                         "directory's config and untrained tensors: train with model=hf, or export the trained model "
                         "alone (scripts/export_hf.py --source none)")
    return source_type


def export_source(hf_dir: str | os.PathLike, model_type: str, args: Any, trained: Sequence[str]) -> ExportSource:
    """What an export of a run started from ``hf_dir`` copies from it, for a model of ``model_type`` and ``args``
    whose tensors (our names, tied aliases included) are ``trained`` (``check_export_source`` first)."""
    hf_dir = Path(hf_dir)
    source_type = check_export_source(hf_dir, model_type, args)
    spec = get_spec(source_type)
    trained = set(trained)
    per_expert_re = re.compile(rf"^({_experts_module_re(spec)})\.\d+\.(.+)$")
    untrained = {}
    with contextlib.ExitStack() as stack:
        for path, f, disk_names in _shard_tensors(hf_dir, stack):
            for disk_name in disk_names:
                ours = _to_ours(spec, disk_name)
                match = per_expert_re.match(ours or "")
                if match and match[2] in _PART_OF:
                    ours = f"{match[1]}.{_PART_OF[match[2]][0]}"  # one of the per-expert parts of a fused tensor
                if ours not in trained:
                    handle = f.get_slice(disk_name)
                    untrained[disk_name] = (path, tuple(handle.get_shape()), torch_dtype(handle.get_dtype()))
    return ExportSource(hf_dir, spec, untrained)


def _trained_names(model_type: str, args: Any) -> list[str]:
    """Every name of the model's parameters, a tied alias too: what an export of a run writes from the run (the rest
    of its source is copied)."""
    with torch.device("meta"):
        return [n for n, _ in get_spec(model_type).model_cls(args).named_parameters(remove_duplicate=False)]


def _byte_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's [start, end) in the safetensors file (its header's data_offsets, after the header)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {name: (8 + size + entry["data_offsets"][0], 8 + size + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__"}


def _digest(carried: ExportSource) -> dict[str, Any]:
    """What an export carries from its source: a sha256 of each file it copies, and one over the untrained tensors
    (name, dtype, shape and raw bytes, in name order, wherever their shards put them); the trained tensors are not
    read. Its cost is that of reading the untrained tensors once (a vision tower, an untrained MTP head)."""
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in carried.files()}
    digest, total = hashlib.sha256(), 0
    ranges = {path: _byte_ranges(path) for path in {path for path, _, _ in carried.untrained.values()}}
    with contextlib.ExitStack() as stack:
        opened = {path: stack.enter_context(open(path, "rb")) for path in ranges}
        for name in sorted(carried.untrained):
            path, shape, dtype = carried.untrained[name]
            start, end = ranges[path][name]
            digest.update(f"{name} {str(dtype).removeprefix('torch.')} {list(shape)} {end - start}\n".encode())
            f = opened[path]
            f.seek(start)
            for _ in range(start, end, 8 << 20):
                digest.update(f.read(min(8 << 20, end - f.tell())))
            total += end - start
    return {"path": str(carried.path.resolve()), "files": files, "tensors": len(carried.untrained), "bytes": total,
            "sha256": digest.hexdigest()}


def record_source(hf_dir: str | os.PathLike, model_type: str, args: Any) -> dict[str, Any] | None:
    """What a run starting from ``hf_dir`` (model.init_from) would have its export carry, as a digest (``_digest``)
    the run records, so that an export refuses a source changed since; None where no export could carry it (an
    architecture other than its config.json's)."""
    try:
        return _digest(export_source(hf_dir, model_type, args, _trained_names(model_type, args)))
    except ValueError:
        return None


def _check_loaded(carried: ExportSource, loaded: dict[str, Any] | None) -> None:
    """Refuse a source whose carried files or untrained tensors differ from what the run loaded (``loaded``: its
    ``record_source``); a run that recorded none (older) is warned about."""
    if loaded is None:
        logger.warning("the run recorded no digest of what it loaded from %s (written before runs recorded one): the "
                       "export cannot check that the untrained tensors and files it copies from there are those the "
                       "run started from", carried.path)
        return
    now = _digest(carried)
    changed = [name for name in sorted(set(now["files"]) | set(loaded["files"]))
               if now["files"].get(name) != loaded["files"].get(name)]
    if [now[k] for k in ("tensors", "bytes", "sha256")] != [loaded.get(k) for k in ("tensors", "bytes", "sha256")]:
        changed.append(f"the {loaded.get('tensors')} tensors the run does not train ({now['tensors']} now)")
    if changed:
        raise ValueError(f"the source {carried.path} is not what the run loaded from model.init_from={loaded['path']}: "
                         f"{', '.join(changed)} changed since, and an export would put them beside a model trained "
                         "from the old ones: restore the source the run loaded (or give --source a copy of it), or "
                         "export the trained model alone (--source none)")


def check_export_apart(out_dir: str | os.PathLike, inputs: Sequence[tuple[str, str | os.PathLike | None]]) -> None:
    """Refuse an export directory that is, holds or lies inside one of ``inputs`` ((what, path)): the run's
    model.init_from (an earlier export the run started from would be replaced without a word), the source."""
    out = Path(out_dir).resolve()
    for what, path in inputs:
        if path is None or not Path(path).exists():
            continue
        path = Path(path).resolve()
        if out == path or path in out.parents or out in path.parents:
            where = "is" if out == path else "lies inside" if path in out.parents else "holds"
            raise ValueError(f"export directory {out_dir} {where} {what} ({path}): the export would replace the "
                             "model the run started from; choose another directory")


@contextlib.contextmanager
def _export_lock(out_dir: Path) -> Iterator[None]:
    """Hold ``out_dir`` for this export (``.<name>.export-lock`` beside it, removed at the end): a second export into
    it at the same time is refused, naming the first."""
    path = out_dir.parent / f".{out_dir.name}.export-lock"
    while True:
        try:
            handle = hold_lock_file(path)
        except LockHeld as e:
            raise ValueError(f"export directory {out_dir} is being written by another export ({e.holder}): wait for "
                             "it to end, or export into another directory") from None
        try:  # its holder may have removed it between our open and our lock: then take the new one
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        handle.close()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # while held: one who opened it before finds it gone and retries
        handle.close()


class ExportInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP during an export (or Ctrl-C): what is left is said in its one line."""


@contextlib.contextmanager
def _signals_end_the_export(out_dir: Path, state: dict[str, bool]) -> Iterator[None]:
    """SIGTERM and SIGHUP, where they would kill the process at once (their default; a handler of the process's own,
    train.py's, is kept), raise ExportInterrupted instead, so that the temporary folder goes and a line says so."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if state.get("swapped"):
            raise ExportInterrupted(f"{name} after the export to {out_dir} was complete")
        raise ExportInterrupted(f"{name}: the export to {out_dir} stopped; its temporary folder was removed and "
                                f"{out_dir} is as it was")

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig, handler in previous.items():
        if handler is signal.SIG_DFL:
            signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is signal.SIG_DFL:
                signal.signal(sig, handler)


def check_export_dir(out_dir: str | os.PathLike) -> None:
    """Raise ValueError unless ``out_dir`` may receive an export: absent, empty, or an earlier export (its
    EXPORT_RECORD lists every file in it). Anything else (a run directory, a folder of runs, a user's files) would
    be deleted by the replacement, so it is refused, naming what it holds."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"export directory {out_dir} is a file; choose a new or empty directory")
    entries = sorted(p.name for p in out_dir.iterdir()) if out_dir.exists() else []
    try:
        exported = set(json.loads((out_dir / EXPORT_RECORD).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):  # no record (or not ours): nothing in it is an export's
        exported = set()
    foreign = [name for name in entries
               if name != EXPORT_RECORD and not (name in exported and (out_dir / name).is_file())]
    if foreign:
        shown = ", ".join(foreign[:6]) + (f" and {len(foreign) - 6} more" if len(foreign) > 6 else "")
        what = "an earlier export with other files added" if exported else "not an earlier export"
        raise ValueError(f"export directory {out_dir} is {what} (it holds {shown}), and an export replaces its "
                         f"directory wholesale: choose a new or empty directory (only an export, marked by its "
                         f"{EXPORT_RECORD}, is replaced)")


@contextlib.contextmanager
def _unstoppable() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP held back (then delivered): what runs here is never cut in half."""
    blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)


def _replace_dir(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Write into a temporary sibling, then rename it to out_dir: nobody sees a half-written directory. Held for the
    export (``_export_lock``) and checked under the lock (``check_export_dir``); a failure, Ctrl-C, SIGTERM or SIGHUP
    removes the temporary folder and leaves out_dir as it was."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    state: dict[str, bool] = {}
    with _signals_end_the_export(out_dir, state), _export_lock(out_dir):
        check_export_dir(out_dir)
        for stale in stale_temporaries(out_dir.parent, out_dir.name):  # an earlier export's, killed
            logger.warning("removing %s, left by an export whose process is gone", stale)
            remove(stale)
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-{os.getpid()}-"))
        try:
            write(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private
        except BaseException as e:
            with _unstoppable():
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, KeyboardInterrupt) and not isinstance(e, ExportInterrupted):
                raise ExportInterrupted(f"Ctrl-C: the export to {out_dir} stopped; its temporary folder was removed "
                                        f"and {out_dir} is as it was") from None
            raise
        with _unstoppable():  # the swap is never cut in half
            if out_dir.exists():
                old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-{os.getpid()}-"))
                os.rename(out_dir, old / out_dir.name)
                os.rename(tmp, out_dir)
                shutil.rmtree(old)
            else:
                os.rename(tmp, out_dir)
            state["swapped"] = True


def _copy_file(source: Path, target: Path) -> None:
    """A source file's bytes, its permissions never widened (a private file stays private)."""
    shutil.copyfile(source, target)
    os.chmod(target, stat.S_IMODE(target.stat().st_mode) & stat.S_IMODE(source.stat().st_mode))


def _export(state: Mapping[str, torch.Tensor], model_type: str, args: Any, out_dir: str | os.PathLike,
            max_shard_bytes: int, dtype: torch.dtype, extra_files: Callable[[Path], None] | None,
            values: Iterator[torch.Tensor], source: str | os.PathLike | None,
            loaded: dict[str, Any] | None = None) -> None:
    """The export of ``state`` (full tensors or DTensors: only its names and global shapes are read), whose
    values stream from ``values``: its full tensors in ``dtype``, one at a time, in sorted-name order. ``source``:
    the run's model.init_from, exported in its layout with every tensor the run does not train (``export_source``),
    refused where it differs from what the run ``loaded`` (its ``record_source``)."""
    spec = get_spec(model_type)
    with torch.device("meta"):
        model = spec.model_cls(args)
    check_state_dict(model, state)
    check_export_apart(out_dir, [("the run's source directory (model.init_from)", source)])
    if source is not None:
        # Every name of the model's parameters is trained (a tied alias too): the rest of the source is copied.
        carried = export_source(source, model_type, args, _trained_names(model_type, args))
        _check_loaded(carried, loaded)
        spec = carried.spec
    else:
        carried = None
        # A model with its vision tower exports in its own (multimodal) layout, one without in the text layout.
        spec = get_spec(spec.hf_export_type) if spec.hf_export_type and not _has_vision(model) else spec
    config = {"architectures": [spec.hf_architecture], "model_type": spec.model_type,
              **_hf_names(spec).config_from_arch(args), "torch_dtype": str(dtype).removeprefix("torch."),
              # The transformers format written (the version the tests load it with). Without it, transformers 5.x
              # takes a >100k-token tokenizer beside it for an old Mistral one and warns of a wrong regex.
              "transformers_version": HF_FORMAT_VERSION}
    ours = _disk_tensors(spec, {name: t.shape for name, t in state.items()}, dtype)
    # The copied ones in descending item size, then by name (the writer's alignment rule within a file).
    copied = [] if carried is None else [
        _DiskTensor(name, name, (), shape, source_dtype) for name, (_, shape, source_dtype)
        in sorted(carried.untrained.items(), key=lambda item: (-item[1][2].itemsize, item[0]))]
    check_export_dir(out_dir)

    def write(tmp: Path) -> None:
        with contextlib.ExitStack() as stack:
            opened = {path: stack.enter_context(_open_safetensors(path))
                      for path in {path for path, _, _ in (carried.untrained.values() if carried else ())}}
            # The source's tensors are read one at a time, as each is written.
            from_source = (opened[carried.untrained[t.source][0]].get_tensor(t.source) for t in copied)
            _write_checkpoint(tmp, [(ours, _disk_views(ours, values))] + ([(copied, from_source)] if copied else []),
                              max_shard_bytes, final=Path(out_dir))
        with _named_failure(Path(out_dir) / "config.json"):
            if carried is None:
                (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for path in carried.files() if carried is not None else ():  # its config describes this architecture
            with _named_failure(Path(out_dir) / path.name):
                _copy_file(path, tmp / path.name)
        if extra_files is not None and (carried is None or not carried.has_tokenizer()):
            with _named_failure(Path(out_dir) / "tokenizer.json"):
                extra_files(tmp)
        files = sorted(p.name for p in tmp.iterdir())
        with _named_failure(Path(out_dir) / EXPORT_RECORD):
            (tmp / EXPORT_RECORD).write_text(json.dumps({"written_by": "qwen-moe-train", "files": files}) + "\n")

    _replace_dir(Path(out_dir), write)


def export_state_dict_hf(state_dict: Mapping[str, torch.Tensor], model_type: str, args: Any,
                         out_dir: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                         dtype: torch.dtype | None = None, extra_files: Callable[[Path], None] | None = None,
                         source: str | os.PathLike | None = None, loaded: dict[str, Any] | None = None) -> None:
    """Write full tensors in our names as a directory ``transformers.AutoModelForCausalLM.from_pretrained``
    loads: safetensors in on-disk names (sharded past max_shard_bytes) and config.json. ``dtype``: cast to
    it (default: keep the state dict's), one tensor at a time. ``extra_files(tmp)``, if given, is called with
    the temporary directory once the weights and config.json are in it, before it replaces ``out_dir`` (new, empty or
    an earlier export: ``check_export_dir``): it may
    add files (the tokenizer's) or rewrite config.json. The model's buffers in ``state_dict`` (the routers'
    aux-loss-free balancing biases: a training device transformers' routers do not have) are left out.

    ``source``: the Hugging Face directory the run started from (model.init_from). The export then has its layout
    (a multimodal checkpoint's names; the class that loaded it loads the export), its config.json, generation,
    tokenizer and processor files, and every tensor of it the model does not have (a vision tower; an MTP head not
    trained) byte for byte in its dtype, read from it one tensor at a time as it is written; ``extra_files`` runs
    only where it has no tokenizer files. ``loaded``: what the run recorded of ``source`` when it loaded it
    (``record_source``); a source that differs is refused.

    The export is held (a second one into ``out_dir`` at the same time is refused), nothing is kept of one that
    fails or is stopped (SIGTERM, SIGHUP, Ctrl-C: one line says so), and a failed write names its file."""
    with torch.device("meta"):
        buffers = {name for name, _ in get_spec(model_type).model_cls(args).named_buffers()}
    state_dict = {name: t for name, t in state_dict.items() if name not in buffers}
    dtype = dtype or next(iter(state_dict.values())).dtype
    _export(state_dict, model_type, args, out_dir, max_shard_bytes, dtype, extra_files,
            (state_dict[name].to(dtype) for name in sorted(state_dict)), source, loaded)


def export_hf(model: nn.Module, model_type: str, out_dir: str | os.PathLike, *,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: torch.dtype | None = None,
              extra_files: Callable[[Path], None] | None = None, source: str | os.PathLike | None = None,
              loaded: dict[str, Any] | None = None) -> None:
    """``export_state_dict_hf`` of a live model (default dtype: its first parameter's). Collective with a
    sharded model: every rank calls it; the parameters are gathered one at a time and global rank 0 streams
    each into the files (``stream_gathered``): its host memory holds one tensor, the other ranks' none.
    ``extra_files`` runs on rank 0 only; the ``source``'s untrained tensors are read by rank 0 alone."""
    writer = not dist.is_initialized() or dist.get_rank() == 0
    params = dict(model.named_parameters())  # a tied lm_head.weight is embed_tokens.weight: one name
    dtype = dtype or next(iter(params.values())).dtype

    def write(values: Iterator[torch.Tensor]) -> None:
        _export(params, model_type, model.args, out_dir, max_shard_bytes, dtype, extra_files, values, source, loaded)

    stream_gathered(params, sorted(params), write if writer else None, dtype=dtype)
