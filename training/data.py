"""Offline data pipeline: tokenize a corpus once (cached), pack it into fixed windows, serve batches.

Every document is tokenized, followed by <|endoftext|>, and concatenated into one stream of ids with a
parallel loss mask. The stream is cut into non-overlapping windows of seq_len + 1 tokens (the tail is
dropped). Window order is a per-epoch permutation fixed by the seed. Global micro-batch k is windows
[k*g, (k+1)*g) of that order, with g = local_batch_size * dp_size, and dp rank r takes the contiguous
rows [r*local_batch_size, (r+1)*local_batch_size), so batches do not depend on the parallel layout.

Packed documents (``data.document_mask``): position ids restart at each document start (after <|endoftext|>), which
tells the model to keep attention and DeltaNet within documents (``models.layers.document_ids``). Under context
parallelism the cp ranks of a dp slice read the same rows, each keeping its contiguous 1/cp (``context_shard``).

Letters as in DEVELOPERS.md: B the local batch, T seq_len, T1 = seq_len + 1.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import itertools
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.constants import IGNORE_INDEX
from training.tokenizer import CHAT_ROLES, TOKENIZERS, QwenTokenizer

_NAMES = ("chitchat", "jsonl", "tokens")
_CACHE_VERSION = 2  # bump when the rendering or the validation of documents changes (2: roles, field types)
_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}
_MESSAGE = '{"role": ..., "content": ...}'

Doc = tuple[list[int], list[bool]]  # token ids, loss mask (True = trained)


@dataclass
class DataConfig:
    name: str = "chitchat"  # chitchat | jsonl | tokens
    path: str | None = None  # jsonl: .jsonl file; tokens: .npy or raw uint32 .bin; chitchat: dataset.json override
    seq_len: int = 256
    # The tokenizer is the model's (model.tokenizer): build_data_loader takes it from the caller.
    mask_non_assistant: bool = False  # chat data: loss only on assistant tokens
    cache_dir: str = ".cache/data"  # tokenized-corpus cache
    # Position ids restart at every document, so no token attends to (or DeltaNet carries state from) another
    # document of its packed window; false: each window is one causal sequence.
    document_mask: bool = True
    eos_id: int | None = None  # tokens: the id ending each document (None: none known); other data: <|endoftext|>


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
    if cfg.name == "tokens" and cfg.mask_non_assistant:
        raise ValueError("data.mask_non_assistant=true needs chat data (data.name=jsonl or chitchat); "
                         "pre-tokenized data has no loss mask")
    if cfg.name != "chitchat" and not cfg.path:
        raise ValueError(f"data.path is required for data.name={cfg.name}; set data.path=/path/to/file")
    if cfg.name == "tokens" and Path(cfg.path).suffix not in (".npy", ".bin"):
        raise ValueError(f"data.path={cfg.path!r} must be a .npy array or a raw uint32 .bin file for data.name=tokens")
    if cfg.eos_id is not None and (cfg.name != "tokens" or cfg.eos_id < 0):
        raise ValueError(f"data.eos_id={cfg.eos_id} must be a token id and is for data.name=tokens only; chat and text "
                         "data end documents with the tokenizer's <|endoftext|>")
    if not cfg.cache_dir:
        raise ValueError("data.cache_dir must be a directory for the tokenized-corpus cache, e.g. .cache/data")
    path = _source_path(cfg)
    if not path.is_file():
        raise FileNotFoundError(f"data.path: no such file {path}")


def _text_doc(tok: QwenTokenizer, text: str) -> Doc:
    ids = tok.encode(text) + [tok.eos_id]
    return ids, [True] * len(ids)


def _chat_doc(tok: QwenTokenizer, messages: list[dict]) -> Doc:
    ids, mask = tok.render_chat(messages)
    return ids + [tok.eos_id], mask + [False]


def _chitchat_docs(path: Path, tok: QwenTokenizer) -> Iterator[Doc]:
    """One ChatML document per conversation: the speakers alternate user / assistant (the first one is
    the user) and a speaker's consecutive messages are joined with newlines."""
    for conv in json.loads(path.read_bytes()).values():
        utterances = [u for group in conv["messages"] for u in group]
        runs = itertools.groupby(utterances, key=lambda u: u["sender"])
        turns = ["\n".join(u["text"] for u in run) for _, run in runs]
        yield _chat_doc(tok, [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)])


def _check_message(i: int, msg: object) -> None:
    """Raise ValueError unless ``msg`` is {"role": one of CHAT_ROLES, "content": a string}."""
    if not isinstance(msg, dict):
        raise ValueError(f"messages[{i}] must be an object {_MESSAGE}, got {_JSON_TYPES[type(msg)]}")
    for key in ("role", "content"):
        if key not in msg:
            raise ValueError(f"messages[{i}] has no {key!r}; every message is an object {_MESSAGE} of strings")
        if not isinstance(msg[key], str):
            raise ValueError(f"messages[{i}].{key} must be a string, got {_JSON_TYPES[type(msg[key])]}")
    if msg["role"] not in CHAT_ROLES:
        raise ValueError(f"messages[{i}].role {msg['role']!r} is unknown; use one of {', '.join(CHAT_ROLES)} "
                         "(lowercase, the chat template's roles)")


def _jsonl_row(row: object) -> str | list[dict]:
    """The text or the chat messages of one parsed jsonl row; ValueError says what is wrong and what is expected."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object with a 'text' or a 'messages' field, got {_JSON_TYPES[type(row)]}")
    if "text" in row and "messages" in row:
        raise ValueError("the object has both 'text' and 'messages'; give one of them (a document or a chat)")
    if "text" in row:
        if not isinstance(row["text"], str):
            raise ValueError(f"'text' must be a string, got {_JSON_TYPES[type(row['text'])]}")
        return row["text"]
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            got = "an empty list" if messages == [] else _JSON_TYPES[type(messages)]
            raise ValueError(f"'messages' must be a non-empty list of {_MESSAGE} objects, got {got}")
        for i, msg in enumerate(messages):
            _check_message(i, msg)
        return messages
    raise ValueError(f"expected a 'text' or a 'messages' field, got fields {list(row)}")


def _jsonl_docs(path: Path, tok: QwenTokenizer) -> Iterator[Doc]:
    """One document per line: {"text": ...} or {"messages": [{"role", "content"}, ...]}; errors name the line."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} line {lineno}: not UTF-8: bytes {raw[e.start:e.end]!r} at byte {e.start} "
                                 "of the line; save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = _jsonl_row(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {lineno}: invalid JSON ({e.msg} at column {e.pos + 1}); expected one "
                                 "JSON object per line") from None
            except ValueError as e:
                raise ValueError(f"{path} line {lineno}: {e}") from None
            yield _text_doc(tok, row) if isinstance(row, str) else _chat_doc(tok, row)


def _tokenized_stream(cfg: DataConfig, path: Path, tokenizer: str) -> np.ndarray:
    """[2, N] uint32 (ids, loss mask) of the whole corpus, from the cache (keyed by the file's contents and the
    tokenizer) or tokenized and cached."""
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256")
    digest.update(f"|v{_CACHE_VERSION}|{cfg.name}|{tokenizer}".encode())
    cache = Path(cfg.cache_dir) / f"{cfg.name}-{tokenizer}-{digest.hexdigest()[:16]}.npy"
    if cache.exists():
        return np.load(cache)

    tok = QwenTokenizer(tokenizer)
    docs = _chitchat_docs(path, tok) if cfg.name == "chitchat" else _jsonl_docs(path, tok)
    ids: list[int] = []
    mask: list[bool] = []
    for doc_ids, doc_mask in docs:
        ids += doc_ids
        mask += doc_mask
    stream = np.array([ids, mask], dtype=np.uint32)

    cache.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, stream)
        os.replace(tmp, cache)
    except BaseException:
        os.unlink(tmp)
        raise
    return stream


def _load_tokens(path: Path) -> np.ndarray:
    """A pre-tokenized 1-D id array (memory-mapped): .npy of any integer dtype or raw little-endian uint32."""
    if path.suffix == ".npy":
        ids = np.load(path, mmap_mode="r")
    elif path.stat().st_size > 0 and path.stat().st_size % 4 == 0:
        ids = np.memmap(path, dtype="<u4", mode="r")
    else:
        raise ValueError(f"data.path={path}: a raw uint32 .bin file needs a positive multiple of 4 bytes")
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.size == 0:
        raise ValueError(f"data.path={path}: expected a non-empty 1-D integer array, got {ids.dtype} {ids.shape}")
    if ids.min() < 0:
        raise ValueError(f"data.path={path}: token ids must be non-negative")
    return ids


class PackedLoader:
    """Endless iterator of packed batches for one dp rank; see the module docstring for the order."""

    def __init__(
        self,
        ids: np.ndarray,
        mask: np.ndarray | None,
        *,
        seq_len: int,
        vocab_size: int,
        seed: int,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        eos_id: int | None = None,
    ) -> None:
        self._ids, self._mask = ids, mask  # 1-D streams; mask None = every target is trained
        self._eos_id = eos_id  # None: position ids 0..T-1 in every window, else restarting after each eos
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.num_windows = len(ids) // (seq_len + 1)
        self._seed = seed
        self._local_batch = local_batch_size
        self._rank_offset = dp_rank * local_batch_size
        self._global_batch = local_batch_size * dp_size
        if self.num_windows < self._global_batch:
            raise ValueError(
                f"corpus too small: {len(ids)} tokens make {self.num_windows} windows of data.seq_len={seq_len} "
                f"(+1), fewer than one global batch of {self._global_batch}; lower data.seq_len or the batch size"
            )
        self.epoch = 0
        self.position = 0  # index in this epoch's order of the next global batch's first window
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = np.random.default_rng([self._seed, self.epoch]).permutation(self.num_windows)
            self._order_epoch = self.epoch
        return self._order

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.position + self._global_batch > self.num_windows:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position + self._rank_offset
        windows_B = self._epoch_order()[start : start + self._local_batch]
        self.position += self._global_batch

        index_BT1 = windows_B[:, None] * (self.seq_len + 1) + np.arange(self.seq_len + 1)
        tokens_BT1 = torch.from_numpy(self._ids[index_BT1].astype(np.int64))
        labels_BT = tokens_BT1[:, 1:].clone()
        if self._mask is not None:
            trained_BT = torch.from_numpy(self._mask[index_BT1[:, 1:]].astype(bool))
            labels_BT[~trained_BT] = IGNORE_INDEX
        input_ids_BT = tokens_BT1[:, :-1].contiguous()
        return {"input_ids": input_ids_BT, "labels": labels_BT, "position_ids": self._position_ids(input_ids_BT)}

    def _position_ids(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Distance of each token from its document's start: the window start, or the token after an eos."""
        t_BT = torch.arange(self.seq_len).expand_as(input_ids_BT)
        if self._eos_id is None:
            return t_BT.contiguous()
        start_BT = torch.zeros_like(input_ids_BT, dtype=torch.bool)
        start_BT[:, 0] = True
        start_BT[:, 1:] = input_ids_BT[:, :-1] == self._eos_id
        return t_BT - torch.where(start_BT, t_BT, 0).cummax(dim=1).values

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def _check_trained_tokens(cfg: DataConfig, path: Path, mask: np.ndarray) -> None:
    """Raise ValueError if the tokenized corpus (fresh or cached), under ``data.mask_non_assistant``, trains nothing."""
    if mask.size == 0:
        raise ValueError(f"data.path={path} holds no documents (e.g. a jsonl file of blank lines); add documents or "
                         "point data.path at the right file")
    if cfg.mask_non_assistant and not mask.any():
        raise ValueError(f"data.path={path}: no assistant message anywhere: with data.mask_non_assistant=true nothing "
                         "would be trained; add assistant turns or set data.mask_non_assistant=false")


def build_data_loader(cfg: DataConfig, *, seed: int, local_batch_size: int, dp_rank: int, dp_size: int,
                      tokenizer: str | None = "qwen3") -> PackedLoader:
    """Validate ``cfg``, load (tokenizing with ``tokenizer``, the model's, and caching on first use) the corpus, and
    return dp rank's loader. ``tokenizer`` (a training.tokenizer vocabulary) is unused by pre-tokenized data."""
    validate_data_config(cfg)
    if cfg.name != "tokens" and tokenizer not in TOKENIZERS:
        raise ValueError(f"data.name={cfg.name} tokenizes its text with the model's tokenizer, and model.tokenizer "
                         f"gives {tokenizer!r}: choose one of {', '.join(TOKENIZERS)} (or pre-tokenized data=tokens)")
    if local_batch_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need local_batch_size > 0 and 0 <= dp_rank < dp_size, got "
                         f"local_batch_size={local_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}")
    path = _source_path(cfg)
    if cfg.name == "tokens":
        ids, mask = _load_tokens(path), None
        vocab_size, eos_id = int(ids.max()) + 1, cfg.eos_id
    else:
        ids, mask = _tokenized_stream(cfg, path, tokenizer)
        _check_trained_tokens(cfg, path, mask)
        mask = mask if cfg.mask_non_assistant else None
        tok = QwenTokenizer(tokenizer)
        vocab_size, eos_id = tok.vocab_size, tok.eos_id  # data text cannot forge it: eos ends documents only
    return PackedLoader(ids, mask, seq_len=cfg.seq_len, vocab_size=vocab_size, seed=seed,
                        local_batch_size=local_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                        eos_id=eos_id if cfg.document_mask else None)


def context_shard(batch: dict[str, torch.Tensor], cp_rank: int, cp: int) -> dict[str, torch.Tensor]:
    """This cp rank's contiguous 1/cp of every sequence of ``batch`` (tensors [..., T]; T divisible by cp)."""
    if cp == 1:
        return batch
    return {name: x.chunk(cp, dim=-1)[cp_rank].contiguous() for name, x in batch.items()}
