"""training.data.tokenize_shards and scripts/pretokenize.py: shards over worker processes equal the single-process stream,
resume redoes only what is missing, errors name the file and line, the CLI writes the manifest."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from training.data.cache import tokenized_corpus
from training.data.config import DataConfig
from training.data.tokenize_shards import MANIFEST, jsonl_docs, tokenize_to_shards
from training.data.tokenizer import QwenTokenizer


def _tokenized_stream(cfg: DataConfig, tokenizer: str) -> np.ndarray:
    return tokenized_corpus(cfg, tokenizer).stream


ROOT = Path(__file__).resolve().parents[1]


def _corpus(path: Path, rows: int = 300) -> Path:
    """Chats, texts (some with unicode and a literal special token) and blank lines."""
    rng = random.Random(0)
    lines = []
    for i in range(rows):
        if i % 11 == 5:
            lines.append("")
        elif i % 3 == 0:
            lines.append(json.dumps({"text": f"Document {i}: " + " ".join(rng.choice(["héllo", "wörld", "<|im_end|>",
                                                                                         "tokens", "日本"])
                                                                         for _ in range(rng.randint(1, 40)))}))
        else:
            turns = [{"role": "system", "content": "Be brief."}] if i % 5 == 0 else []
            turns += [{"role": "user", "content": f"question {i}?"},
                      {"role": "assistant", "content": "answer " * rng.randint(1, 12)}]
            lines.append(json.dumps({"messages": turns}))
    path.write_text("\n".join(lines) + "\n\n")
    return path


def _single_process(path: Path) -> np.ndarray:
    """The stream as data=jsonl built it before shards: every document of the file, in order, concatenated."""
    ids, mask = [], []
    for doc_ids, doc_mask, _ in jsonl_docs(path, QwenTokenizer("qwen3")):  # no images
        ids += doc_ids
        mask += doc_mask
    return np.array([ids, mask], dtype=np.uint32)


@pytest.mark.parametrize("workers", [1, 2])
def test_shards_concatenate_to_the_single_process_stream(tmp_path: Path, workers: int) -> None:
    src = _corpus(tmp_path / "c.jsonl")
    manifest = tokenize_to_shards(src, tmp_path / "out", "qwen3", workers=workers, docs_per_shard=37)
    expected = _single_process(src)
    assert len(manifest.shards) == 8 and manifest.complete  # 273 documents / 37
    np.testing.assert_array_equal(manifest.stream(tmp_path / "out"), expected)
    on_disk = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert on_disk["totals"] == {"documents": 273, "tokens": expected.shape[1],
                                 "trained_tokens": int(expected[1].sum())}
    assert on_disk["shards"][0]["lines"][0] == 1 and on_disk["shards"][-1]["lines"][1] == 301
    for a, b in zip(on_disk["shards"], on_disk["shards"][1:]):  # contiguous line and byte ranges
        assert (a["lines"][1] + 1, a["bytes"][1]) == (b["lines"][0], b["bytes"][0])
    first = np.load(tmp_path / "out" / "shard_00000.npy")
    assert first.dtype == np.uint32 and first.shape == (2, on_disk["shards"][0]["tokens"])


def test_resume_redoes_only_missing_or_changed_shards(tmp_path: Path) -> None:
    src, out = _corpus(tmp_path / "c.jsonl"), tmp_path / "out"
    partial = tokenize_to_shards(src, out, "qwen3", docs_per_shard=50, max_shards=2)  # "killed" after two shards
    assert not partial.complete and json.loads((out / MANIFEST).read_text())["totals"] == {}
    assert sorted(p.name for p in out.glob("*.npy")) == ["shard_00000.npy", "shard_00001.npy"]
    full = tokenize_to_shards(src, out, "qwen3", docs_per_shard=50)
    np.testing.assert_array_equal(full.stream(out), _single_process(src))
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.npy")}
    checksums = json.loads((out / MANIFEST).read_text())

    (out / "shard_00003.npy").unlink()
    np.save(out / "shard_00001.npy", np.zeros((2, 3), dtype=np.uint32))  # corrupted: its sha256 no longer matches
    again = tokenize_to_shards(src, out, "qwen3", docs_per_shard=50)
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("*.npy")}
    redone = sorted(name for name in after if after[name] != before[name])
    assert redone == ["shard_00001.npy", "shard_00003.npy"]
    assert json.loads((out / MANIFEST).read_text()) == checksums
    np.testing.assert_array_equal(again.stream(out), _single_process(src))

    with pytest.raises(ValueError, match=r"holds shards of another tokenization \(docs_per_shard: 50 there, 20 now\)"):
        tokenize_to_shards(src, out, "qwen3", docs_per_shard=20)


@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_line_names_file_and_line(tmp_path: Path, workers: int) -> None:
    src = _corpus(tmp_path / "bad.jsonl", rows=100)
    lines = src.read_text().split("\n")
    lines[76] = '{"messages": [{"role": "User", "content": "hi"}]}'
    src.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=r"bad\.jsonl line 77: messages\[0\]\.role 'User' is unknown"):
        tokenize_to_shards(src, tmp_path / "out", "qwen3", workers=workers, docs_per_shard=10)


def test_jsonl_cache_uses_the_shards_and_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("training.data.cache._CACHE_DOCS_PER_SHARD", 100)  # 3 shards over 2 processes
    monkeypatch.setattr("training.data.cache._TOKENIZE_WORKERS", 2)
    src = _corpus(tmp_path / "c.jsonl")
    cfg = DataConfig(name="jsonl", path=str(src), cache_dir=str(tmp_path / "cache"))
    stream = _tokenized_stream(cfg, "qwen3")
    np.testing.assert_array_equal(stream, _single_process(src))
    assert [p.name for p in (tmp_path / "cache").glob("*.npy")] and not list((tmp_path / "cache").glob("*.shards"))
    np.testing.assert_array_equal(_tokenized_stream(cfg, "qwen3"), stream)  # from the cache file


def test_cli_end_to_end(tmp_path: Path) -> None:
    src, out = _corpus(tmp_path / "c.jsonl"), tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / "pretokenize.py"), str(src), str(out), "--tokenizer", "qwen3",
           "--workers", "2", "--docs-per-shard", "100"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "3 shards, 273 documents" in done.stdout and "tokens/s" in done.stderr and "ETA" in done.stderr
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["tokenizer"] == "qwen3" and manifest["totals"]["documents"] == 273
    stream = np.concatenate([np.load(out / s["file"]) for s in manifest["shards"]], axis=1)
    np.testing.assert_array_equal(stream, _single_process(src))

    bad = subprocess.run(cmd[:2] + [str(tmp_path / "missing.jsonl"), str(out)], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("error: FileNotFoundError: INPUT: no such file or directory")
    assert "Traceback" not in bad.stderr
