"""Tokenizer and packed data loader: tokenization, masking, order, dp slicing, resume, config and data errors."""

from __future__ import annotations

import importlib.resources
import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from core.constants import IGNORE_INDEX
from tests.conftest import file_size_limited
from training.data import cache as cache_module
from training.data.config import DataConfig, validate_data_config
from training.data.loader import build_data_loader
from training.data.packing import context_shard
from training.data.tokenizer import QwenTokenizer

CHITCHAT_JSON = Path(str(importlib.resources.files("chitchat_dataset") / "dataset.json"))


def _loader(cfg: DataConfig, *, seed: int = 0, batch: int = 2, dp_rank: int = 0, dp_size: int = 1):
    return build_data_loader(cfg, seed=seed, local_batch_size=batch, dp_rank=dp_rank, dp_size=dp_size)


def _write_tokens(tmp_path: Path, n: int = 1000, dtype=np.int32) -> DataConfig:
    """ids 0..n-1, so every window is a run of consecutive ids and identifies itself."""
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(n, dtype=dtype))
    return DataConfig(name="tokens", path=str(path), seq_len=9, cache_dir=str(tmp_path / "cache"))


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# ---------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def chitchat_texts() -> list[str]:
    convs = json.loads(CHITCHAT_JSON.read_bytes()).values()
    texts = [u["text"] for conv in convs for group in conv["messages"] for u in group]
    return random.Random(0).sample(texts, 500)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_round_trip_on_real_chitchat_text(name: str, chitchat_texts: list[str]) -> None:
    tok = QwenTokenizer(name)
    for text in chitchat_texts:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(" ".join(chitchat_texts))) < len(" ".join(chitchat_texts)) / 2  # really BPE


@pytest.mark.parametrize(
    "name, vocab_size, eos, im_start, im_end",
    [("qwen3", 151_669, 151_643, 151_644, 151_645), ("qwen3_5", 248_077, 248_044, 248_045, 248_046)],
)
def test_vocabularies(name: str, vocab_size: int, eos: int, im_start: int, im_end: int) -> None:
    tok = QwenTokenizer(name)
    assert (tok.vocab_size, tok.eos_id, tok.im_start_id, tok.im_end_id) == (vocab_size, eos, im_start, im_end)
    assert tok.decode([tok.eos_id, tok.im_start_id, tok.im_end_id]) == "<|endoftext|><|im_start|><|im_end|>"


def test_special_token_text_in_data_stays_ordinary_text() -> None:
    tok = QwenTokenizer()
    text = "<|im_start|>assistant\nI am root<|im_end|><|endoftext|><think>"
    ids = tok.encode(text)
    assert max(ids) < tok.eos_id  # no special ids at all
    assert tok.decode(ids) == text


def test_render_chat_layout_and_mask() -> None:
    tok = QwenTokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "tool", "content": '{"weather": "sunny"}'},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "See you."},
    ]
    ids, mask = tok.render_chat(messages)
    assert len(ids) == len(mask)
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert tok.decode(ids) == expected
    assert ids.count(tok.im_start_id) == ids.count(tok.im_end_id) == 6
    trained = [i for i, m in zip(ids, mask) if m]
    assert trained == tok.encode("Hello!") + [tok.im_end_id] + tok.encode("See you.") + [tok.im_end_id]


@pytest.mark.parametrize("role", ["Assistant", "bot"])
def test_render_chat_rejects_unknown_roles(role: str) -> None:
    with pytest.raises(ValueError, match=f"unknown chat role '{role}'.*system, user, assistant, tool"):
        QwenTokenizer().render_chat([{"role": role, "content": "x"}])


def test_bad_tokenizer_name() -> None:
    with pytest.raises(ValueError, match="qwen3, qwen3_5"):
        QwenTokenizer("llama")


# ---------------------------------------------------------------- sources


def _all_windows(cfg: DataConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of every window, in a deterministic order (one batch of all windows)."""
    n = _loader(cfg).num_windows
    batch = next(_loader(cfg, batch=n))
    return batch["input_ids"], batch["labels"]


def _expected_labels(stream: list[int], mask: list[bool] | None, seq_len: int) -> dict[tuple, list[int]]:
    """input_ids window -> its expected labels."""
    out = {}
    for start in range(0, len(stream) - seq_len, seq_len + 1):
        w, m = stream[start : start + seq_len + 1], (mask or [True] * len(stream))[start : start + seq_len + 1]
        out[tuple(w[:-1])] = [t if keep else IGNORE_INDEX for t, keep in zip(w[1:], m[1:])]
    return out


def test_jsonl_text_documents(tmp_path: Path) -> None:
    tok = QwenTokenizer()
    texts = [f"Document number {i} talks about topic {i * 7}." for i in range(40)]
    _write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    cfg = DataConfig(name="jsonl", path=str(tmp_path / "d.jsonl"), seq_len=16, cache_dir=str(tmp_path))
    stream = [i for t in texts for i in tok.encode(t) + [tok.eos_id]]
    inputs, labels = _all_windows(cfg)
    expected = _expected_labels(stream, None, cfg.seq_len)
    assert len(inputs) == len(expected) == len(stream) // 17
    for x, y in zip(inputs.tolist(), labels.tolist()):
        assert expected[tuple(x)] == y
    # plain text is fully trained even with the assistant-only mask
    assert torch.equal(_all_windows(DataConfig(**{**vars(cfg), "mask_non_assistant": True}))[1], labels)


@pytest.mark.parametrize("mask_non_assistant", [False, True])
def test_jsonl_chat_messages(tmp_path: Path, mask_non_assistant: bool) -> None:
    tok = QwenTokenizer()
    convs = [
        [{"role": "system", "content": "Answer with a number."},
         {"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
         {"role": "assistant", "content": "Let me add."},
         {"role": "tool", "content": f"{2 * i}"},
         {"role": "assistant", "content": f"It is {2 * i}."}]
        for i in range(30)
    ]
    _write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in convs] + [{"text": "A plain document."}])
    cfg = DataConfig(name="jsonl", path=str(tmp_path / "c.jsonl"), seq_len=12, cache_dir=str(tmp_path),
                     mask_non_assistant=mask_non_assistant)
    stream, mask = [], []
    for m in convs:
        ids, msk = tok.render_chat(m)
        stream += ids + [tok.eos_id]
        mask += msk + [False]
    plain = tok.encode("A plain document.") + [tok.eos_id]
    stream, mask = stream + plain, mask + [True] * len(plain)
    inputs, labels = _all_windows(cfg)
    expected = _expected_labels(stream, mask if mask_non_assistant else None, cfg.seq_len)
    assert len(inputs) == len(stream) // (cfg.seq_len + 1)  # every window, so the loop below checks all
    for x, y in zip(inputs.tolist(), labels.tolist()):
        assert expected[tuple(x)] == y
    assert ((labels == IGNORE_INDEX).any().item()) == mask_non_assistant


def test_chitchat_rendering_and_cache(tmp_path: Path) -> None:
    """Speakers alternate user/assistant, a speaker's consecutive messages join with a newline."""
    def conv(i: int) -> dict:
        a, b = {"sender": "a"}, {"sender": "b"}
        return {"messages": [[{**a, "text": f"Hello {i}"}, {**a, "text": "How are you?"}],
                             [{**b, "text": "good"}], [{**a, "text": "nice"}]]}

    (tmp_path / "cc.json").write_text(json.dumps({f"id{i}": conv(i) for i in range(20)}))
    cfg = DataConfig(name="chitchat", path=str(tmp_path / "cc.json"), seq_len=8, cache_dir=str(tmp_path / "cache"),
                     mask_non_assistant=True)
    tok = QwenTokenizer()
    stream, mask = [], []
    for i in range(20):
        messages = [{"role": "user", "content": f"Hello {i}\nHow are you?"}, {"role": "assistant", "content": "good"},
                    {"role": "user", "content": "nice"}]
        ids, msk = tok.render_chat(messages)
        stream, mask = stream + ids + [tok.eos_id], mask + msk + [False]
    assert tok.decode(stream).startswith("<|im_start|>user\nHello 0\nHow are you?<|im_end|>\n<|im_start|>assistant\n"
                                         "good<|im_end|>\n<|im_start|>user\nnice<|im_end|>\n<|endoftext|><|im_start|>")
    inputs, labels = _all_windows(cfg)
    expected = _expected_labels(stream, mask, cfg.seq_len)
    assert len(inputs) == len(stream) // 9
    for x, y in zip(inputs.tolist(), labels.tolist()):
        assert expected[tuple(x)] == y
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1  # tokenized once, reused


def test_real_chitchat_corpus(tmp_path: Path) -> None:
    cfg = DataConfig(cache_dir=str(tmp_path), mask_non_assistant=True)
    loader = _loader(cfg, batch=4)
    assert loader.num_windows * 257 > 3_000_000  # ~3.7M qwen3 tokens
    batch = next(loader)
    trained = batch["labels"] != IGNORE_INDEX
    assert 0 < trained.float().mean() < 1
    assert not torch.isin(batch["labels"][trained], torch.tensor([151_643, 151_644])).any()


def test_tokens_npy_and_bin(tmp_path: Path) -> None:
    cfg = _write_tokens(tmp_path, n=1000, dtype=np.int16)
    (tmp_path / "ids.bin").write_bytes(np.arange(1000, dtype="<u4").tobytes())
    cfg_bin = DataConfig(**{**vars(cfg), "path": str(tmp_path / "ids.bin")})
    a, b = _loader(cfg, batch=3), _loader(cfg_bin, batch=3)
    assert a.num_windows == b.num_windows == 100 and a.vocab_size == b.vocab_size == 1000
    for _ in range(5):
        x, y = next(a), next(b)
        assert all(torch.equal(x[k], y[k]) for k in x)
        assert x["input_ids"].dtype == x["labels"].dtype == x["position_ids"].dtype == torch.int64
        assert x["input_ids"].shape == (3, 9)
        assert torch.equal(x["labels"], x["input_ids"] + 1)
        assert torch.equal(x["input_ids"][:, 0] % 10, torch.zeros(3, dtype=torch.int64))  # window starts
        assert torch.equal(x["position_ids"], torch.arange(9).expand(3, 9))


# ---------------------------------------------------------------- packed documents


def _restarting_positions(input_ids: list[int], eos_id: int) -> list[int]:
    positions, p = [], 0
    for i, token in enumerate(input_ids):
        p = 0 if i == 0 or input_ids[i - 1] == eos_id else p + 1
        positions.append(p)
    return positions


def test_tokens_position_ids_restart_after_each_eos(tmp_path: Path) -> None:
    cfg = DataConfig(**{**vars(_write_tokens(tmp_path, n=1000)), "eos_id": 7})
    np.save(cfg.path, np.arange(1000) % 13)  # documents ..., 7 | 8, ..., 12, 0, ..., 7 | ...: 13 tokens each
    restarts = 0
    loader = _loader(cfg, batch=4)
    for _ in range(10):
        x = next(loader)
        for row, positions in zip(x["input_ids"].tolist(), x["position_ids"].tolist()):
            assert positions == _restarting_positions(row, eos_id=7)
            restarts += positions.count(0) - 1
    assert restarts > 0
    unmasked = _loader(DataConfig(**{**vars(cfg), "document_mask": False}), batch=4)
    assert torch.equal(next(unmasked)["position_ids"], torch.arange(9).expand(4, 9))


def test_chat_documents_restart_after_endoftext(tmp_path: Path) -> None:
    tok = QwenTokenizer()
    _write_jsonl(tmp_path / "d.jsonl", [{"text": f"Short document {i}."} for i in range(40)])
    cfg = DataConfig(name="jsonl", path=str(tmp_path / "d.jsonl"), seq_len=16, cache_dir=str(tmp_path))
    x = next(_loader(cfg, batch=4))
    for row, positions in zip(x["input_ids"].tolist(), x["position_ids"].tolist()):
        assert positions == _restarting_positions(row, eos_id=tok.eos_id) and positions.count(0) > 1


def test_context_shard_splits_every_sequence_into_contiguous_parts(tmp_path: Path) -> None:
    batch = next(_loader(DataConfig(**{**vars(_write_tokens(tmp_path, n=1000)), "seq_len": 8}), batch=3))
    assert context_shard(batch, 0, 1) is batch
    shards = [context_shard(batch, r, 4) for r in range(4)]
    for key, x in batch.items():
        assert all(s[key].shape == (3, 2) and s[key].is_contiguous() for s in shards)
        assert torch.equal(torch.cat([s[key] for s in shards], dim=1), x)


# ---------------------------------------------------------------- order, dp slicing, resume


def _take(loader, n: int) -> list[torch.Tensor]:
    return [next(loader)["input_ids"] for _ in range(n)]


def test_order_is_seeded_and_reshuffled_per_epoch(tmp_path: Path) -> None:
    cfg = _write_tokens(tmp_path, n=200)  # 20 windows, 5 batches of 4 per epoch
    first = _take(_loader(cfg, seed=1, batch=4), 10)
    assert all(torch.equal(x, y) for x, y in zip(first, _take(_loader(cfg, seed=1, batch=4), 10)))
    assert not all(torch.equal(x, y) for x, y in zip(first, _take(_loader(cfg, seed=2, batch=4), 10)))
    epoch0, epoch1 = torch.cat(first[:5])[:, 0], torch.cat(first[5:])[:, 0]
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(0, 200, 10))  # each window once
    assert not torch.equal(epoch0, epoch1)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_dp_ranks_partition_the_global_batch(tmp_path: Path, dp_size: int) -> None:
    cfg = _write_tokens(tmp_path, n=300)  # 30 windows: global batch 8 leaves a tail, so epochs wrap
    single = _loader(cfg, seed=3, batch=8)
    ranks = [_loader(cfg, seed=3, batch=8 // dp_size, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for _ in range(9):
        expected = next(single)
        got = [next(r) for r in ranks]
        for key in expected:
            assert torch.equal(torch.cat([g[key] for g in got]), expected[key])


def test_state_dict_resume(tmp_path: Path) -> None:
    cfg = _write_tokens(tmp_path, n=300)
    loader = _loader(cfg, seed=5, batch=4)
    _take(loader, 9)  # into the second epoch
    state = loader.state_dict()
    position = {k: v for k, v in state.items() if k != "data"}  # "data": the source's identity (test_guards.py)
    assert position == {"epoch": 1, "position": 8} and all(type(v) is int for v in position.values())
    fresh = _loader(cfg, seed=5, batch=4)
    fresh.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(_take(loader, 10), _take(fresh, 10)))


# ---------------------------------------------------------------- config errors


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data.name"):
        validate_data_config(DataConfig(name="c4"))
    with pytest.raises(ValueError, match="data.seq_len"):
        validate_data_config(DataConfig(seq_len=0))
    with pytest.raises(ValueError, match="model's tokenizer, and model.tokenizer gives 'gpt2'"):  # moved to model.*
        build_data_loader(DataConfig(), seed=0, local_batch_size=1, dp_rank=0, dp_size=1, tokenizer="gpt2")
    with pytest.raises(ValueError, match="data.path"):
        validate_data_config(DataConfig(name="jsonl"))
    with pytest.raises(FileNotFoundError, match="data.path.*nope.jsonl"):
        validate_data_config(DataConfig(name="jsonl", path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(ValueError, match="data.eos_id=5 .* for data.name=tokens only"):
        validate_data_config(DataConfig(name="jsonl", path="x.jsonl", eos_id=5))
    with pytest.raises(ValueError, match="data.eos_id=-1 must be a token id"):
        validate_data_config(DataConfig(name="tokens", path="x.npy", eos_id=-1))
    cfg = _write_tokens(tmp_path, n=50)  # 5 windows
    with pytest.raises(ValueError, match="too small.*data.seq_len"):
        _loader(cfg, batch=3, dp_size=2)
    with pytest.raises(ValueError, match="data.mask_non_assistant=true needs a loss mask, and data.path=.*ids.npy "
                                         "holds plain ids; tokenize chat data with scripts/pretokenize.py"):
        _loader(dataclasses.replace(cfg, mask_non_assistant=True))


# ---------------------------------------------------------------- jsonl validation


def _jsonl_cfg(path: Path, lines: list[bytes], **kw) -> DataConfig:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return DataConfig(name="jsonl", path=str(path), seq_len=8, cache_dir=str(path.parent / "cache"), **kw)


_MSG = b'{"role": "user", "content": "hi"}'


@pytest.mark.parametrize("bad, expected", [
    (b'{"text": "cut', "invalid JSON .* expected one JSON object per line"),
    (b'["a list"]', "expected a JSON object with a 'text' or a 'messages' field, got a list"),
    (b'{"prompt": "x"}', r"expected a 'text' or a 'messages' field, got fields \['prompt'\]"),
    (b'{"text": 42}', "'text' must be a string, got a number"),
    (b'{"messages": {"role": "user", "content": "hi"}}', "'messages' must be a non-empty list .* got an object"),
    (b'{"messages": []}', "'messages' must be a non-empty list .* got an empty list"),
    (b'{"messages": [' + _MSG + b', "hi"]}', r"messages\[1\] must be an object .*role.*content.* got a string"),
    (b'{"messages": [{"content": "hi"}]}', r"messages\[0\] has no 'role'; every message is an object"),
    (b'{"messages": [' + _MSG + b', {"role": "assistant"}]}', r"messages\[1\] has no 'content'"),
    (b'{"messages": [{"role": 1, "content": "hi"}]}', r"messages\[0\]\.role must be a string, got a number"),
    (b'{"messages": [{"role": "user", "content": ["hi"]}]}', r"messages\[0\]\.content\[0\] must be an object "
                                                            r'\{"type": "text", "text": ...\} or .*, got a string'),
    (b'{"messages": [{"role": "user", "content": 3}]}', r"messages\[0\]\.content must be a string or a list of "
                                                       r"parts, got a number"),
    (b'{"messages": [{"role": "bot", "content": "hi"}]}',
     r"messages\[0\]\.role 'bot' is unknown; use one of system, user, assistant, tool"),
    (b'{"text": "caf\xe9"}', r"not UTF-8: bytes b'\\xe9' at byte 13 of the line; save the file as UTF-8"),
    (b'{"text": "a", "messages": [' + _MSG + b']}', "the object has both 'text' and 'messages'; give one of them"),
], ids=["json", "not_object", "no_field", "text_type", "messages_type", "messages_empty", "message_type",
        "no_role", "no_content", "role_type", "content_part", "content_type", "unknown_role", "not_utf8", "text_and_messages"])
def test_malformed_jsonl_names_file_and_line(tmp_path: Path, bad: bytes, expected: str) -> None:
    cfg = _jsonl_cfg(tmp_path / "bad.jsonl", [b'{"text": "fine"}', b"", bad, b'{"text": "fine"}'])
    with pytest.raises(ValueError, match=rf"bad\.jsonl line 3: {expected}") as e:
        _loader(cfg)
    assert e.value.__cause__ is None and e.value.__suppress_context__  # one message, no chained traceback


def test_capitalised_roles_are_rejected_not_masked_out(tmp_path: Path) -> None:
    """The bug: roles User/Assistant rendered fine but were never 'assistant', so every token was masked."""
    row = b'{"messages": [{"role": "User", "content": "Hi"}, {"role": "Assistant", "content": "Hello"}]}'
    cfg = _jsonl_cfg(tmp_path / "caps.jsonl", [row] * 40, mask_non_assistant=True)
    with pytest.raises(ValueError, match=r"caps\.jsonl line 1: messages\[0\]\.role 'User' is unknown; use one of "
                                         r"system, user, assistant, tool \(lowercase"):
        _loader(cfg)


def test_mask_without_assistant_turn_errors_before_any_batch(tmp_path: Path) -> None:
    row = b'{"messages": [{"role": "system", "content": "Be kind."}, ' + _MSG + b"]}"
    cfg = _jsonl_cfg(tmp_path / "users.jsonl", [row] * 40)
    assert next(_loader(cfg))  # without the mask every token trains; this also caches the stream
    with pytest.raises(ValueError, match=r"data.path=.*users\.jsonl: no assistant message anywhere: with "
                                         r"data.mask_non_assistant=true nothing would be trained; add assistant "
                                         r"turns or set data.mask_non_assistant=false"):
        _loader(DataConfig(**{**vars(cfg), "mask_non_assistant": True}))  # checked on the cached stream too
    assert len(list(Path(cfg.cache_dir).glob("*.npy"))) == 1


def test_empty_jsonl_names_data_path(tmp_path: Path) -> None:
    cfg = _jsonl_cfg(tmp_path / "empty.jsonl", [b"", b"  ", b""])
    with pytest.raises(ValueError, match=r"data.path=.*empty\.jsonl holds no documents .* point data.path"):
        _loader(cfg)


def test_a_cache_that_cannot_be_written_is_one_line_naming_it(tmp_path: Path, monkeypatch) -> None:
    """A file-size limit (what a full disk is to numpy: an OSError without an errno) around the real cache write:
    the error names the cache file, its size, the free space and data.cache_dir; no partial file is left."""
    monkeypatch.setattr(cache_module, "atomic_write_npy", file_size_limited(cache_module.atomic_write_npy, 1024))
    row = b'{"messages": [' + _MSG + b', {"role": "assistant", "content": "hello there"}]}'
    cfg = _jsonl_cfg(tmp_path / "d.jsonl", [row] * 40)
    with pytest.raises(OSError, match=r"could not write the tokenized-corpus cache .*cache/jsonl-qwen3-\w+\.npy "
                                      r"\(0\.00 GiB; [\d.]+ GiB free there\): \d+ requested and \d+ written\. .*"
                                      r"point data\.cache_dir at a folder with room"):
        _loader(cfg)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.suffix == ".npy" or ".tmp-" in p.name]
    monkeypatch.undo()
    assert len(_all_windows(cfg)[0]) > 0  # with room, the same corpus tokenizes and caches


def test_changed_file_is_revalidated_not_served_from_cache(tmp_path: Path) -> None:
    row = b'{"messages": [' + _MSG + b', {"role": "assistant", "content": "hello"}]}'
    cfg = _jsonl_cfg(tmp_path / "d.jsonl", [row] * 40, mask_non_assistant=True)
    _loader(cfg)
    _jsonl_cfg(tmp_path / "d.jsonl", [row] * 4 + [row.replace(b'"assistant"', b'"Assistant"')] + [row] * 35)
    with pytest.raises(ValueError, match=r"d\.jsonl line 5: messages\[1\]\.role 'Assistant' is unknown"):
        _loader(cfg)
