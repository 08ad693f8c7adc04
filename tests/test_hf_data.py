"""data=hf (local datasets files) and training on scripts/pretokenize.py's shards: each reads the same documents into
the same token stream and loss mask as data=jsonl, whatever the file format; errors name the field and the fix."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from training.data.cache import tokenized_corpus
from training.data.config import DataConfig, SourceConfig
from training.data.loader import build_data_loader
from training.data.tokenize_shards import MANIFEST, tokenize_to_shards
from training.data.tokenizer import special_tokens


def _tokenized_stream(cfg: DataConfig, tokenizer: str) -> np.ndarray:
    return tokenized_corpus(cfg, tokenizer).stream


datasets = pytest.importorskip("datasets")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

ROOT = Path(__file__).resolve().parents[1]


def _chats(n: int) -> list[list[dict]]:
    return [([{"role": "system", "content": "Be brief."}] if i % 4 == 0 else [])
            + [{"role": "user", "content": f"question {i}? <|im_end|>"},
               {"role": "assistant", "content": "answer " * (1 + i % 7) + "héllo 日本"}] for i in range(n)]


def _texts(n: int) -> list[str]:
    return [f"Document {i}: " + "wörld tokens " * (1 + i % 9) for i in range(n)]


def _jsonl(path: Path, column: str, values: list) -> Path:
    path.write_text("".join(json.dumps({column: v}) + "\n" for v in values))
    return path


def _cfg(tmp_path: Path, name: str, path: Path | str, **kw) -> DataConfig:
    return DataConfig(name=name, path=str(path), seq_len=16, cache_dir=str(tmp_path / "cache"), **kw)


def _parquet_dir(folder: Path, column: str, values: list, parts: int = 3) -> Path:
    folder.mkdir(parents=True)
    for i, chunk in enumerate(np.array_split(np.arange(len(values)), parts)):
        pq.write_table(pa.table({column: [values[j] for j in chunk], "id": chunk.tolist()}),
                       folder / f"train-{i:05d}.parquet")
    return folder


@pytest.mark.parametrize("column", ["messages", "text"])
def test_every_format_reads_the_jsonl_stream(tmp_path: Path, column: str) -> None:
    values = _chats(40) if column == "messages" else _texts(40)
    expected = _tokenized_stream(_cfg(tmp_path, "jsonl", _jsonl(tmp_path / "c.jsonl", column, values)), "qwen3")
    folder = _parquet_dir(tmp_path / "pq", column, values)
    datasets.Dataset.from_list([{column: v} for v in values]).save_to_disk(str(tmp_path / "saved"))
    paths = {"parquet dir": folder, "parquet glob": f"{folder}/train-*.parquet", "saved": tmp_path / "saved",
             "arrow files": f"{tmp_path / 'saved'}/*.arrow", "jsonl via datasets": tmp_path / "c.jsonl"}
    for what, path in paths.items():
        stream = _tokenized_stream(_cfg(tmp_path, "hf", path), "qwen3")  # column: picked (messages, else text)
        np.testing.assert_array_equal(stream, expected, err_msg=what)
    named = _tokenized_stream(_cfg(tmp_path, "hf", folder, column=column), "qwen3")
    np.testing.assert_array_equal(named, expected)


def test_hf_loader_masks_like_jsonl(tmp_path: Path) -> None:
    values = _chats(60)
    jsonl = _cfg(tmp_path, "jsonl", _jsonl(tmp_path / "c.jsonl", "messages", values), mask_non_assistant=True)
    hf = _cfg(tmp_path, "hf", _parquet_dir(tmp_path / "pq", "messages", values), mask_non_assistant=True)
    a, b = (build_data_loader(c, seed=3, local_batch_size=2, dp_rank=0, dp_size=1) for c in (jsonl, hf))
    for _ in range(5):
        x, y = next(a), next(b)
        assert all(torch.equal(x[k], y[k]) for k in x)
        assert (x["labels"] == -100).any() and (x["labels"] != -100).any()


def test_hf_errors_name_the_field_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _parquet_dir(tmp_path / "pq", "body", _texts(6), parts=1)
    with pytest.raises(ValueError, match=r"no 'text' or 'messages' column \(columns: \['body', 'id'\]\).*"
                                         r"data.column=<name>"):
        _tokenized_stream(_cfg(tmp_path, "hf", folder), "qwen3")
    with pytest.raises(ValueError, match=r"data.column='txt' is not a column of the dataset"):
        _tokenized_stream(_cfg(tmp_path, "hf", folder, column="txt"), "qwen3")
    with pytest.raises(ValueError, match=r"column 'id' must hold a text \(string\) or a chat .* got int"):
        _tokenized_stream(_cfg(tmp_path, "hf", folder, column="id"), "qwen3")
    np.testing.assert_array_equal(  # a named column
        _tokenized_stream(_cfg(tmp_path, "hf", folder, column="body"), "qwen3"),
        _tokenized_stream(_cfg(tmp_path, "jsonl", _jsonl(tmp_path / "b.jsonl", "text", _texts(6))), "qwen3"))

    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), nulls)
    with pytest.raises(ValueError, match=r"nulls.parquet row 2: column 'text' must hold a text .* got null"):
        _tokenized_stream(_cfg(tmp_path, "hf", nulls), "qwen3")
    (tmp_path / "mixed").mkdir()
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "mixed" / "a.parquet")
    _jsonl(tmp_path / "mixed" / "b.jsonl", "text", ["b"])
    with pytest.raises(ValueError, match=r"data.path=.*mixed mixes formats \(json, parquet\)"):
        _tokenized_stream(_cfg(tmp_path, "hf", tmp_path / "mixed"), "qwen3")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "x"}])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"is a DatasetDict \(splits \['train'\]\); point data.path at one split"):
        _tokenized_stream(_cfg(tmp_path, "hf", tmp_path / "dd"), "qwen3")
    with pytest.raises(ValueError, match=r"data.column='text' names a column of datasets files"):
        build_data_loader(_cfg(tmp_path, "jsonl", tmp_path / "b.jsonl", column="text"), seed=0, local_batch_size=1,
                          dp_rank=0, dp_size=1)

    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed (a file not opened before: no cached dataset)
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "new.parquet")
    with pytest.raises(ImportError, match=r"`datasets` package, which is not installed: pip install -e '.\[hf\]'"):
        _tokenized_stream(_cfg(tmp_path, "hf", tmp_path / "new.parquet"), "qwen3")


def _pretokenized(tmp_path: Path, name: str, values: list, column: str, tokenizer: str = "qwen3") -> Path:
    src = _jsonl(tmp_path / f"{name}.jsonl", column, values)
    tokenize_to_shards(src, tmp_path / name, tokenizer, docs_per_shard=7)
    return tmp_path / name


def test_pretokenized_shards_train_like_jsonl(tmp_path: Path) -> None:
    """data=tokens on scripts/pretokenize.py's output: the ids, the loss mask (mask_non_assistant) and the document
    starts (eos from the manifest's tokenizer) of data=jsonl, batch for batch."""
    values = _chats(50)
    out = _pretokenized(tmp_path, "chats", values, "messages")
    assert len(list(out.glob("*.npy"))) == 8
    jsonl = _cfg(tmp_path, "jsonl", tmp_path / "chats.jsonl", mask_non_assistant=True)
    tokens = _cfg(tmp_path, "tokens", out, mask_non_assistant=True)
    a, b = (build_data_loader(c, seed=1, local_batch_size=3, dp_rank=0, dp_size=1) for c in (jsonl, tokens))
    for _ in range(6):
        x, y = next(a), next(b)
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert (x["position_ids"][:, 1:] == 0).any()  # documents restart inside windows: eos came from the manifest
    unmasked = build_data_loader(dataclasses.replace(tokens, mask_non_assistant=False), seed=1, local_batch_size=3,
                                 dp_rank=0, dp_size=1)
    assert (next(unmasked)["labels"] != -100).all()


def test_pretokenized_mixture_and_manifest_checks(tmp_path: Path) -> None:
    chats, texts = _pretokenized(tmp_path, "chats", _chats(50), "messages"), _pretokenized(tmp_path, "texts",
                                                                                         _texts(80), "text")
    mix = DataConfig(name="tokens", sources=[SourceConfig(str(chats), 1.0), SourceConfig(str(texts), 3.0)],
                     seq_len=16, cache_dir=str(tmp_path / "cache"), mask_non_assistant=True)
    loader = build_data_loader(mix, seed=0, local_batch_size=4, dp_rank=0, dp_size=1)
    for _ in range(20):
        batch = next(loader)
    shares = loader.mixture_metrics()
    assert abs(shares["data/share/texts"] - 0.75) < 0.1 and (batch["labels"] == -100).any()

    with pytest.raises(ValueError, match=r"was tokenized with qwen3 \(its manifest.json\) and the model's tokenizer "
                                         r"is qwen3_5: set model.tokenizer=qwen3"):
        build_data_loader(_cfg(tmp_path, "tokens", chats), seed=0, local_batch_size=1, dp_rank=0, dp_size=1,
                          tokenizer="qwen3_5")
    manifest = json.loads((chats / MANIFEST).read_text())
    manifest["shards"][3]["sha256"] = ""
    (chats / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"data.path: .*chats holds an unfinished tokenization \(7 of 8 shards"):
        build_data_loader(_cfg(tmp_path, "tokens", chats), seed=0, local_batch_size=1, dp_rank=0, dp_size=1)
    np.save(texts / "extra.npy", np.arange(30, dtype=np.int32))
    with pytest.raises(ValueError, match=r"mixes plain id shards \(.*extra.npy\) with \(ids, mask\) shards"):
        build_data_loader(_cfg(tmp_path, "tokens", texts), seed=0, local_batch_size=1, dp_rank=0, dp_size=1)
    assert special_tokens("qwen3")["<|endoftext|>"] == 151_643


def test_cli_tokenizes_parquet(tmp_path: Path) -> None:
    folder = _parquet_dir(tmp_path / "pq", "messages", _chats(30))
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / "pretokenize.py"), str(folder), str(out), "--workers", "2",
           "--docs-per-shard", "10", "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "3 shards, 30 documents" in done.stdout and "tokens/s" in done.stderr
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["reader"] == "hf parquet column=messages" and manifest["shards"][2]["rows"] == [20, 30]
    expected = _tokenized_stream(_cfg(tmp_path, "jsonl", _jsonl(tmp_path / "c.jsonl", "messages", _chats(30))),
                                 "qwen3")
    np.testing.assert_array_equal(manifest_stream(out), expected)


def manifest_stream(out: Path) -> np.ndarray:
    shards = json.loads((out / MANIFEST).read_text())["shards"]
    return np.concatenate([np.load(out / s["file"]) for s in shards], axis=1)
