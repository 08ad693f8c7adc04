"""The ``data`` config group (``DataConfig``, a mixture's ``SourceConfig``) and its one validation."""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path

from core.config import execution
from core.files import file_kind, nearest_existing

from training.data.hf_datasets import hf_files
from training.data.token_shards import BIN_DTYPES, shard_paths
from training.data.vision import DEFAULT_MAX_IMAGE_PIXELS

_NAMES = ("chitchat", "jsonl", "hf", "tokens")


@dataclass
class SourceConfig:
    """One source of a data.sources mixture."""
    path: str = ""  # as data.path of data=tokens: a .npy / .bin shard, a directory of them, or a glob
    weight: float = 1.0  # relative share of the global batch's windows (the weights need not sum to 1)
    name: str | None = None  # in metrics (data/share/<name>) and the loader state; None: the path's last part


@dataclass
class DataConfig:
    name: str = "chitchat"  # chitchat | jsonl | hf | tokens
    # jsonl: .jsonl file; hf: datasets files (training.data.hf_datasets); tokens: a .npy / raw .bin shard, a directory of
    # them or a glob; chitchat: dataset.json
    path: str | None = None
    column: str | None = None  # hf: the text or messages column (None: messages if there is one, else text)
    bin_dtype: str = "uint32"  # tokens: the dtype of raw little-endian .bin shards (uint16, int32, ...)
    sources: list[SourceConfig] | None = None  # tokens: a weighted mixture of token sources instead of data.path
    seq_len: int = 256
    # The tokenizer is the model's (model.tokenizer): build_data_loader takes it from the caller.
    mask_non_assistant: bool = False  # chat data: loss only on assistant tokens
    cache_dir: str = execution(default=".cache/data")  # tokenized-corpus cache
    # Position ids restart at every document, so no token attends to (or DeltaNet carries state from) another
    # document of its packed window; false: each window is one causal sequence.
    document_mask: bool = True
    eos_id: int | None = None  # tokens: the id ending each document (None: none known); other data: <|endoftext|>
    val_fraction: float = 0.0  # the last fraction of each source's tokens held out (whole documents) for validation
    # Text and chat data whose trained labels are > 90% special tokens (empty texts or assistant messages) are
    # refused; true: train on it anyway (a resume may change only whether it is refused: the data itself is compared)
    allow_special_only: bool = execution(default=False)
    # jsonl chats with images (a model with a vision tower): a source image of more pixels is refused, naming it
    max_image_pixels: int = execution(default=DEFAULT_MAX_IMAGE_PIXELS)
    # The pixels an image is resized into (the tokens it becomes: pixels / (patch_size * merge_size)**2); None: the
    # model's image processor's (preprocessor_config.json's shortest_edge / longest_edge)
    image_min_pixels: int | None = None
    image_max_pixels: int | None = None


def source_path(cfg: DataConfig) -> Path:
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
    blocker = nearest_existing(Path(cfg.cache_dir))  # the directory, or the parent it would be made in
    if (kind := file_kind(blocker)) != "directory":
        where = "is" if blocker == Path(cfg.cache_dir) else f"cannot be made: {blocker} is"
        raise ValueError(f"data.cache_dir={cfg.cache_dir} {where} {'a file' if kind == 'file' else kind}, not a "
                         "directory: point data.cache_dir at a directory for the tokenized-corpus cache")
    if not 0 <= cfg.val_fraction < 1:
        raise ValueError(f"data.val_fraction={cfg.val_fraction} must be in [0, 1): the share of each source held out "
                         "for validation, e.g. data.val_fraction=0.01")
    if cfg.column is not None and cfg.name != "hf":
        raise ValueError(f"data.column={cfg.column!r} names a column of datasets files (data.name=hf); unset it for "
                         f"data.name={cfg.name}")
    if cfg.allow_special_only and cfg.name == "tokens":
        raise ValueError("data.allow_special_only=true accepts text or chat data of (almost) only special tokens, "
                         "and data=tokens is not checked for them; unset it")
    _validate_images(cfg)
    if cfg.name == "tokens":
        for key, path in token_paths(cfg):
            shard_paths(path, key)
    elif cfg.name == "hf":
        hf_files(cfg.path)
    else:
        _check_source_file(cfg)


def _check_source_file(cfg: DataConfig) -> None:
    """data=jsonl and chitchat read one regular file (more than once: its sha256 for the cache, then its documents)."""
    path, kind = source_path(cfg), file_kind(source_path(cfg))
    if kind == "missing":
        raise FileNotFoundError(f"data.path: no such file {path}")
    what = "one .jsonl file" if cfg.name == "jsonl" else "one dataset.json file"
    if kind == "directory":
        raise ValueError(f"data.path={path} is a directory, and data.name={cfg.name} reads {what}: name the file (a "
                         "directory of token shards is read by data=tokens, of datasets files by data=hf)")
    if kind != "file":
        raise ValueError(f"data.path={path} is {kind}, not a regular file, and data.name={cfg.name} reads {what} more "
                         "than once (its sha256 for the cache, then its documents): write the corpus to a file")


def _validate_images(cfg: DataConfig) -> None:
    for key in ("max_image_pixels", "image_min_pixels", "image_max_pixels"):
        value = getattr(cfg, key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"data.{key}={value!r} must be a positive number of pixels, e.g. data.{key}=1048576")
    if None not in (cfg.image_min_pixels, cfg.image_max_pixels) and cfg.image_min_pixels > cfg.image_max_pixels:
        raise ValueError(f"data.image_min_pixels={cfg.image_min_pixels} is above data.image_max_pixels="
                         f"{cfg.image_max_pixels}; an image is resized into [min, max] pixels")
    changed = [f"data.{k}" for k in ("image_min_pixels", "image_max_pixels") if getattr(cfg, k) is not None]
    changed += ["data.max_image_pixels"] if cfg.max_image_pixels != DEFAULT_MAX_IMAGE_PIXELS else []
    if changed and cfg.name != "jsonl":
        raise ValueError(f"{', '.join(changed)} set the images of chats, which only data.name=jsonl reads; unset "
                         f"{'them' if len(changed) > 1 else 'it'} for data.name={cfg.name}")


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


def glob_root(path: str) -> Path:
    """The directory a glob ``path`` searches (its parts before the first with a glob character), else ``path``."""
    parts = Path(path).parts
    cut = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts))
    return Path(*parts[:cut]) if cut else Path(".")


def token_paths(cfg: DataConfig) -> list[tuple[str, str]]:
    """(config key, path) of each token source of ``cfg`` (data=tokens)."""
    if cfg.sources is None:
        return [("data.path", cfg.path)]
    return [(f"data.sources[{i}].path", src.path) for i, src in enumerate(cfg.sources)]
