"""Offline data pipeline: tokenize a corpus once (cached), pack it into fixed windows, serve batches.

Every document is tokenized, followed by <|endoftext|>, and concatenated into one stream of ids with a
parallel loss mask. The stream is cut into non-overlapping windows of seq_len + 1 tokens (the tail is
dropped). Window order is a per-epoch permutation fixed by the seed. Global micro-batch k is windows
[k*g, (k+1)*g) of that order, with g = local_batch_size * dp_size, and dp rank r takes the contiguous
rows [r*local_batch_size, (r+1)*local_batch_size), so batches do not depend on the parallel layout.

Pre-tokenized data (``data=tokens``) may be many shards (``training.token_shards``: one memory-mapped stream) and a
mixture of sources (``data.sources``): then slot j of global batch n comes from the source drawn for it by
``np.random.default_rng([seed, n])`` with the sources' weights, and each source hands out its windows, slot by slot,
from its own seeded per-epoch order with its own epoch and position. The draw depends on (seed, n) only, so a
mixture's batches, too, do not depend on the parallel layout.

Validation (``data.val_fraction``): the last fraction of each source's tokens, from the first document start at or
after the cut, is held out; its windows, in order (source after source), make the fixed validation batches
(``ValidationSet``), cut like the training batches into dp ranks' rows, so their loss does not depend on the layout.

Packed documents (``data.document_mask``): position ids restart at each document start (after <|endoftext|>), which
tells the model to keep attention and DeltaNet within documents (``models.layers.document_ids``). Under context
parallelism the cp ranks of a dp slice read the same rows, each keeping its contiguous 1/cp (``context_shard``).

Letters as in DEVELOPERS.md: B the local batch, T seq_len, T1 = seq_len + 1.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.resources
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.constants import IGNORE_INDEX
from training.token_shards import BIN_DTYPES, TokenStream, WindowOrder, load_token_stream, shard_paths
from training.hf_datasets import hf_corpus, hf_files
from training.tokenize_shards import (Corpus, Doc, JsonlCorpus, chat_doc, files_sha256, join_docs, tokenize_to_shards,
                                      write_npy)
from training.tokenizer import TOKENIZERS, QwenTokenizer, special_tokens

_NAMES = ("chitchat", "jsonl", "hf", "tokens")
_CACHE_VERSION = 2  # bump when the rendering or the validation of documents changes (2: roles, field types)
_TOKENIZE_WORKERS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
_CACHE_DOCS_PER_SHARD = 10_000  # jsonl documents per shard of the cache's tokenization (one process each)

logger = logging.getLogger(__name__)


@dataclass
class SourceConfig:
    """One source of a data.sources mixture."""
    path: str = ""  # as data.path of data=tokens: a .npy / .bin shard, a directory of them, or a glob
    weight: float = 1.0  # relative share of the global batch's windows (the weights need not sum to 1)
    name: str | None = None  # in metrics (data/share/<name>) and the loader state; None: the path's last part


@dataclass
class DataConfig:
    name: str = "chitchat"  # chitchat | jsonl | hf | tokens
    # jsonl: .jsonl file; hf: datasets files (training.hf_datasets); tokens: a .npy / raw .bin shard, a directory of
    # them or a glob; chitchat: dataset.json
    path: str | None = None
    column: str | None = None  # hf: the text or messages column (None: messages if there is one, else text)
    bin_dtype: str = "uint32"  # tokens: the dtype of raw little-endian .bin shards (uint16, int32, ...)
    sources: list[SourceConfig] | None = None  # tokens: a weighted mixture of token sources instead of data.path
    seq_len: int = 256
    # The tokenizer is the model's (model.tokenizer): build_data_loader takes it from the caller.
    mask_non_assistant: bool = False  # chat data: loss only on assistant tokens
    cache_dir: str = ".cache/data"  # tokenized-corpus cache
    # Position ids restart at every document, so no token attends to (or DeltaNet carries state from) another
    # document of its packed window; false: each window is one causal sequence.
    document_mask: bool = True
    eos_id: int | None = None  # tokens: the id ending each document (None: none known); other data: <|endoftext|>
    val_fraction: float = 0.0  # the last fraction of each source's tokens held out (whole documents) for validation


def _source_path(cfg: DataConfig) -> Path:
    if cfg.path:
        return Path(cfg.path)
    return Path(str(importlib.resources.files("chitchat_dataset") / "dataset.json"))


def validate_data_config(cfg: DataConfig) -> None:
    """Raise ValueError / FileNotFoundError naming the offending ``data.*`` field and the fix."""
    if cfg.name not in _NAMES:
        raise ValueError(f"data.name={cfg.name!r} is unknown; choose one of {', '.join(_NAMES)}")
    if not isinstance(cfg.seq_len, int) or cfg.seq_len <= 0:
        raise ValueError(f"data.seq_len={cfg.seq_len!r} must be a positive integer, e.g. data.seq_len=256")
    if cfg.sources is not None:
        _validate_sources(cfg)
    elif cfg.name != "chitchat" and not cfg.path:
        fix = " (or a mixture: data.sources)" if cfg.name == "tokens" else ""
        raise ValueError(f"data.path is required for data.name={cfg.name}; set data.path=/path/to/file{fix}")
    if cfg.bin_dtype not in BIN_DTYPES:
        raise ValueError(f"data.bin_dtype={cfg.bin_dtype!r} is unknown; choose one of {', '.join(BIN_DTYPES)}")
    if cfg.eos_id is not None and (cfg.name != "tokens" or cfg.eos_id < 0):
        raise ValueError(f"data.eos_id={cfg.eos_id} must be a token id and is for data.name=tokens only; chat and text "
                         "data end documents with the tokenizer's <|endoftext|>")
    if not cfg.cache_dir:
        raise ValueError("data.cache_dir must be a directory for the tokenized-corpus cache, e.g. .cache/data")
    if not 0 <= cfg.val_fraction < 1:
        raise ValueError(f"data.val_fraction={cfg.val_fraction} must be in [0, 1): the share of each source held out "
                         "for validation, e.g. data.val_fraction=0.01")
    if cfg.column is not None and cfg.name != "hf":
        raise ValueError(f"data.column={cfg.column!r} names a column of datasets files (data.name=hf); unset it for "
                         f"data.name={cfg.name}")
    if cfg.name == "tokens":
        for key, path in _token_paths(cfg):
            shard_paths(path, key)
    elif cfg.name == "hf":
        hf_files(cfg.path)
    elif not _source_path(cfg).is_file():
        raise FileNotFoundError(f"data.path: no such file {_source_path(cfg)}")


def _validate_sources(cfg: DataConfig) -> None:
    if cfg.name != "tokens":
        raise ValueError(f"data.sources (a mixture) is for data.name=tokens only for now, got data.name={cfg.name}; "
                         "pre-tokenize the sources or use one data.path")
    if cfg.path:
        raise ValueError(f"data.sources and data.path={cfg.path} are both set; a mixture names its paths in "
                         "data.sources, so unset data.path (data.path=null)")
    if not cfg.sources:
        raise ValueError("data.sources is empty; give at least one {path: ..., weight: ...} or unset it")
    for i, src in enumerate(cfg.sources):
        if not isinstance(src, SourceConfig) or not src.path:
            raise ValueError(f"data.sources[{i}] must be {{path: ..., weight: ...}} with a path, got {src!r}")
        if not isinstance(src.weight, (int, float)) or not src.weight > 0:
            raise ValueError(f"data.sources[{i}].weight={src.weight!r} must be a positive number")
    names = source_names(cfg.sources)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"data.sources name {repeated[0]!r} more than once; give each source a distinct name "
                         "(data.sources[i].name)")


def source_names(sources: list[SourceConfig]) -> list[str]:
    """Each source's name: its ``name``, else the last part of its path that is not a glob (its stem)."""
    names = []
    for src in sources:
        path = Path(src.path)
        while any(c in path.name for c in "*?[") and path.parent != path:
            path = path.parent
        names.append(src.name or path.stem)
    return names


def _token_paths(cfg: DataConfig) -> list[tuple[str, str]]:
    """(config key, path) of each token source of ``cfg`` (data=tokens)."""
    if cfg.sources is None:
        return [("data.path", cfg.path)]
    return [(f"data.sources[{i}].path", src.path) for i, src in enumerate(cfg.sources)]


def _chitchat_docs(path: Path, tok: QwenTokenizer) -> Iterator[Doc]:
    """One ChatML document per conversation: the speakers alternate user / assistant (the first one is
    the user) and a speaker's consecutive messages are joined with newlines."""
    for conv in json.loads(path.read_bytes()).values():
        utterances = [u for group in conv["messages"] for u in group]
        runs = itertools.groupby(utterances, key=lambda u: u["sender"])
        turns = ["\n".join(u["text"] for u in run) for _, run in runs]
        yield chat_doc(tok, [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)])


def _corpus(cfg: DataConfig) -> Corpus | None:
    """What ``training.tokenize_shards`` reads for jsonl and hf data (chitchat: None, it has its own reader)."""
    if cfg.name == "hf":
        return hf_corpus(cfg.path, cfg.column, cfg.cache_dir)
    return JsonlCorpus(Path(cfg.path)) if cfg.name == "jsonl" else None


def _tokenized_stream(cfg: DataConfig, tokenizer: str) -> np.ndarray:
    """[2, N] uint32 (ids, loss mask) of the whole corpus, from the cache (keyed by the files' contents, how they
    are read and the tokenizer) or tokenized and cached. jsonl and hf data are tokenized by
    ``training.tokenize_shards`` over min(4, CPUs) processes into ``<cache>.shards/`` (an interrupted start-up
    resumes there), then joined into the cache file; processes sharing the cache directory take turns (a file
    lock), so the corpus is tokenized once."""
    corpus = _corpus(cfg)
    source_sha256 = files_sha256(corpus.files() if corpus else [_source_path(cfg)])
    reader = corpus.reader if corpus else cfg.name
    digest = hashlib.sha256(f"{source_sha256}|v{_CACHE_VERSION}|{cfg.name}|{reader}|{tokenizer}".encode())
    cache = Path(cfg.cache_dir) / f"{cfg.name}-{tokenizer}-{digest.hexdigest()[:16]}.npy"
    if cache.exists():
        return np.load(cache)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with _cache_lock(cache) as locked:
        if cache.exists():  # another process tokenized it while this one waited
            return np.load(cache)
        if corpus is None:
            stream = join_docs(_chitchat_docs(_source_path(cfg), QwenTokenizer(tokenizer)))
        else:
            shards = cache.with_name(cache.stem + ".shards")
            start = time.monotonic()
            manifest = tokenize_to_shards(corpus, shards, tokenizer, workers=_TOKENIZE_WORKERS,
                                          docs_per_shard=_CACHE_DOCS_PER_SHARD, source_sha256=source_sha256)
            stream = manifest.stream(shards)
            logger.info("tokenized %s: %d documents, %d tokens in %.1fs over %d shards", corpus.source,
                        sum(s.documents for s in manifest.shards), stream.shape[1], time.monotonic() - start,
                        len(manifest.shards))
        write_npy(cache, stream)
        if corpus is not None and locked:  # unlocked, another process may still be writing shards there
            shutil.rmtree(shards, ignore_errors=True)
    return stream


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


class Span:
    """Tokens [start, stop) of a 1-D id or mask sequence (an array or a TokenStream), indexable like it."""

    def __init__(self, seq: np.ndarray | TokenStream | Span, start: int, stop: int) -> None:
        self._seq, self._start, self._len = seq, start, stop - start

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: np.ndarray) -> np.ndarray:
        return self._seq[np.asarray(index) + self._start]


@dataclass
class Source:
    """One stream of windows for PackedLoader."""
    name: str
    ids: np.ndarray | TokenStream | Span  # 1-D ids
    mask: np.ndarray | TokenStream | Span | None = None  # 1-D loss mask of the targets; None: every target trained
    weight: float = 1.0


_SEARCH_BLOCK = 1 << 20  # ids read at a time looking for a document start


def hold_out(src: Source, fraction: float, eos_id: int) -> tuple[Source, Source]:
    """(training, validation) parts of ``src``: validation from the first document start (the token after an
    ``eos_id``) at or after ``(1 - fraction)`` of its tokens, so it holds whole documents only."""
    n = len(src.ids)
    cut = int(n * (1 - fraction))
    while cut < n:
        block = src.ids[np.arange(max(cut - 1, 0), min(cut - 1 + _SEARCH_BLOCK, n))]
        ends = np.flatnonzero(block == eos_id)
        if ends.size:
            cut = max(cut - 1, 0) + int(ends[0]) + 1
            break
        cut += _SEARCH_BLOCK
    if cut >= n:
        raise ValueError(f"data.val_fraction={fraction}: no document starts in the last {fraction:.1%} of "
                         f"{src.name!r} ({n} tokens); raise data.val_fraction or check data.eos_id")

    def part(start: int, stop: int) -> Source:
        mask = None if src.mask is None else Span(src.mask, start, stop)
        return Source(src.name, Span(src.ids, start, stop), mask, src.weight)

    return part(0, cut), part(cut, n)


def position_ids(input_ids_BT: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """Distance of each token from its document's start: the window start, or the token after an eos (None: the
    window is one document)."""
    t_BT = torch.arange(input_ids_BT.shape[1]).expand_as(input_ids_BT)
    if eos_id is None:
        return t_BT.contiguous()
    start_BT = torch.zeros_like(input_ids_BT, dtype=torch.bool)
    start_BT[:, 0] = True
    start_BT[:, 1:] = input_ids_BT[:, :-1] == eos_id
    return t_BT - torch.where(start_BT, t_BT, 0).cummax(dim=1).values


def packed_batch(sources: list[Source], source_B: np.ndarray, windows_B: np.ndarray, seq_len: int,
                 eos_id: int | None) -> dict[str, torch.Tensor]:
    """input_ids, labels (IGNORE_INDEX where the mask says untrained) and position_ids of window ``windows_B[b]``
    of source ``source_B[b]`` for each row b."""
    index_BT1 = windows_B[:, None] * (seq_len + 1) + np.arange(seq_len + 1)
    tokens_BT1 = np.empty(index_BT1.shape, dtype=np.int64)
    trained_BT = np.ones((len(windows_B), seq_len), dtype=bool)
    for s in np.unique(source_B):
        at_B, src = source_B == s, sources[s]
        tokens_BT1[at_B] = src.ids[index_BT1[at_B]]
        if src.mask is not None:
            trained_BT[at_B] = src.mask[index_BT1[at_B][:, 1:]].astype(bool)
    tokens_BT1 = torch.from_numpy(tokens_BT1)
    labels_BT = tokens_BT1[:, 1:].clone()
    labels_BT[~torch.from_numpy(trained_BT)] = IGNORE_INDEX
    input_ids_BT = tokens_BT1[:, :-1].contiguous()
    return {"input_ids": input_ids_BT, "labels": labels_BT, "position_ids": position_ids(input_ids_BT, eos_id)}


class ValidationSet:
    """The held-out windows of every source, in order, cut into global batches like the training ones; a dp rank's
    rows of the first n batches are the same whatever the layout with the same global batch."""

    def __init__(self, sources: list[Source], *, seq_len: int, eos_id: int | None, local_batch_size: int,
                 dp_rank: int, dp_size: int) -> None:
        self._sources, self._seq_len, self._eos_id = sources, seq_len, eos_id
        counts = [len(src.ids) // (seq_len + 1) for src in sources]
        self._source_W = np.repeat(np.arange(len(sources)), counts)
        self._window_W = np.concatenate([np.arange(c) for c in counts])
        self._local, self._global, self._offset = local_batch_size, local_batch_size * dp_size, \
            dp_rank * local_batch_size

    @property
    def num_batches(self) -> int:
        return len(self._window_W) // self._global

    def batches(self, n: int) -> list[dict[str, torch.Tensor]]:
        """This rank's rows of the first ``n`` global batches."""
        if n > self.num_batches:
            raise ValueError(f"train.eval_batches={n} global batches of validation need {n * self._global} windows "
                             f"of data.seq_len={self._seq_len}, and the held-out data has {len(self._window_W)}; "
                             "raise data.val_fraction or lower train.eval_batches")
        rows = [k * self._global + self._offset + np.arange(self._local) for k in range(n)]
        return [packed_batch(self._sources, self._source_W[r], self._window_W[r], self._seq_len, self._eos_id)
                for r in rows]


class PackedLoader:
    """Endless iterator of packed batches for one dp rank; see the module docstring for the order."""

    def __init__(
        self,
        sources: list[Source],
        *,
        seq_len: int,
        vocab_size: int,
        seed: int,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        eos_id: int | None = None,
    ) -> None:
        self._sources = sources
        self._eos_id = eos_id  # None: position ids 0..T-1 in every window, else restarting after each eos
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self._seed = seed
        self._local_batch = local_batch_size
        self._rank_offset = dp_rank * local_batch_size
        self._global_batch = local_batch_size * dp_size
        mixture = len(sources) > 1
        self._orders = [WindowOrder(len(src.ids) // (seq_len + 1), (seed, i) if mixture else (seed,))
                        for i, src in enumerate(sources)]
        for src, order in zip(sources, self._orders):
            if order.num_windows < self._global_batch:
                what = f"source {src.name!r} of data.sources" if mixture else "corpus"
                raise ValueError(
                    f"{what} too small: {len(src.ids)} tokens make {order.num_windows} windows of "
                    f"data.seq_len={seq_len} (+1), fewer than one global batch of {self._global_batch}; lower "
                    "data.seq_len or the batch size"
                )
        self.num_windows = sum(order.num_windows for order in self._orders)
        self.validation: ValidationSet | None = None  # the held-out data (build_data_loader, data.val_fraction)
        weights = np.array([src.weight for src in sources], dtype=np.float64)
        self._p = weights / weights.sum()
        self._drawn = 0  # windows of all global batches so far (a mixture's position)
        self._windows = [0] * len(sources)  # per source: windows of all global batches so far

    @property
    def epoch(self) -> int:
        """The single source's epoch; a mixture has none of its own (0): its sources' are in state_dict."""
        return self._orders[0].epoch if len(self._orders) == 1 else 0

    @property
    def position(self) -> int:
        """The single source's index in its epoch's order; a mixture's windows drawn so far (n x global batch)."""
        return self._orders[0].position if len(self._orders) == 1 else self._drawn

    def __iter__(self) -> PackedLoader:
        return self

    def _global_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """Source and window of each slot of the next global batch; advances every source's order."""
        g = self._global_batch
        if len(self._orders) == 1:
            source_G, window_G = np.zeros(g, dtype=np.int64), self._orders[0].take(g)
        else:
            source_G = np.random.default_rng([self._seed, self._drawn // g]).choice(len(self._orders), size=g,
                                                                                   p=self._p)
            window_G = np.empty(g, dtype=np.int64)
            for s, order in enumerate(self._orders):
                at = source_G == s
                window_G[at] = order.take(int(at.sum()))
        for s in range(len(self._orders)):
            self._windows[s] += int((source_G == s).sum())
        self._drawn += g
        return source_G, window_G

    def __next__(self) -> dict[str, torch.Tensor]:
        source_G, window_G = self._global_slots()
        rows = slice(self._rank_offset, self._rank_offset + self._local_batch)
        return packed_batch(self._sources, source_G[rows], window_G[rows], self.seq_len, self._eos_id)

    def mixture_metrics(self) -> dict[str, float]:
        """Realised share of each source's windows over all global batches so far ({} without a mixture)."""
        if len(self._sources) == 1 or not self._drawn:
            return {}
        return {f"data/share/{src.name}": n / self._drawn for src, n in zip(self._sources, self._windows)}

    def state_dict(self) -> dict:
        """{"epoch", "position"}; a mixture adds "sources": {name: {"epoch", "position", "windows"}}."""
        state: dict = {"epoch": self.epoch, "position": self.position}
        if len(self._sources) > 1:
            state["sources"] = {src.name: {"epoch": order.epoch, "position": order.position, "windows": n}
                                for src, order, n in zip(self._sources, self._orders, self._windows)}
        return state

    def load_state_dict(self, state: dict) -> None:
        names = [src.name for src in self._sources]
        saved = sorted(state.get("sources", {}))
        if (len(names) > 1 and saved != sorted(names)) or (len(names) == 1 and saved):
            raise ValueError(f"the checkpoint's data loader state has the sources {saved or 'of one data.path'}, "
                             f"and this run reads {sorted(names) if len(names) > 1 else 'one data.path'}; resume "
                             "with the checkpointed run's data.path / data.sources")
        if len(names) == 1:
            self._orders[0].epoch, self._orders[0].position = int(state["epoch"]), int(state["position"])
            return
        self._drawn = int(state["position"])
        for s, (name, order) in enumerate(zip(names, self._orders)):
            source = state["sources"][name]
            order.epoch, order.position = int(source["epoch"]), int(source["position"])
            self._windows[s] = int(source["windows"])


def _check_trained_tokens(cfg: DataConfig, path: str | Path, mask: np.ndarray) -> None:
    """Raise ValueError if the tokenized corpus (fresh or cached), under ``data.mask_non_assistant``, trains nothing."""
    if mask.size == 0:
        raise ValueError(f"data.path={path} holds no documents (e.g. a jsonl file of blank lines); add documents or "
                         "point data.path at the right file")
    if cfg.mask_non_assistant and not mask.any():
        raise ValueError(f"data.path={path}: no assistant message anywhere: with data.mask_non_assistant=true nothing "
                         "would be trained; add assistant turns or set data.mask_non_assistant=false")


def _token_sources(cfg: DataConfig, tokenizer: str | None) -> tuple[list[Source], int, int | None]:
    """data=tokens: each source's shards, the vocabulary size they need and the id ending documents (data.eos_id,
    else the <|endoftext|> of the tokenizer their manifest names)."""
    sources, vocab_size, tokenized_by = [], 0, {}
    configs = cfg.sources or [SourceConfig(path=cfg.path)]
    for (key, path), name, src in zip(_token_paths(cfg), source_names(configs), configs):
        data = load_token_stream(path, cfg.bin_dtype, cfg.cache_dir, key)
        if cfg.mask_non_assistant and data.mask is None:
            raise ValueError(f"data.mask_non_assistant=true needs a loss mask, and {key}={path} holds plain ids; "
                             "tokenize chat data with scripts/pretokenize.py (its shards carry the mask) or set "
                             "data.mask_non_assistant=false")
        if data.tokenizer is not None:
            if tokenizer is not None and data.tokenizer != tokenizer:
                raise ValueError(f"{key}={path} was tokenized with {data.tokenizer} (its manifest.json) and the "
                                 f"model's tokenizer is {tokenizer}: set model.tokenizer={data.tokenizer} or "
                                 f"re-tokenize with scripts/pretokenize.py --tokenizer {tokenizer}")
            tokenized_by[key] = data.tokenizer
        sources.append(Source(name, data.ids, data.mask if cfg.mask_non_assistant else None, src.weight))
        vocab_size = max(vocab_size, data.vocab_size)
    if len(set(tokenized_by.values())) > 1:
        raise ValueError(f"data.sources were tokenized with different tokenizers ({tokenized_by}); mix sources of "
                         "one vocabulary")
    eos_id = cfg.eos_id
    if eos_id is None and tokenized_by:
        eos_id = special_tokens(next(iter(tokenized_by.values())))["<|endoftext|>"]
    return sources, vocab_size, eos_id


def build_data_loader(cfg: DataConfig, *, seed: int, local_batch_size: int, dp_rank: int, dp_size: int,
                      tokenizer: str | None = "qwen3") -> PackedLoader:
    """Validate ``cfg``, load (tokenizing with ``tokenizer``, the model's, and caching on first use) the corpus, and
    return dp rank's loader; with ``data.val_fraction``, its ``validation`` holds the held-out part (else None).
    ``tokenizer`` (a training.tokenizer vocabulary) is unused by pre-tokenized data."""
    validate_data_config(cfg)
    if cfg.name != "tokens" and tokenizer not in TOKENIZERS:
        raise ValueError(f"data.name={cfg.name} tokenizes its text with the model's tokenizer, and model.tokenizer "
                         f"gives {tokenizer!r}: choose one of {', '.join(TOKENIZERS)} (or pre-tokenized data=tokens)")
    if local_batch_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need local_batch_size > 0 and 0 <= dp_rank < dp_size, got "
                         f"local_batch_size={local_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}")
    if cfg.name == "tokens":
        sources, vocab_size, eos_id = _token_sources(cfg, tokenizer)
    else:
        ids, mask = _tokenized_stream(cfg, tokenizer)
        _check_trained_tokens(cfg, cfg.path or _source_path(cfg), mask)
        sources = [Source(cfg.name, ids, mask if cfg.mask_non_assistant else None)]
        tok = QwenTokenizer(tokenizer)
        vocab_size, eos_id = tok.vocab_size, tok.eos_id  # data text cannot forge it: eos ends documents only
    doc_eos_id = eos_id if cfg.document_mask else None  # what restarts position ids
    validation = None
    if cfg.val_fraction:
        if eos_id is None:
            raise ValueError("data.val_fraction holds out whole documents, and data=tokens knows none without "
                             "data.eos_id: set data.eos_id (the id that ends a document)")
        sources, held_out = zip(*(hold_out(src, cfg.val_fraction, eos_id) for src in sources))
        validation = ValidationSet(list(held_out), seq_len=cfg.seq_len, eos_id=doc_eos_id,
                                   local_batch_size=local_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    loader = PackedLoader(list(sources), seq_len=cfg.seq_len, vocab_size=vocab_size, seed=seed,
                          local_batch_size=local_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                          eos_id=doc_eos_id)
    loader.validation = validation
    return loader


def context_shard(batch: dict[str, torch.Tensor], cp_rank: int, cp: int) -> dict[str, torch.Tensor]:
    """This cp rank's contiguous 1/cp of every sequence of ``batch`` (tensors [..., T]; T divisible by cp)."""
    if cp == 1:
        return batch
    return {name: x.chunk(cp, dim=-1)[cp_rank].contiguous() for name, x in batch.items()}
