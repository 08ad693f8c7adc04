"""Local Hugging Face datasets files as a corpus (data=hf, scripts/pretokenize.py), read through the optional
``datasets`` package and never from the hub.

``data.path`` is a file, a directory or a glob of .parquet, .arrow or .jsonl/.json files (one format), or a directory
written by ``Dataset.save_to_disk``. One document per row of ``data.column``: a string is a text, a list of
{"role", "content"} is a chat, rendered and masked as data=jsonl does (``training.data.tokenize_shards``). Parquet and json
are converted once to arrow under ``<data.cache_dir>/hf`` by ``datasets``; arrow files are memory-mapped in place.
Images are not read here: an image column, or an image part in a chat, is refused by name (never dropped).
"""

from __future__ import annotations

import functools
import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from core.files import file_kind
from training.data.chat import VISION_ONLY, Doc, checked_messages, document
from training.data.tokenize_shards import Shard, shard_name
from training.data.tokenizer import QwenTokenizer

IMAGE_COLUMNS = ("images", "image", "videos", "video")  # multimodal columns: refused, never dropped
HF_FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}  # suffix -> builder
SAVED = "saved"  # the format of a save_to_disk directory
_SAVED_FILES = ("state.json", "dataset_info.json")
_ROWS_PER_READ = 1_000  # rows of one column converted to Python at a time


def hf_files(path: str, key: str = "data.path") -> tuple[str, tuple[Path, ...]]:
    """(format, files) of ``path``: a builder name of HF_FORMATS and the files in sorted order, or SAVED and the
    save_to_disk directory; ValueError / FileNotFoundError name ``key`` and the fix."""
    p = Path(path)
    if p.is_dir() and all((p / f).is_file() for f in _SAVED_FILES):
        return SAVED, (p,)
    if p.is_dir() and (p / "dataset_dict.json").is_file():
        splits = sorted(d.name for d in p.iterdir() if d.is_dir())
        raise ValueError(f"{key}={path} is a DatasetDict (splits {splits}); point {key} at one split's directory, "
                         f"e.g. {p / (splits[0] if splits else 'train')}")
    if any(c in path for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
    elif p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in HF_FORMATS)
    elif p.is_file():
        files = [p]
    elif file_kind(p) == "missing":
        raise FileNotFoundError(f"{key}: no such file or directory {path}")
    else:
        raise ValueError(f"{key}={path} is {file_kind(p)}, not a datasets file or a directory of them (datasets reads "
                         "regular files): write the data to a file")
    names = ", ".join(HF_FORMATS)
    if not files:
        raise ValueError(f"{key}={path} holds no {names} file; point {key} at dataset files or a save_to_disk "
                         "directory")
    formats = {HF_FORMATS.get(f.suffix) for f in files}
    if None in formats:
        wrong = next(f for f in files if f.suffix not in HF_FORMATS)
        raise ValueError(f"{key}={path}: {wrong} is not a {names} file; narrow {key} to the dataset's files")
    if len(formats) > 1:
        raise ValueError(f"{key}={path} mixes formats ({', '.join(sorted(formats))}); give files of one format")
    return formats.pop(), tuple(files)


def _import_datasets():
    """The ``datasets`` package, offline (no hub lookups), without progress bars; ImportError names the extra."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise ImportError("data.name=hf reads local files through the `datasets` package, which is not installed: "
                          "pip install -e '.[hf]' (or pip install datasets)") from None
    datasets.disable_progress_bars()
    return datasets


@functools.lru_cache(maxsize=4)
def open_dataset(fmt: str, files: tuple[Path, ...], cache_dir: str):
    """The rows of ``files`` as one memory-mapped ``datasets.Dataset`` (cached per process)."""
    datasets = _import_datasets()
    if fmt == SAVED:
        dataset = datasets.load_from_disk(str(files[0]))
        if not isinstance(dataset, datasets.Dataset):
            raise ValueError(f"{files[0]} holds a {type(dataset).__name__}; point data.path at one split's directory")
        return dataset
    if fmt == "arrow":  # files written by datasets: memory-mapped where they are, no copy
        return datasets.concatenate_datasets([datasets.Dataset.from_file(str(f)) for f in files])
    try:
        return datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train",
                                     cache_dir=str(Path(cache_dir) / "hf"))
    except (ValueError, datasets.exceptions.DatasetGenerationError) as e:  # pyarrow's errors name no file
        cause = e.__cause__ or e  # datasets wraps the reader's error
        named = ", ".join(map(str, files[:3])) + (f" (and {len(files) - 3} more)" if len(files) > 3 else "")
        raise ValueError(f"{named}: datasets cannot read it as {fmt}: {' '.join(str(cause).split())}") from e


def pick_column(columns: list[str], column: str | None, key: str = "data.column") -> str:
    """``column`` if the dataset has it; None: "messages" if it has one, else "text"."""
    if column is not None:
        if column not in columns:
            raise ValueError(f"{key}={column!r} is not a column of the dataset (columns: {columns}); name one of them")
        return column
    for name in ("messages", "text"):
        if name in columns:
            return name
    raise ValueError(f"the dataset has no 'text' or 'messages' column (columns: {columns}); name the column of the "
                     f"documents: {key}=<name>")


def row_document(value: object, column: str) -> str | list[dict]:
    """The text or the chat messages of one row's ``column`` value; ValueError says what is wrong."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        # arrow gives a list of parts as structs with every field of any part: the fields a part lacks are None
        value = [{**msg, "content": [{k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part
                                     for part in msg["content"]]}
                 if isinstance(msg, dict) and isinstance(msg.get("content"), list) else msg for msg in value]
        return checked_messages(value, f"column {column!r}")
    got = "null" if value is None else type(value).__name__
    raise ValueError(f"column {column!r} must hold a text (string) or a chat (a list of {{role, content}}), got {got}")


@dataclass(frozen=True)
class HfCorpus:
    """A ``Corpus`` of local datasets files (``hf_corpus`` builds it); a shard is a run of rows."""
    source: str  # data.path as given
    fmt: str
    paths: tuple[Path, ...]  # the files, or the save_to_disk directory
    column: str
    cache_dir: str

    @property
    def reader(self) -> str:
        return f"hf {self.fmt} column={self.column}"

    def dataset(self):
        return open_dataset(self.fmt, self.paths, self.cache_dir)

    def files(self) -> list[Path]:
        if self.fmt != SAVED:
            return list(self.paths)
        return sorted(f for f in self.paths[0].iterdir() if f.is_file())

    def plan(self, docs_per_shard: int) -> list[Shard]:
        rows = len(self.dataset())
        return [Shard(shard_name(i), rows=[start, min(start + docs_per_shard, rows)])
                for i, start in enumerate(range(0, rows, docs_per_shard))]

    def docs(self, tok: QwenTokenizer, shard: Shard) -> Iterator[Doc]:
        dataset = self.dataset().select_columns([self.column])
        start, stop = shard.rows
        for first in range(start, stop, _ROWS_PER_READ):
            values = dataset[first : min(first + _ROWS_PER_READ, stop)][self.column]
            for row, value in enumerate(values, start=first):
                try:
                    yield document(tok, row_document(value, self.column))
                except ValueError as e:
                    raise ValueError(f"{self.source} row {row}: {e}") from None

    def work(self, shard: Shard) -> int:
        return shard.rows[1] - shard.rows[0]


def hf_corpus(path: str, column: str | None, cache_dir: str, key: str = "data.path") -> HfCorpus:
    """The corpus of ``path``'s files, its column picked (opens the dataset: ``datasets`` converts it on first use)."""
    fmt, paths = hf_files(path, key)
    dataset = open_dataset(fmt, paths, cache_dir)
    media = [c for c in dataset.column_names if c.lower() in IMAGE_COLUMNS]
    if media:
        raise ValueError(f"{key}={path} ({', '.join(map(str, paths[:2]))}{', ...' if len(paths) > 2 else ''}) has "
                         f"the column {media[0]!r}: data=hf reads one text or messages column, so the images would be "
                         f"dropped and the chats trained as text; {VISION_ONLY} (image parts in the "
                         "messages), or remove the column")
    return HfCorpus(path, fmt, paths, pick_column(list(dataset.column_names), column), cache_dir)
