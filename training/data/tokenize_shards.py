"""Tokenize a text corpus over worker processes into shards, resumably, with a manifest.

A corpus (``Corpus``) is a .jsonl file (``JsonlCorpus``: one document per non-blank line, ``{"text": ...}`` or
``{"messages": [{"role", "content"}, ...]}``; for a model with a vision tower, user turns may hold image parts, each
image read and checked here and recorded beside its shard, ``shard_<i:05d>.images.json``) or local Hugging Face
datasets files (``training.data.hf_datasets``: one
document per row of a text or messages column). A text is encoded and followed by <|endoftext|>, all trained; a chat
is rendered with the ChatML template (only assistant turns trained) and followed by an untrained <|endoftext|>.

The corpus is cut into contiguous runs of ``docs_per_shard`` documents (jsonl: non-blank lines; datasets: rows);
shard i (its run only) becomes ``<out_dir>/shard_<i:05d>.npy``, a [2, n] uint32 array (token ids, trained mask), so
the shards concatenated in order are the single-process stream of the whole corpus, whatever the number of workers.
Each shard is written atomically, and ``<out_dir>/manifest.json`` (source and its sha256, reader, tokenizer, each
finished shard's range, documents, tokens, trained tokens, sha256 and record: size and block CRCs, which
``training.data.token_shards`` checks when it reads the shard, and the totals once all are done) is rewritten
atomically after every shard: a re-run skips the shards the manifest lists whose files still match their sha256, so
an interrupted run resumes where it stopped. It writes only into a directory without .npy/.bin files or its own
earlier one, whose manifest plans every such file: it never overwrites a file it did not write, nor leaves stale
shards to be read with its own. Used by ``scripts/pretokenize.py`` and the data=jsonl / data=hf caches
(``training.data.cache``); data=tokens reads the shards directly (``training.data.token_shards``).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from core.files import atomic_write_npy, atomic_write_text, file_kind, nearest_existing, record_paths
from training.data.chat import Doc, ImageReader, document, join_docs, jsonl_row
from training.data.tokenizer import TOKENIZERS, QwenTokenizer
from training.data.vision import ImageError, ImageRecord, VisionData, inspect_image

MANIFEST = "manifest.json"
SHARD_SUFFIXES = (".npy", ".bin")  # what data=tokens reads from a directory (training.data.token_shards)
_FORMAT = 2  # bump when the manifest or the shard layout changes (2: reader, row ranges)


def image_reader(jsonl: Path, line: int, vision: VisionData | None) -> ImageReader | None:
    """How the image parts of line ``line`` of ``jsonl`` are read: paths relative to the file's directory, or absolute;
    each image checked (``training.data.vision.inspect_image``). None without a vision tower."""
    if vision is None:
        return None

    def read(part: dict) -> ImageRecord:
        source = part["image"]
        if source.startswith(("http://", "https://", "data:")):
            raise ImageError(f"image {source[:60]}: a URL or inline data: images are read from local files only "
                             "(offline); download it and give its path")
        path = Path(source) if Path(source).is_absolute() else jsonl.parent.absolute() / source
        try:
            return inspect_image(path, source, line, vision)
        except ImageError as e:
            raise ImageError(f"image {source}{'' if Path(source).is_absolute() else f' ({path})'}: {e}") from None

    return read


def jsonl_docs(path: Path, tok: QwenTokenizer, start: int = 0, stop: int | None = None,
               first_line: int = 1, vision: VisionData | None = None) -> Iterator[Doc]:
    """One document per non-blank line of bytes [start, stop) of ``path`` (line ``first_line`` at ``start``), its
    images read for a model with a vision tower (``vision``; None: an image is refused); errors name the file and
    the line."""
    with path.open("rb") as f:
        f.seek(start)
        lineno, offset = first_line - 1, start
        for raw in f:
            if stop is not None and offset >= stop:
                break
            lineno, offset = lineno + 1, offset + len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} line {lineno}: not UTF-8: bytes {raw[e.start:e.end]!r} at byte {e.start} "
                                 "of the line; save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = jsonl_row(json.loads(line))
                doc = document(tok, row, image_reader(path, lineno, vision))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {lineno}: invalid JSON ({e.msg} at column {e.pos + 1}); expected one "
                                 "JSON object per line") from None
            except ValueError as e:
                raise ValueError(f"{path} line {lineno}: {e}") from None
            except RecursionError:  # json's parser recurses per level: past Python's limit (about 1,000)
                raise ValueError(f"{path} line {lineno}: JSON nested deeper than the parser reads (Python's recursion "
                                 "limit); expected one JSON object per line, with a 'text' or a 'messages' field"
                                 ) from None
            yield doc


@dataclass
class Shard:
    """One shard of the manifest: its file, its range of the source (jsonl: lines [first, last], 1-based, and bytes
    [start, stop); datasets: rows [start, stop)) and, once written, its counts and sha256."""
    file: str
    lines: list[int] | None = None
    bytes: list[int] | None = None
    rows: list[int] | None = None
    documents: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    sha256: str = ""
    record: dict = field(default_factory=dict)  # the file's size and block CRCs (core.files), checked when read
    images_sha256: str = ""  # its images' records (``images_file``), where its documents hold images


def images_file(shard_file: str) -> str:
    """The file beside a shard that records its images (``ImageRecord``s in the order of their tokens)."""
    return shard_file.removesuffix(".npy") + ".images.json"


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.npy"


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def files_sha256(files: list[Path]) -> str:
    """The sha256 of one file, or of the files' names and sha256s in order."""
    if len(files) == 1:
        return file_sha256(files[0])
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def _plan(source: Path, docs_per_shard: int) -> list[Shard]:
    """Contiguous line ranges of ``docs_per_shard`` non-blank lines each (the last one to the end of the file)."""
    starts: list[tuple[int, int]] = []  # (line, byte) of each shard's first line
    nonblank, lineno, offset = 0, 0, 0
    with source.open("rb") as f:
        for raw in f:
            lineno += 1
            if raw.strip():
                if nonblank % docs_per_shard == 0:
                    starts.append((lineno, offset) if starts else (1, 0))
                nonblank += 1
            offset += len(raw)
    ends = [(line - 1, byte) for line, byte in starts[1:]] + [(lineno, offset)]
    return [Shard(shard_name(i), [line, end_line], [byte, end_byte])
            for i, ((line, byte), (end_line, end_byte)) in enumerate(zip(starts, ends))]


class Corpus(Protocol):
    """What ``tokenize_to_shards`` reads; picklable, for the worker processes."""

    source: str  # for the manifest: the path(s) it was read from
    reader: str  # how documents are read from it, e.g. "jsonl" or "hf parquet column=text"

    def files(self) -> list[Path]: ...  # the files its sha256 covers

    def plan(self, docs_per_shard: int) -> list[Shard]: ...  # contiguous runs of documents, in order

    def docs(self, tok: QwenTokenizer, shard: Shard) -> Iterator[Doc]: ...  # the documents of one shard

    def work(self, shard: Shard) -> int: ...  # the shard's share of the corpus, in the units the ETA counts


@dataclass(frozen=True)
class JsonlCorpus:
    """A .jsonl file; a shard is a run of non-blank lines (its bytes, for the ETA). ``vision``: the model's vision
    side, which reads image parts (None: they are refused)."""
    path: Path
    vision: VisionData | None = None

    @property
    def reader(self) -> str:
        return "jsonl" if self.vision is None else f"jsonl images {self.vision.key()}"

    @property
    def source(self) -> str:
        return str(self.path)

    def files(self) -> list[Path]:
        return [self.path]

    def plan(self, docs_per_shard: int) -> list[Shard]:
        return _plan(self.path, docs_per_shard)

    def docs(self, tok: QwenTokenizer, shard: Shard) -> Iterator[Doc]:
        return jsonl_docs(self.path, tok, shard.bytes[0], shard.bytes[1], shard.lines[0], self.vision)

    def work(self, shard: Shard) -> int:
        return shard.bytes[1] - shard.bytes[0]


@dataclass
class Manifest:
    source: str
    source_sha256: str
    source_bytes: int
    reader: str
    tokenizer: str
    docs_per_shard: int
    shards: list[Shard]  # every shard of the plan; done: those written (sha256 set)
    layout: str = "[2, n] uint32: token ids, trained mask (1 = trained)"
    format: int = _FORMAT
    totals: dict = field(default_factory=dict)  # documents, tokens, trained_tokens once every shard is done

    @property
    def complete(self) -> bool:
        return all(s.sha256 for s in self.shards)

    def stream(self, out_dir: Path) -> np.ndarray:
        """The [2, N] uint32 concatenation of the shards in order (the whole corpus)."""
        parts = [np.load(out_dir / s.file) for s in self.shards]
        return np.concatenate(parts, axis=1) if parts else np.zeros((2, 0), dtype=np.uint32)

    def images(self, out_dir: Path) -> list[ImageRecord]:
        """The corpus's images, in the order of their tokens in ``stream``."""
        return [ImageRecord.from_json(entry) for s in self.shards if s.images_sha256
                for entry in json.loads((out_dir / images_file(s.file)).read_text())]


_worker: tuple[Corpus, QwenTokenizer] | None = None  # this process's corpus and tokenizer


def _init_worker(corpus: Corpus, tokenizer: str) -> None:
    global _worker
    _worker = corpus, QwenTokenizer(tokenizer)


def _tokenize_shard(entry: dict) -> tuple[dict, np.ndarray, list[dict]]:
    """One shard's manifest entry (its counts), its [2, n] uint32 array, tokenized from its range of the corpus, and
    its images' records."""
    corpus, tok = _worker
    shard = Shard(**entry)
    docs = list(corpus.docs(tok, shard))
    array = join_docs(docs)
    shard.documents, shard.tokens, shard.trained_tokens = len(docs), array.shape[1], int(array[1].sum())
    return asdict(shard), array, [image.to_json() for doc in docs for image in doc.images]


class _Progress:
    """One stderr line, rewritten as shards finish: shards, tokens, tokens/s, ETA."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.start = total, enabled, time.monotonic()
        self.done = self.tokens = self.work = 0

    def update(self, shard: Shard, work: int, todo_work: int) -> None:
        self.done, self.tokens, self.work = self.done + 1, self.tokens + shard.tokens, self.work + work
        if not self.enabled:
            return
        elapsed = max(time.monotonic() - self.start, 1e-9)
        eta = elapsed * (todo_work - self.work) / max(self.work, 1)  # by source bytes or rows: shards differ in size
        line = (f"shards {self.done}/{self.total}  {self.tokens:,} tokens  {self.tokens / elapsed:,.0f} tokens/s  "
                f"ETA {eta:.0f}s")
        tty = sys.stderr.isatty()  # a terminal: one line rewritten in place; a log file: a line per shard
        print(f"\r{line}   " if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.done and sys.stderr.isatty():
            print(file=sys.stderr, flush=True)


def _resumable(out_dir: Path, manifest: Manifest) -> dict[str, Shard]:
    """The shards of a previous run into ``out_dir`` of the same plan whose files still match their sha256;
    ValueError if ``out_dir`` holds another source's or tokenizer's manifest."""
    try:
        old = json.loads((out_dir / MANIFEST).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{out_dir / MANIFEST} is unreadable ({e}); delete it (and the shards) to start over") \
            from None
    keys = ("format", "source_sha256", "reader", "tokenizer", "docs_per_shard")
    theirs = {k: old.get(k) for k in keys}
    ours = {k: getattr(manifest, k) for k in keys}
    if theirs != ours:
        diff = ", ".join(f"{k}: {theirs[k]!r} there, {ours[k]!r} now" for k in keys if theirs[k] != ours[k])
        raise ValueError(f"{out_dir} holds shards of another tokenization ({diff}); use an empty directory or "
                         "delete that one")
    plan = {s.file: s for s in manifest.shards}
    done = {}
    for entry in old.get("shards", []):
        shard = Shard(**entry)
        mine = plan.get(shard.file)
        images = out_dir / images_file(shard.file)
        if (shard.sha256 and mine is not None and (mine.lines, mine.bytes, mine.rows) == (shard.lines, shard.bytes,
                                                                                          shard.rows)
                and (out_dir / shard.file).is_file() and file_sha256(out_dir / shard.file) == shard.sha256
                and (not shard.images_sha256 or images.is_file() and file_sha256(images) == shard.images_sha256)):
            done[shard.file] = shard
    return done


def _check_only_ours(out_dir: Path, manifest: Manifest, resumed: bool) -> None:
    """ValueError naming the token-shard files (.npy, .bin) in ``out_dir`` that this tokenization did not write:
    without a manifest, all of them (a user's shard_00000.npy would be overwritten; an old run's stale shards would
    be read with the new ones); with one (``resumed``), those outside its plan. Nothing is written before."""
    planned = {s.file for s in manifest.shards} if resumed else set()
    foreign = sorted(p.name for p in out_dir.iterdir() if p.is_file() and p.suffix in SHARD_SUFFIXES
                     and p.name not in planned)
    if foreign:
        what = "its manifest.json does not plan them" if resumed else f"no {MANIFEST} records them"
        listed = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ValueError(f"{out_dir} holds {listed}, which scripts/pretokenize.py did not write ({what}): it would "
                         "overwrite them or leave them to be read with its shards; use an empty directory, or move "
                         "them out")


def _write_manifest(out_dir: Path, manifest: Manifest) -> None:

    if manifest.complete:
        manifest.totals = {k: sum(getattr(s, k) for s in manifest.shards)
                           for k in ("documents", "tokens", "trained_tokens")}
    atomic_write_text(out_dir / MANIFEST, json.dumps(asdict(manifest), indent=1) + "\n")


def _a(kind: str) -> str:
    return "a file" if kind == "file" else kind


def tokenize_to_shards(corpus: Corpus | Path, out_dir: Path, tokenizer: str, *, workers: int = 1,
                       docs_per_shard: int = 10_000, progress: bool = False, source_sha256: str | None = None,
                       max_shards: int | None = None) -> Manifest:
    """Tokenize ``corpus`` (a path: a .jsonl file) into ``out_dir`` (see the module docstring) over ``workers``
    processes (1: in this process); resumes from the shards a previous run finished. ``source_sha256``: the
    corpus's ``files_sha256`` where the caller has it. ``max_shards`` stops after that many new shards (an
    interrupted run, for tests). Returns the manifest as written."""
    out_dir = Path(out_dir)
    if isinstance(corpus, (str, Path)):
        if not Path(corpus).is_file():
            raise FileNotFoundError(f"no such file {corpus} (a .jsonl corpus)")
        corpus = JsonlCorpus(Path(corpus))
    if workers < 1:
        raise ValueError(f"workers={workers} must be at least 1")
    if docs_per_shard < 1:
        raise ValueError(f"docs_per_shard={docs_per_shard} must be at least 1")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer {tokenizer!r} is unknown; choose one of {', '.join(TOKENIZERS)}")
    blocker = nearest_existing(out_dir)  # out_dir or the parent it would be made in: a directory, or refused here
    if file_kind(blocker) != "directory":
        what = "is" if blocker == out_dir else f"cannot be made: {blocker} is"
        raise ValueError(f"the token shards' directory {out_dir} {what} {_a(file_kind(blocker))}, not a directory: "
                         "name a new or empty directory (or that of an earlier run of this tokenization, which it "
                         "continues)")
    files = corpus.files()
    manifest = Manifest(corpus.source, source_sha256 or files_sha256(files), sum(f.stat().st_size for f in files),
                        corpus.reader, tokenizer, docs_per_shard, corpus.plan(docs_per_shard))
    out_dir.mkdir(parents=True, exist_ok=True)
    done = _resumable(out_dir, manifest)
    _check_only_ours(out_dir, manifest, resumed=(out_dir / MANIFEST).is_file())
    manifest.shards = [done.get(s.file, s) for s in manifest.shards]
    todo = [s for s in manifest.shards if not s.sha256][:max_shards]
    index = {s.file: i for i, s in enumerate(manifest.shards)}
    bar = _Progress(len(todo), progress)
    todo_work = sum(corpus.work(s) for s in todo)
    jobs = [asdict(s) for s in todo]
    _write_manifest(out_dir, manifest)

    def finish(result: tuple[dict, np.ndarray, list[dict]]) -> None:
        shard = Shard(**result[0])
        if result[2]:  # before the shard: a shard written is a shard whose images are recorded
            atomic_write_text(out_dir / images_file(shard.file), json.dumps(result[2]))
            shard.images_sha256 = file_sha256(out_dir / images_file(shard.file))
        atomic_write_npy(out_dir / shard.file, result[1])
        shard.sha256 = file_sha256(out_dir / shard.file)
        shard.record = record_paths([out_dir / shard.file])[out_dir / shard.file]
        manifest.shards[index[shard.file]] = shard
        _write_manifest(out_dir, manifest)
        bar.update(shard, corpus.work(shard), todo_work)

    try:
        if workers == 1 or len(jobs) <= 1:
            _init_worker(corpus, tokenizer)
            for job in jobs:
                finish(_tokenize_shard(job))
        else:
            # spawn: the parent may hold threads or a device context that a forked child must not inherit. An
            # executor, not a Pool: a worker that dies (e.g. a script without a __main__ guard) fails, not hangs.
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx, initializer=_init_worker,
                                     initargs=(corpus, tokenizer)) as pool:
                try:
                    for future in as_completed([pool.submit(_tokenize_shard, job) for job in jobs]):
                        finish(future.result())
                except BrokenProcessPool as e:
                    raise RuntimeError(f"a tokenizing worker process died ({e}); a script that starts them must "
                                       "guard its code with `if __name__ == \"__main__\":`, or use workers=1") \
                        from None
    finally:
        bar.close()
    return manifest
