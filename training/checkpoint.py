"""Checkpoints: DCP for model + optimizer (resharding, so a run resumes on another layout), a JSON train state
(step, schedule position, data position, RNG, the run's resolved config and a record of every file written),
atomic directory renames, keep-last-N; and the final weights as one safetensors file, streamed a tensor at a time.

Layout: ``<root>/step_00000012/`` holds DCP's files plus ``train_state.json``, written last. A directory is
complete iff it has that file: saves go to ``<root>/.tmp-step_...`` and are renamed into place, so a crash
mid-save leaves the previous checkpoint usable.

A resume is exact or refuses (``CheckpointError``, one message naming the file and the fix):
- nothing read can run code: the train state is JSON; DCP's metadata pickle goes through an unpickler that
  admits an explicit list of exact (module, name) pairs and nothing else; non-tensor items load with
  ``torch.load(weights_only=True)``;
- every file is checked against the sizes and CRC-32s recorded at save time (per 64 MiB block), so zeroed,
  truncated or missing shards are named before anything loads;
- the checkpoint's parameter and optimizer keys and shapes must equal the model's.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from core.files import (atomic_write, atomic_write_text, nearest_existing, record_paths, record_problems,
                        write_failure)
from core.safetensors_stream import layout_of, save_file_order, stream_gathered, write_safetensors
from core.torch_compat import DCP_METADATA_GLOBALS, flatten_state_dict, set_element

logger = logging.getLogger("train")

TRAIN_STATE = "train_state.json"
_STEP_DIR = re.compile(r"step_(\d{8,})")
_TRAIN_STATE_FIELDS = {"step": int, "scheduler.last_epoch": int, "loader.epoch": int, "loader.position": int,
                       "rng.cpu": str}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, or a run directory that must not be overwritten; the message names
    the file and the fix."""


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N optimizer steps (0: never; a SIGTERM still saves when dir is known)
    dir: str | None = None  # None: <run_dir>/checkpoints
    keep_last: int = 3  # complete checkpoints kept (older ones are deleted)
    export_hf_at_end: bool = False  # also write <run_dir>/hf (sharded safetensors + config.json)
    # With train.save_final: a checkpoint at the last step too, written before the final weights, so a run whose
    # weights cannot be written (a full disk) still resumes and writes them; false saves its disk space
    at_end: bool = True


# ------------------------------------------------------------------------------------------ safe reading
# Everything DCP's metadata pickle is made of (torch's globals: core.torch_compat), as exact (module, name) pairs.
# Names are compared whole, so pickle's dotted-name lookup (``metadata.os.system``) never happens.
_METADATA_GLOBALS = DCP_METADATA_GLOBALS | {
    ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath"),  # Python >= 3.13
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP metadata never does")


class _SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read through the allowlist unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except Exception as e:  # refused globals, truncation, garbage: all the same to the user
            raise CheckpointError(f"{path} is not DCP checkpoint metadata, refusing to load it ({e})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP checkpoint metadata")
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


# ------------------------------------------------------------------------------------------ file record
def record_files(paths: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """{name: {"bytes": size, "crc32": [one per 64 MiB block]}} (``core.files.record_paths`` by file name)."""
    return {p.name: record for p, record in record_paths(paths).items()}


def _file_problems(directory: Path, name: str, expected: dict[str, Any]) -> list[str]:
    path = directory / name
    return record_problems(name, expected, record_files([path])[name] if path.is_file() else None)


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (just ``[obj]`` without a process group). The objects are made here, never read
    from a file."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def verify_files(path: Path, record: dict[str, dict[str, Any]]) -> None:
    """Collective: check every recorded file's size and checksums, the files spread over the ranks."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    names = sorted(record)[rank::world]
    problems = [p for ranks in _gather([p for n in names for p in _file_problems(path, n, record[n])]) for p in ranks]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(damaged_message(path, shown))


# ------------------------------------------------------------------------------------------ locating
def step_of(path: Path) -> int | None:
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def step_dirs(root: Path) -> list[Path]:
    """Every ``step_NNNNNNNN`` directory under root, complete or not, oldest first. A symbolic link named so is none:
    a save writes a folder, so a link is another run's checkpoint (``linked_step_dirs``), never read or pruned."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and step_of(p) is not None),
                  key=step_of)


def linked_step_dirs(root: Path) -> list[Path]:
    """The symbolic links under root named like checkpoints (``step_dirs`` leaves them out)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_symlink() and step_of(p) is not None)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    return [p for p in step_dirs(root) if (p / TRAIN_STATE).is_file()]


def damaged_message(path: Path, why: str) -> str:
    """What is wrong with checkpoint ``path`` and the exact way back to the previous complete one."""
    step = step_of(path)
    previous = [p for p in complete_checkpoints(path.parent) if step is not None and step_of(p) < step]
    fix = (f"to resume from the previous complete checkpoint, move the damaged one aside (mv {path} {path}.damaged) "
           f"and run again with train.resume=auto, or set train.resume={previous[-1]} train.discard_newer=true"
           if previous else "no earlier complete checkpoint exists; start afresh in another train.output_dir")
    return f"checkpoint {path} is damaged: {why}; {fix}"


# ------------------------------------------------------------------------------------------ train state
def read_train_state(path: Path) -> dict[str, Any]:
    """The checkpoint's JSON train state, with its required fields checked."""
    file = path / TRAIN_STATE
    try:
        state = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(damaged_message(path, f"{file.name} is unreadable ({e})")) from None
    wrong = [key for key, kind in _TRAIN_STATE_FIELDS.items() if not isinstance(_lookup(state, key), kind)]
    if wrong:
        raise CheckpointError(damaged_message(path, f"{file.name} lacks a valid {', '.join(wrong)} (it needs "
                                                    f"{', '.join(_TRAIN_STATE_FIELDS)})"))
    _check_step(path, state)
    step, updates = state["step"], state["scheduler"]["last_epoch"]
    if not 0 <= updates <= step:  # an update per step at most; a negative position runs the schedule backwards
        raise CheckpointError(damaged_message(path, f"{file.name} records {updates} optimizer updates "
                                                    f"(scheduler.last_epoch) by step {step}, and a run takes 0 to "
                                                    "one per step (a negative count would give a negative learning "
                                                    "rate: gradient ascent)"))
    loader = state["loader"]
    if loader["epoch"] < 0 or loader["position"] < 0:
        raise CheckpointError(damaged_message(path, f"{file.name} records the data loader at epoch "
                                                    f"{loader['epoch']}, position {loader['position']}; neither can "
                                                    "be negative"))
    return state


def written_step(path: Path, record: dict[str, dict[str, Any]] | None) -> int | None:
    """The step checkpoint ``path`` was saved as: DCP's metadata names the directory its files were written to
    (``.tmp-step_<N>``, renamed into place after), and the file record vouches for the metadata. None where it
    cannot tell (no record, or a torch that records no checkpoint id)."""
    if not record or ".metadata" not in record:
        return None
    problems = _file_problems(path, ".metadata", record[".metadata"])
    if problems:
        raise CheckpointError(damaged_message(path, "; ".join(problems)))
    storage = getattr(_SafeReader(str(path)).read_metadata(), "storage_meta", None)
    written = getattr(storage, "checkpoint_id", None)
    return step_of(Path(Path(str(written)).name.removeprefix(".tmp-"))) if written else None


def _check_step(path: Path, state: dict[str, Any]) -> None:
    """The folder's name, train_state.json's step and the step the files were written as (``written_step``) must
    agree: a renamed folder would be resumed as another step (and newer checkpoints pruned), an edited step would
    run the schedule and the data from the wrong place."""
    step, named, written = state["step"], step_of(path), written_step(path, state.get("files"))
    if {step, named, written} - {None} == {step} and step >= 0:
        return
    said = [f"its folder name says step {named}" if named is not None else None, f"its {TRAIN_STATE} step {step}",
            f"its files were written as step_{written:08d}" if written is not None else None]
    why = ", ".join(s for s in said if s) + ": renamed or edited after it was saved"
    home = path.parent / f"step_{written:08d}" if written is not None else None
    if written == step and home != path and not home.exists():
        raise CheckpointError(f"checkpoint {path} disagrees with itself: {why}; rename it back (mv {path} {home}) "
                              "and run again")
    raise CheckpointError(damaged_message(path, why))


def _lookup(tree: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def _encode_rng(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state(dev_type: str) -> dict[str, str]:
    from core import device

    states = {"cpu": _encode_rng(torch.get_rng_state())}
    if dev_type != "cpu":
        states[dev_type] = _encode_rng(device.module(dev_type).get_rng_state().cpu())
    return states


def set_rng_state(states: dict[str, str], dev_type: str) -> None:
    from core import device

    torch.set_rng_state(_decode_rng(states["cpu"]))
    if dev_type != "cpu" and dev_type in states:
        device.module(dev_type).set_rng_state(_decode_rng(states[dev_type]))


# ------------------------------------------------------------------------------------------ save / load
def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _own_files(directory: Path, rank: int) -> list[Path]:
    """The files this rank records: DCP names a rank's shards ``__<rank>_<n>.distcp``; rank 0 also takes the
    rest (the metadata)."""
    files = [p for p in directory.iterdir() if p.is_file()]
    if rank == 0:
        return [p for p in files if not (p.name.startswith("__") and not p.name.startswith("__0_"))]
    return [p for p in files if p.name.startswith(f"__{rank}_")]


def save_checkpoint(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    train_state: dict[str, Any], keep_last: int, is_writer: bool) -> Path:
    """Collective: every rank writes and records its shards; rank 0 writes the train state (with the record)
    last and publishes the directory by renaming it."""
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}"
    previous = complete_checkpoints(root)
    kept = f"; the previous checkpoint {previous[-1]} is intact" if previous else "; no earlier checkpoint exists"
    if is_writer:
        with _named_write_failures(f"checkpoint {final}", root, None, kept):
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    _barrier()
    start = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _named_write_failures(f"checkpoint {final}", root, tmp if is_writer else None, kept):
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    _barrier()
    written = time.perf_counter()
    files = {name: rec for part in _gather(record_files(_own_files(tmp, dist.get_rank() if dist.is_initialized()
                                                                     else 0))) for name, rec in part.items()}
    recorded = time.perf_counter()
    if is_writer:
        with _named_write_failures(f"checkpoint {final}", root, tmp, kept):
            (tmp / TRAIN_STATE).write_text(json.dumps({"step": step, **train_state, "files": files}))
        if final.is_symlink():  # a link in the way (find_start never reads one): the link goes, not what it names
            final.unlink()
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("saved checkpoint %s (%.2f GiB: written in %.1f s, checksummed in %.1f s)", final,
                    sum(r["bytes"] for r in files.values()) / 2**30, written - start, recorded - written)
    _barrier()
    return final


def save_sizes(model: nn.Module, moment_dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of one checkpoint (the weights and AdamW's two moments, all ranks together) and of the final weights
    (``save_model_weights``), from the parameters' global sizes: an estimate before anything is written."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = 2 * sum(p.numel() for p in model.parameters() if p.requires_grad) * moment_dtype.itemsize
    return weights + moments, weights


def space_warnings(needs: dict[Path, int]) -> list[str]:
    """One line per file system that has less free space than ``needs`` (path -> bytes to be written under it)
    add up to there: a run that would train for hours and then fail at its save (a checkpoint of a 4-layer
    Qwen3.5 takes 49 GiB: docs/reliability.md, the row of a disk too small)."""
    totals: dict[int, list] = {}  # file system -> [a folder on it, bytes]
    for path, size in needs.items():
        where = nearest_existing(path)
        totals.setdefault(where.stat().st_dev, [where, 0])[1] += size
    lines = []
    for where, size in totals.values():
        free = shutil.disk_usage(where).free
        if free < size:
            lines.append(f"{free / 2**30:.1f} GiB free on {where}, but this run writes {size / 2**30:.1f} GiB there at "
                         "its save (one checkpoint: weights and optimizer moments; and train.save_final's weights): "
                         "it would fail then. Free space, point checkpoint.dir or train.output_dir elsewhere, or set "
                         "train.save_final=false")
    return lines


@contextlib.contextmanager
def _named_write_failures(what: str, path: Path, partial: Path | None = None, then: str = "") -> Iterator[None]:
    """A failed write of ``what`` (to ``path``) as one CheckpointError naming it, the cause and ``then`` (what is
    left); ``partial`` (a temporary directory) is removed so that it holds no space."""
    try:
        yield
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        message = write_failure(e, what, path)
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        if message is None:
            raise
        raise CheckpointError(message + then) from e


def _check_keys_and_shapes(path: Path, metadata: Metadata, state: dict[str, Any]) -> None:
    """The checkpoint must hold exactly the parameters and optimizer states the model and optimizer ask for, with
    the same shapes: DCP alone loads the asked-for keys and ignores the rest. (Optimizer hyper-parameters are the
    config's, not compared.)"""
    tensors = tuple(f"{name}." for name in ("model", "optim.state") if name.split(".")[0] in state)
    flat = {k: v for k, v in flatten_state_dict(state)[0].items() if k.startswith(tensors)}
    saved = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith(tensors)}
    missing, unexpected = sorted(set(flat) - set(saved)), sorted(set(saved) - set(flat))
    reshaped = [f"{k} {list(saved[k].size)} in the checkpoint, {list(v.shape)} in the model" for k, v in flat.items()
                if k in saved and isinstance(saved[k], TensorStorageMetadata) and isinstance(v, torch.Tensor)
                and tuple(saved[k].size) != tuple(v.shape)]
    problems = [f"{what} ({len(keys)}): {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}"
                for what, keys in (("missing from the checkpoint", missing), ("not in the model", unexpected),
                                   ("with another shape", reshaped)) if keys]
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match this model/optimizer: {'; '.join(problems)}. "
                              "Was it saved with another model config? Resume with the run's own model settings")


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    record: dict[str, dict[str, Any]] | None) -> None:
    """Collective: verify the files against ``record`` (the train state's; None: not recorded), check keys and
    shapes, then load model (and optimizer) state in place, resharding to the current layout. The optimizer
    keeps its current hyper-parameters (the config's), not the checkpoint's."""
    if record is None:
        logger.warning("checkpoint %s has no file record (written before records existed): not verified", path)
    else:
        start = time.perf_counter()
        verify_files(path, record)
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info("verified checkpoint %s (%d files, %.2f GiB) in %.1f s", path, len(record),
                        sum(r["bytes"] for r in record.values()) / 2**30, time.perf_counter() - start)
    reader = _SafeReader(str(path))
    model_sd, optim_sd = get_state_dict(model, optimizer) if optimizer else (get_state_dict(model, [])[0], None)
    state = {"model": model_sd} if optim_sd is None else {"model": model_sd, "optim": optim_sd}
    _check_keys_and_shapes(path, reader.read_metadata(), state)
    try:
        dcp.load(state, storage_reader=reader, planner=_SafePlanner())
    # DCP reports damage as assorted exception types (CheckpointException is a BaseException).
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"checkpoint {path} could not be read: {type(e).__name__}: {e}") from e
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
        return
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for group, own in zip(optimizer.param_groups, hyper):
        group.update(own)


def saved_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the final weights hold (our names, fused experts; DTensors not gathered): the state dict
    without ``lm_head.weight`` when it is tied (safetensors refuses shared storage; it is embed_tokens.weight)."""
    out = dict(model.state_dict())
    if getattr(getattr(model, "args", None), "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every saved tensor as a full CPU tensor, all at once (a whole model in host memory: for a model that
    holds it anyway, as scripts/export_hf.py's). Collective under sharding: every rank must call it."""
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu").contiguous()
            for name, t in saved_tensors(model).items()}


def save_model_weights(model: nn.Module, path: Path, is_writer: bool, step: int | None = None,
                       init_from: dict[str, Any] | None = None) -> None:
    """Collective: the final weights as one safetensors file (``saved_tensors`` as full tensors, metadata
    {"format": "pt"}: the bytes ``save_file(full_state_dict(model))`` would write), written atomically by the
    writer, then their record (``weights_record``: ``step``, what the run loaded from model.init_from
    (``init_from``: ``recorded_init_from``), the size and block CRCs). Parameters are gathered one at
    a time and streamed into the file (``stream_gathered``): the writer's host memory holds one tensor, the other
    ranks' none, instead of the whole model on every rank."""
    tensors = saved_tensors(model)
    layouts = save_file_order({name: layout_of(t) for name, t in tensors.items()})

    def write(host: Iterator[torch.Tensor]) -> None:
        with _named_write_failures(str(path), path):
            weights_record(path).unlink(missing_ok=True)  # never an older file's record beside a newer file
            atomic_write(path, lambda tmp: write_safetensors(tmp, layouts, host, metadata={"format": "pt"}))
            atomic_write_text(weights_record(path), json.dumps({"step": step, "init_from": init_from,
                                                                **record_paths([path])[path]}) + "\n")

    stream_gathered(tensors, layouts, write if is_writer else None)


def weights_record(path: Path) -> Path:
    """``<weights>.record.json`` beside final weights: the step they hold, their size and CRC-32 per 64 MiB block."""
    return path.with_name(path.name + ".record.json")


def verified_weights_step(path: Path) -> int | None:
    """The step the final weights ``path`` hold, once their bytes are checked against their record (CheckpointError
    names the damaged ones); None where they have no record (written before records existed) or it has no step."""
    record = weights_record(path)
    if not record.is_file():
        logger.warning("%s has no record (%s): written before records existed; not verified", path, record.name)
        return None
    try:
        written = json.loads(record.read_text())
        problems = record_problems(path.name, written, record_paths([path])[path] if path.is_file() else None)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{record} is unreadable ({e}); move it aside to use {path} unverified") from None
    if problems:
        raise CheckpointError(f"{path} is damaged: {'; '.join(problems)}. The run's checkpoints hold the weights too: "
                              "export the newest (scripts/export_hf.py <run>/checkpoints/step_N)")
    return written.get("step")


def recorded_init_from(weights: Path) -> dict[str, Any] | None:
    """What the run of ``weights`` (a checkpoint, or final weights with their record) loaded from model.init_from, as
    recorded (``models.hf_io.record_source``); None where nothing was recorded."""
    try:
        if (weights / TRAIN_STATE).is_file():
            return read_train_state(weights).get("init_from")
        return json.loads(weights_record(weights).read_text()).get("init_from")
    except (OSError, ValueError, AttributeError):
        return None
