"""safetensors written one tensor at a time, and sharded tensors gathered one at a time to feed it.

The format: an 8-byte little-endian header length, a JSON header (name -> dtype, shape, data_offsets, and an
optional ``"__metadata__"`` of strings) padded with spaces to a multiple of 8 bytes, then the tensors' raw bytes
back to back. Every name, shape and dtype is known before any data (a DTensor's global shape), so the header
goes first and each tensor's bytes follow as it arrives: host memory holds one tensor, not the file.

Readers sort the entries by their offsets, so any order of the bytes is a valid file; ``save_file_order`` is the
one safetensors' ``save_file`` uses (descending dtype rank, then name), and writing in it gives the same bytes.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

# torch dtype -> (safetensors dtype, rank): save_file writes the highest rank first (its Rust Dtype enum order,
# checked on safetensors 0.8 by tests/test_final_save.py), so each tensor's offset is a multiple of its item size.
_DTYPES: dict[torch.dtype, tuple[str, int]] = {dtype: (name, rank) for rank, (dtype, name) in enumerate(reversed([
    (torch.uint64, "U64"), (torch.int64, "I64"), (torch.float64, "F64"), (torch.float32, "F32"),
    (torch.uint32, "U32"), (torch.int32, "I32"), (torch.bfloat16, "BF16"), (torch.float16, "F16"),
    (torch.uint16, "U16"), (torch.int16, "I16"), (torch.float8_e5m2fnuz, "F8_E5M2FNUZ"),
    (torch.float8_e4m3fnuz, "F8_E4M3FNUZ"), (torch.float8_e8m0fnu, "F8_E8M0"), (torch.float8_e4m3fn, "F8_E4M3"),
    (torch.float8_e5m2, "F8_E5M2"), (torch.int8, "I8"), (torch.uint8, "U8"), (torch.bool, "BOOL"),
]))}


@dataclass(frozen=True)
class TensorLayout:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def layout_of(tensor: torch.Tensor) -> TensorLayout:
    """Global shape and dtype (a DTensor's without gathering it)."""
    return TensorLayout(tuple(tensor.shape), tensor.dtype)


def _dtype_name(name: str, dtype: torch.dtype) -> str:
    if dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {dtype} is not written by this safetensors writer "
                         f"(supported: {', '.join(str(d).removeprefix('torch.') for d in _DTYPES)})")
    return _DTYPES[dtype][0]


def torch_dtype(safetensors_dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (``F32``, ``BF16``, ...), as this writer writes it."""
    for dtype, (name, _) in _DTYPES.items():
        if name == safetensors_dtype:
            return dtype
    raise ValueError(f"safetensors dtype {safetensors_dtype} is not written by this safetensors writer "
                     f"(supported: {', '.join(name for name, _ in _DTYPES.values())})")


def save_file_order(layouts: Mapping[str, TensorLayout]) -> dict[str, TensorLayout]:
    """``layouts`` in the order safetensors' ``save_file`` writes them: descending dtype rank, then name."""
    for name, layout in layouts.items():
        _dtype_name(name, layout.dtype)
    return dict(sorted(layouts.items(), key=lambda item: (-_DTYPES[item[1].dtype][1], item[0])))


def header(layouts: Mapping[str, TensorLayout], metadata: Mapping[str, str] | None = None) -> bytes:
    """The length prefix and JSON header of a file holding ``layouts`` in this order, as ``save_file`` writes it
    (compact JSON, ``__metadata__`` first, spaces to a multiple of 8 bytes)."""
    entries: dict[str, object] = {} if metadata is None else {"__metadata__": dict(metadata)}
    offset, last_itemsize = 0, None
    for name, layout in layouts.items():
        if name == "__metadata__":
            raise ValueError("a tensor cannot be named __metadata__ in safetensors")
        itemsize = layout.dtype.itemsize
        if last_itemsize is not None and itemsize > last_itemsize:  # the header is 8-byte aligned; so is the rest
            raise ValueError(f"{name}: item size {itemsize} after {last_itemsize}; order tensors by descending item "
                             "size (save_file_order) so that every tensor starts at a multiple of its item size")
        last_itemsize = itemsize
        entries[name] = {"dtype": _dtype_name(name, layout.dtype), "shape": list(layout.shape),
                         "data_offsets": [offset, offset + layout.nbytes]}
        offset += layout.nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(path: str | Path, layouts: Mapping[str, TensorLayout], tensors: Iterable[torch.Tensor],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write a safetensors file: the header of ``layouts`` (in file order), then the bytes of each of ``tensors``
    as it arrives, one per layout in the same order (checked; exactly ``len(layouts)`` are taken). Any device,
    any strides; each is copied to host (and made contiguous) only if it is not already. Not atomic: write to a
    temporary path and rename (``training.checkpoint.atomic_write``, the export's temporary directory)."""
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors is little-endian; this writer does not byte-swap")
    arriving: Iterator[torch.Tensor] = iter(tensors)
    with open(path, "wb") as f:
        f.write(header(layouts, metadata))
        for name, layout in layouts.items():  # zip would pull one tensor too many (a gather, for stream_gathered)
            tensor = next(arriving, None)
            if tensor is None:
                raise ValueError(f"{path}: no tensor for {name} (fewer tensors than layouts)")
            if (tuple(tensor.shape), tensor.dtype) != (layout.shape, layout.dtype):
                raise ValueError(f"{path}: {name} is {tuple(tensor.shape)} {tensor.dtype}, its header says "
                                 f"{layout.shape} {layout.dtype}")
            data = tensor.detach().to("cpu").contiguous().reshape(-1)  # reshape: a 0-dim tensor cannot be viewed
            f.write(data.view(torch.uint8).numpy())  # the tensor's own memory: no bytes object in between
            del tensor, data  # hold nothing while the next one arrives (for stream_gathered: is gathered)


def stream_gathered(tensors: Mapping[str, torch.Tensor], order: Iterable[str],
                    write: Callable[[Iterator[torch.Tensor]], None] | None, dtype: torch.dtype | None = None) -> None:
    """Collective: every rank gathers ``tensors[name]`` for each name of ``order`` in turn (``full_tensor()`` of a
    DTensor is a collective over its mesh, so every rank must take the same order); ``write`` (the writer rank's,
    None elsewhere) consumes them as full host tensors (cast to ``dtype`` if given) and the other ranks drop each
    at once. Host memory: the writer holds one tensor at a time, the other ranks none (on GPUs; on a CPU run the
    all-gather's output is itself host memory, one tensor at a time on every rank).

    Device memory: the all-gather puts one full parameter on every rank for a moment, freed before the next (the
    largest is one layer's fused expert tensor: 1.6 GB in fp32, 0.8 GB in bf16 for Qwen3-30B-A3B). That is
    accepted rather than a gather to the writer alone, which would need its own path for every placement
    (_StridedShard included).

    If ``write`` raises, the remaining gathers still run, so that the other ranks finish instead of waiting in a
    collective; then the error propagates (on the writer only). A failing gather ends the stream on its own."""
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype)

    def host_tensors() -> Iterator[torch.Tensor]:
        for name in order:  # no local keeps a tensor while the next one is gathered
            if write is None:
                gather(tensors[name])
            else:
                yield to_host(gather(tensors[name]))

    gathered = host_tensors()
    try:
        if write is not None:
            write(gathered)
    finally:
        for _ in gathered:  # the other ranks' whole loop; the writer's remaining gathers if write stopped early
            pass
