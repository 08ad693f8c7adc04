"""Pre-tokenized data at scale: shards read as one memory-mapped stream, validated once, and window orders.

``data.path`` of ``data=tokens`` (or a ``data.sources`` entry's path) is one file, a directory (its .npy and .bin
files) or a glob. The shards, in sorted path order, form one virtual stream: a document runs on across a shard
boundary unless the shard ends in ``data.eos_id``. Shards are memory-mapped; at each start every shard is read
once for its record (size and a CRC-32 per 64 MiB block, on a thread pool: several GB/s), which is the source's
identity in a checkpoint and the key of its id range (min, max), scanned once per content and cached in
``<data.cache_dir>/token-shards.json``: a shard swapped for another of the same size and mtime is scanned again.

A shard is 1-D ids, or the [2, n] uint32 (ids, trained mask) of ``scripts/pretokenize.py``, whose directory's
manifest.json names the tokenizer (and so the <|endoftext|> id), must list every shard as finished, and records
each shard's CRCs (older manifests: its sha256), against which the shard is checked: a damaged one is refused. A
directory with a manifest is read as exactly the shards it lists: a .npy/.bin file beside them that it does not
list (stale or foreign), or one it lists that is missing, is refused.

During the run each shard's (device, inode, size, mtime) as it was opened is checked again before every read of it
and, through the loader, at every logged step and checkpoint (``ShardFiles``): a shard rewritten, replaced or
truncated under the run stops it with one line naming the file, before a read past a truncated end (a bus error)
and before a checkpoint would record an identity that is not what was read.
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.files import atomic_write_text, file_kind, record_paths, record_problems
from training.data.tokenize_shards import MANIFEST, SHARD_SUFFIXES, file_sha256

BIN_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")  # data.bin_dtype: raw little-endian ids
_STATS_CACHE = "token-shards.json"
_SCAN_BLOCK = 1 << 24  # ids per block of the one validating pass over a shard
_WIDER = {"uint8": "uint16", "uint16": "uint32", "int16": "int32", "uint32": "int64", "int32": "int64"}
_WIDTH_SAMPLE = 4096  # the ids at the start of a .bin that _check_not_wider reads
_GLOB_CHARS = "*?["


def shard_paths(path: str, key: str = "data.path") -> list[Path]:
    """The shard files ``path`` names (one file, a directory's .npy/.bin files, or a glob), in sorted order."""
    if any(c in path for c in _GLOB_CHARS):
        files = sorted(Path(p) for p in glob.glob(path) if Path(p).is_file())
    elif Path(path).is_dir():
        files = sorted(p for p in Path(path).iterdir() if p.is_file() and p.suffix in SHARD_SUFFIXES)
    elif Path(path).is_file():
        files = [Path(path)]
    elif file_kind(Path(path)) == "missing":
        raise FileNotFoundError(f"{key}: no such file or directory {path}")
    else:
        raise ValueError(f"{key}={path} is {file_kind(Path(path))}, not a token shard file or a directory of them "
                         "(shards are memory-mapped: they must be regular files)")
    if not files:
        raise ValueError(f"{key}={path} holds no .npy or .bin shard; point {key} at a file, a directory or a glob "
                         "of token shards")
    wrong = [str(p) for p in files if p.suffix not in SHARD_SUFFIXES]
    if wrong == [path]:
        raise ValueError(f"{key}={path} must be a .npy array or a raw .bin file (dtype: data.bin_dtype) of token ids")
    if wrong:
        raise ValueError(f"{key}={path} matches {wrong[0]}, which is not a .npy or .bin token shard; narrow the glob")
    return files


def open_shard(path: Path, bin_dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """One shard, memory-mapped: (ids, None) of a 1-D integer .npy or raw little-endian ``bin_dtype`` ids, or
    (ids, trained mask) of a [2, n] uint32 .npy of scripts/pretokenize.py; ValueError names the file."""
    try:
        if path.suffix == ".npy":
            ids = np.load(path, mmap_mode="r")
        else:
            itemsize, size = np.dtype(bin_dtype).itemsize, path.stat().st_size
            if size == 0 or size % itemsize:
                raise ValueError(f"token shard {path}: {size} bytes is not a positive multiple of {itemsize} "
                                 f"(data.bin_dtype={bin_dtype}); set data.bin_dtype to the file's dtype")
            ids = np.memmap(path, dtype=np.dtype(bin_dtype).newbyteorder("<"), mode="r")
            _check_not_wider(path, ids, bin_dtype)
    except (OSError, EOFError) as e:
        raise ValueError(f"token shard {path} is unreadable ({e})") from None
    except ValueError as e:
        if str(e).startswith("token shard"):
            raise
        raise ValueError(f"token shard {path} is not a valid .npy array ({e})") from None
    if isinstance(ids, np.ndarray) and ids.ndim == 2 and ids.shape[0] == 2 and ids.dtype == np.uint32 and ids.size:
        return ids[0], ids[1]  # views of the memory map: nothing is read
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.size == 0:
        got = f"{ids.dtype} {ids.shape}" if isinstance(ids, np.ndarray) else type(ids).__name__
        raise ValueError(f"token shard {path}: expected a non-empty 1-D integer array, or the [2, n] uint32 (ids, "
                         f"trained mask) of scripts/pretokenize.py, got {got}")
    return ids, None


def _check_not_wider(path: Path, ids: np.ndarray, bin_dtype: str) -> None:
    """Ids twice as wide as data.bin_dtype read as id, 0, id, 0 (the high halves of little-endian ids below
    2**bits), a valid corpus that trains on nonsense: refused where every second of the first ids is 0 and the
    others are not (no text alternates with one id for thousands of tokens)."""
    wider = _WIDER.get(bin_dtype)
    sample = np.asarray(ids[:_WIDTH_SAMPLE])
    if wider and sample.size >= 32 and not sample[1::2].any() and sample[0::2].any():
        raise ValueError(f"token shard {path} read as data.bin_dtype={bin_dtype} has 0 at every second of its first "
                         f"{sample.size} ids: it holds {wider} ids (their high halves read as ids); set "
                         f"data.bin_dtype={wider}")


def scan_ids(ids: np.ndarray) -> tuple[int, int]:
    """(min, max) of a shard in one blockwise pass."""
    lo, hi = None, None
    for start in range(0, ids.size, _SCAN_BLOCK):
        block = ids[start : start + _SCAN_BLOCK]
        lo = int(block.min()) if lo is None else min(lo, int(block.min()))
        hi = int(block.max()) if hi is None else max(hi, int(block.max()))
    return lo, hi


def _content_key(path: Path, ids: np.ndarray, record: dict) -> str:
    crcs = hashlib.sha256(json.dumps(record).encode()).hexdigest()[:16]
    return f"{path.resolve()}|{ids.dtype.str}|{record['bytes']}|{crcs}"


def shard_maxima(paths: list[Path], shards: list[np.ndarray], records: dict[Path, dict], cache_dir: str
                 ) -> list[int]:
    """The largest id of each shard, checking each is non-negative. A shard is scanned only when the cache (keyed
    by its absolute path, dtype and content: its record) does not hold it yet."""
    cache = Path(cache_dir) / _STATS_CACHE
    try:
        stats = json.loads(cache.read_text())
    except (OSError, ValueError):
        stats = {}
    stats = stats if isinstance(stats, dict) else {}
    keys = [_content_key(path, ids, records[path]) for path, ids in zip(paths, shards)]
    fresh = False
    for path, ids, key in zip(paths, shards, keys):
        if key not in stats:
            prefix = f"{path.resolve()}|"  # drop the entry of the shard as it was before a change
            stats = {k: v for k, v in stats.items() if not k.startswith(prefix)}
            stats[key], fresh = scan_ids(ids), True
        if stats[key][0] < 0:
            raise ValueError(f"token shard {path}: token ids must be non-negative, found {stats[key][0]}")
    if fresh:
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache, json.dumps(stats))
    return [stats[key][1] for key in keys]


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    """What changes when a file is rewritten, replaced or truncated, for one stat: (device, inode, size, mtime);
    None: gone."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class ShardFiles:
    """A source's shard files as the run opened them (``_stamp``, taken before their records were read): a shard
    rewritten in place would be read (memory-mapped) with its new bytes while the checkpoints record the old
    contents, and one truncated would end the process with a bus error at the first read past its new end. So a
    read checks the shards it touches first, and ``check`` all of them (train.py: every logged step and every
    checkpoint)."""

    def __init__(self, paths: list[Path], key: str) -> None:
        self.paths, self.key = paths, key
        self._stamps = [_stamp(p) for p in paths]

    def check(self, shards: Iterable[int] | None = None) -> None:
        """ValueError naming the first of ``shards`` (indices; None: all) that changed since the run opened it."""
        for s in range(len(self.paths)) if shards is None else shards:
            was, now = self._stamps[s], _stamp(self.paths[s])
            if now == was:
                continue
            what = ("it is gone" if now is None else f"another file now (inode {was[1]} -> {now[1]})"
                    if now[:2] != was[:2] else f"{was[2]} -> {now[2]} bytes" if now[2] != was[2] else
                    "rewritten: modified since the run opened it")
            raise ValueError(f"{self.key}: token shard {self.paths[s]} changed under the running job ({what}); the "
                             "run stops here, and its checkpoints hold what it read before: restore the file and "
                             "continue with train.resume=auto, or train on the new contents with "
                             "train.resume=auto train.allow_changes=[data]")


class TokenStream:
    """Shards concatenated in order as one read-only 1-D id sequence; indexable with an integer array of any shape.
    With ``files``, each read checks the files of the shards it reads first (``ShardFiles``)."""

    def __init__(self, shards: list[np.ndarray], files: ShardFiles | None = None) -> None:
        self._shards, self._files = shards, files
        self._starts = np.cumsum([0] + [len(s) for s in shards])  # [shards + 1] offset of each shard

    def __len__(self) -> int:
        return int(self._starts[-1])

    def any(self, block: int = 1 << 24) -> bool:
        """Whether any entry is non-zero (of a trained mask: whether any label is trained), read in blocks up to the
        first such: at once for any corpus that trains, the whole of one that does not."""
        return any(shard[i:i + block].any() for shard in self._shards for i in range(0, len(shard), block))

    def __getitem__(self, index: np.ndarray) -> np.ndarray:
        index = np.asarray(index, dtype=np.int64)
        shard = np.searchsorted(self._starts, index, side="right") - 1
        out = np.empty(index.shape, dtype=np.int64)
        touched = np.unique(shard)
        if self._files is not None:
            self._files.check(touched.tolist())  # a stat per shard: a truncated one is named, not a bus error
        for s in touched:
            at = shard == s
            out[at] = self._shards[s][index[at] - self._starts[s]]
        return out


@dataclass
class TokenData:
    """One token source: its shards' ids (and trained masks, where every shard has one) as streams."""
    ids: TokenStream
    mask: TokenStream | None  # None: plain id shards, every target is trained
    vocab_size: int  # largest id + 1
    tokenizer: str | None  # from the shards' manifest.json (scripts/pretokenize.py); None: not known
    identity: str  # sha256 of the shards' records in order: what a checkpoint compares on resume
    files: ShardFiles  # the files as opened: checked before each read and by the loader's check_data_unchanged


def pretokenized_by(paths: list[Path], records: dict[Path, dict], key: str) -> str | None:
    """The tokenizer the manifest.json beside the shards names (None: no manifest); ValueError if a manifest's
    tokenization is unfinished, two name different tokenizers, or a shard differs from what its manifest recorded
    when it was written (its CRCs; a manifest from before those were recorded: its sha256)."""
    tokenizers = set()
    for folder in sorted({p.parent for p in paths}):
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise ValueError(f"{key}: {folder / MANIFEST} is unreadable ({e})") from None
        shards = manifest.get("shards", [])
        done = sum(1 for s in shards if s.get("sha256"))
        if done < len(shards):
            raise ValueError(f"{key}: {folder} holds an unfinished tokenization ({done} of {len(shards)} shards in "
                             f"{MANIFEST}); run scripts/pretokenize.py again to finish it")
        written = {s.get("file"): s for s in shards}
        # exactly the manifest's shards: a stale or foreign file beside them would be read as part of the corpus
        unlisted = [str(p) for p in paths if p.parent == folder and p.name not in written]
        missing = [str(folder / name) for name in written if not (folder / name).is_file()]
        disagree = ([f"{', '.join(unlisted[:3])} not in it (stale or foreign shards)"] if unlisted else []) + \
            ([f"{', '.join(missing[:3])} listed but missing"] if missing else [])
        if disagree:
            raise ValueError(f"{key}: {folder} and its {MANIFEST} disagree: {'; '.join(disagree)}: move the files it "
                             "does not list out of the directory, and run scripts/pretokenize.py again for missing "
                             "ones (it redoes them)")
        for path in (p for p in paths if p.parent == folder and p.name in written):
            entry = written[path.name]
            problems = (record_problems(path.name, entry["record"], records[path]) if entry.get("record") else
                        [] if file_sha256(path) == entry["sha256"] else [f"{path.name}'s sha256 differs"])
            if problems:
                raise ValueError(f"{key}: token shard {path} differs from what scripts/pretokenize.py wrote "
                                 f"({'; '.join(problems)}): damaged or replaced; run scripts/pretokenize.py again "
                                 "(it re-tokenizes the shards that changed)")
        tokenizers.add(manifest.get("tokenizer"))
    if len(tokenizers) > 1:
        raise ValueError(f"{key}: the shards' manifests name different tokenizers {sorted(tokenizers)}; use shards "
                         "of one tokenizer")
    return tokenizers.pop() if tokenizers else None


def load_token_stream(path: str, bin_dtype: str, cache_dir: str, key: str = "data.path",
                      model_vocab_size: int | None = None) -> TokenData:
    """The shards of ``path`` as one source (``TokenData``); with ``model_vocab_size``, ValueError naming the
    first shard whose ids the model cannot embed."""
    paths = shard_paths(path, key)
    files = ShardFiles(paths, key)  # before anything is read: a change from here on stops the run
    opened = [open_shard(p, bin_dtype) for p in paths]
    ids, masks = [i for i, _ in opened], [m for _, m in opened]
    masked = [m is not None for m in masks]
    if any(masked) and not all(masked):
        plain, with_mask = paths[masked.index(False)], paths[masked.index(True)]
        raise ValueError(f"{key}={path} mixes plain id shards ({plain}) with (ids, mask) shards of "
                         f"scripts/pretokenize.py ({with_mask}); use one kind per source")
    records = record_paths(paths)
    tokenizer = pretokenized_by(paths, records, key)
    maxima = shard_maxima(paths, ids, records, cache_dir)
    for shard, top in zip(paths, maxima):
        if model_vocab_size is not None and top >= model_vocab_size:
            raise ValueError(f"{key}: token shard {shard} holds ids up to {top}, and model.arch.vocab_size="
                             f"{model_vocab_size}; use a model whose vocabulary covers the data's ids (or the shards "
                             "of its tokenizer)")
    identity = hashlib.sha256(json.dumps([records[p] for p in paths]).encode()).hexdigest()
    return TokenData(TokenStream(ids, files), TokenStream(masks, files) if all(masked) else None, max(maxima) + 1,
                     tokenizer, identity, files)


class WindowOrder:
    """A source's windows in a seeded per-epoch permutation, handed out in runs; a run never straddles two epochs
    (the tail of an epoch shorter than the run is skipped)."""

    def __init__(self, num_windows: int, seed_key: tuple[int, ...]) -> None:
        self.num_windows = num_windows
        self._seed_key = seed_key  # the permutation of epoch e is seeded by [*seed_key, e]
        self.epoch = 0
        self.position = 0  # index in this epoch's order of the next window
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` windows (n <= num_windows)."""
        if self.position + n > self.num_windows:
            self.epoch, self.position = self.epoch + 1, 0
        if self._order_epoch != self.epoch:
            self._order = np.random.default_rng([*self._seed_key, self.epoch]).permutation(self.num_windows)
            self._order_epoch = self.epoch
        windows = self._order[self.position : self.position + n]
        self.position += n
        return windows
