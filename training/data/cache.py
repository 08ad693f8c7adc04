"""The tokenized-corpus cache of data=chitchat / jsonl / hf: the whole corpus as one [2, N] (ids, loss mask) array,
keyed by the files' contents, how they are read and the tokenizer, tokenized once per cache directory. Beside each
cache file, ``<name>.record.json`` records its size and block CRCs as written; a file that no longer matches it
(damaged storage, an edited cache) is tokenized again, never trained on.

Chats with images (a model with a vision tower) keep their images' records (``training.data.vision.ImageRecord``:
file, jsonl line, sha256, patch grid) in ``<name>.images.json``, recorded with the cache file: the pixels are not
cached but computed from the files for each window that holds them. An image file whose size or mtime changed since
and whose bytes changed has the corpus tokenized again."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from core.files import atomic_write_npy, atomic_write_text, nearest_existing, record_paths, record_problems
from training.data.chat import chitchat_docs, join_docs
from training.data.config import DataConfig, source_path
from training.data.hf_datasets import hf_corpus
from training.data.tokenize_shards import Corpus, JsonlCorpus, file_sha256, files_sha256, tokenize_to_shards
from training.data.tokenizer import QwenTokenizer
from training.data.vision import ImageRecord, VisionData

_CACHE_VERSION = 2  # bump when the rendering or the validation of documents changes (2: roles, field types)
_TOKENIZE_WORKERS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
_CACHE_DOCS_PER_SHARD = 10_000  # jsonl documents per shard of the cache's tokenization (one process each)

logger = logging.getLogger(__name__)


def _corpus(cfg: DataConfig, vision: VisionData | None) -> Corpus | None:
    """What ``training.data.tokenize_shards`` reads for jsonl and hf data (chitchat: None, it has its own reader)."""
    if cfg.name == "hf":
        return hf_corpus(cfg.path, cfg.column, cfg.cache_dir)
    return JsonlCorpus(Path(cfg.path), vision) if cfg.name == "jsonl" else None


class TokenizedCorpus(NamedTuple):
    stream: np.ndarray  # [2, N] uint32: ids, loss mask
    # the corpus files' contents (``files_sha256``; with images, and the images' sha256s): the data's identity in a
    # checkpoint
    source_sha256: str
    images: tuple[ImageRecord, ...] = ()  # the images of the chats, in the order of their tokens in ``stream``


def _identity(source_sha256: str, images: list[ImageRecord]) -> str:
    if not images:
        return source_sha256
    return hashlib.sha256("\n".join([source_sha256, *(i.sha256 for i in images)]).encode()).hexdigest()


def tokenized_corpus(cfg: DataConfig, tokenizer: str, vision: VisionData | None = None) -> TokenizedCorpus:
    """The whole corpus as [2, N] uint32 (ids, loss mask), from the cache (keyed by the files' contents, how they
    are read and the tokenizer; verified against its record) or tokenized and cached. jsonl and hf data are
    tokenized by ``training.data.tokenize_shards`` over min(4, CPUs) processes into ``<cache>.shards/`` (an
    interrupted start-up resumes there), then joined into the cache file; processes sharing the cache directory take
    turns (a file lock), so the corpus is tokenized once. ``vision``: the model's vision side, which reads the
    images of jsonl chats (None: an image is refused)."""
    corpus = _corpus(cfg, vision)
    source_sha256 = files_sha256(corpus.files() if corpus else [source_path(cfg)])
    reader = corpus.reader if corpus else cfg.name
    digest = hashlib.sha256(f"{source_sha256}|v{_CACHE_VERSION}|{cfg.name}|{reader}|{tokenizer}".encode())
    cache = Path(cfg.cache_dir) / f"{cfg.name}-{tokenizer}-{digest.hexdigest()[:16]}.npy"
    (stream, images), _ = _read_cache(cache)
    if stream is not None:
        return TokenizedCorpus(stream, _identity(source_sha256, images), tuple(images))
    shards = cache.with_name(cache.stem + ".shards")  # a corpus's tokenized shards, before the cache is written
    with _cache_writes(shards):  # a failed write there (or of the lock): named
        cache.parent.mkdir(parents=True, exist_ok=True)
        with _cache_lock(cache) as locked:
            (stream, images), damage = _read_cache(cache)  # another process may have tokenized it meanwhile
            if stream is not None:
                return TokenizedCorpus(stream, _identity(source_sha256, images), tuple(images))
            if damage:  # checked under the lock: a writer between the file and its record is not damage
                logger.warning("tokenized-corpus cache %s does not match what was written (%s): tokenizing again",
                               cache, damage)
            images = []
            if corpus is None:
                stream = join_docs(chitchat_docs(source_path(cfg), QwenTokenizer(tokenizer)))
            else:
                start = time.monotonic()
                manifest = tokenize_to_shards(corpus, shards, tokenizer, workers=_TOKENIZE_WORKERS,
                                              docs_per_shard=_CACHE_DOCS_PER_SHARD, source_sha256=source_sha256)
                stream, images = manifest.stream(shards), manifest.images(shards)
                logger.info("tokenized %s: %d documents, %d tokens%s in %.1fs over %d shards", corpus.source,
                            sum(s.documents for s in manifest.shards), stream.shape[1],
                            f", {len(images)} images" if images else "", time.monotonic() - start,
                            len(manifest.shards))
            _write_cache(cache, stream, images)
            if corpus is not None and locked:  # unlocked, another process may still be writing shards there
                shutil.rmtree(shards, ignore_errors=True)
    return TokenizedCorpus(stream, _identity(source_sha256, images), tuple(images))


class CacheWriteError(OSError):
    """A write under data.cache_dir that failed, named (``_cache_writes``)."""


@contextlib.contextmanager
def _cache_writes(path: Path, size: str = "") -> Iterator[None]:
    """A failed write of the cache ``path`` (or of what it is made from: its tokenized shards beside it) as one line
    naming it, ``size`` (what it needed), the free space there and data.cache_dir: numpy reports a full disk or a
    file-size limit without an errno ("Not enough free space to write ...", "... requested and ... written"), and
    a shard's write without the file, which alone does not say which file or what to do. The source files were
    read whole before (their sha256), so what fails here is a write."""
    try:
        yield
    except CacheWriteError:
        raise
    except OSError as e:
        free = shutil.disk_usage(nearest_existing(path)).free
        raise CacheWriteError(f"could not write the tokenized-corpus cache {path} ({size}{free / 2**30:.2f} GiB free "
                              f"there): {e}. Free space there, or point data.cache_dir at a folder with room") from e


def _write_cache(cache: Path, stream: np.ndarray, images: list[ImageRecord]) -> None:
    """The cache file, its images' records (where it has images) and its record, atomically; a failed write is one
    line (``_cache_writes``)."""
    with _cache_writes(cache, f"{stream.nbytes / 2**30:.2f} GiB; "):
        record = {}
        if images:
            atomic_write_text(_images_file(cache), json.dumps([image.to_json() for image in images]))
            record["images"] = record_paths([_images_file(cache)])[_images_file(cache)]
        atomic_write_npy(cache, stream)
        atomic_write_text(_record_file(cache), json.dumps({**record_paths([cache])[cache], **record}))


def _record_file(cache: Path) -> Path:
    return cache.with_name(cache.stem + ".record.json")


def _images_file(cache: Path) -> Path:
    return cache.with_name(cache.stem + ".images.json")


_NONE: tuple[None, list[ImageRecord]] = (None, [])


def _read_cache(cache: Path) -> tuple[tuple[np.ndarray | None, list[ImageRecord]], str | None]:
    """((the cached stream, its images), None) if the cache file (and its images' records) match its record and
    every image file is as it was tokenized; ((None, []), what is wrong) if not; ((None, []), None) if there is
    none."""
    if not cache.exists():
        return _NONE, None
    try:
        written = json.loads(_record_file(cache).read_text())
    except (OSError, ValueError):
        return _NONE, f"{_record_file(cache).name} is missing or unreadable"
    problems = record_problems(cache.name, written, record_paths([cache])[cache])
    images_file = _images_file(cache)
    if "images" in written and not problems:
        problems = record_problems(images_file.name, written["images"],
                                   record_paths([images_file])[images_file] if images_file.is_file() else None)
    if problems:
        return _NONE, "; ".join(problems)
    images = ([ImageRecord.from_json(entry) for entry in json.loads(images_file.read_text())]
              if "images" in written else [])
    changed = next((image for image in images if not _unchanged(image)), None)
    if changed is not None:
        return _NONE, f"the image {changed.path} changed since it was tokenized"
    return (np.load(cache), images), None


def _unchanged(image: ImageRecord) -> bool:
    """Whether an image file holds the bytes it was tokenized from: its size, then (where its mtime is not the one
    recorded) its sha256."""
    try:
        stat = os.stat(image.path)
    except OSError:
        return False
    if stat.st_size != image.bytes:
        return False
    return stat.st_mtime_ns == image.mtime_ns or file_sha256(Path(image.path)) == image.sha256


@contextlib.contextmanager
def _cache_lock(cache: Path) -> Iterator[bool]:
    """Hold an exclusive lock on ``<cache>.lock`` (yields True), or yield False where the file system has none."""
    with open(cache.with_name(cache.stem + ".lock"), "a") as f:
        # a multiprocessing child (a worker re-running an unguarded script) must not wait for its parent's lock
        # (_inheriting: multiprocessing's own mark of a spawned child importing its parent's __main__)
        child = multiprocessing.parent_process() is not None or getattr(multiprocessing.current_process(),
                                                                         "_inheriting", False)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (fcntl.LOCK_NB if child else 0))
        except BlockingIOError:
            raise RuntimeError(f"{cache} is being tokenized by this process's parent: a script that builds the data "
                               "loader must guard its code with `if __name__ == \"__main__\":`") from None
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
