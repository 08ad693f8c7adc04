"""Nothing of a run is lost and nothing wrong is trained without a sign (issue 31, cases 1 and 6-9): an export never
replaces a run or a folder that is not an earlier export; data changed under a resume is refused; a damaged or
swapped cache file or token shard is found and named; corpora that train on (almost) only special tokens are
refused; integer tensors are not cast into floating parameters. docs/reliability.md lists each case."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import train
from models import build_args, get_spec
from models.hf_io import EXPORT_RECORD, export_state_dict_hf, load_hf_into_model, load_into_model
from scripts import export_hf as export_script
from tests.conftest import CHAT_WORDS, write_chats, write_tokens
from training import checkpoint as ckpt
from training.data.cache import tokenized_corpus
from training.data.config import DataConfig, validate_data_config
from training.data.loader import build_data_loader
from training.data.tokenize_shards import tokenize_to_shards
from training.data.tokenizer import bpe_ranks, special_tokens

REPO = Path(__file__).resolve().parents[1]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------- 1. export
def test_an_export_never_replaces_a_run_its_parent_or_a_foreign_folder(tiny_run_config, tmp_path):
    runs = tmp_path / "runs"
    run = runs / "a"
    train.run(tiny_run_config("train.steps=2", "checkpoint.interval=2", f"train.output_dir={run}"))
    shutil.copytree(run, runs / "b")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    before = _tree(tmp_path)
    # OUT == RUN, from the command line: one line, exit 1, the run intact (before: only the HF files were left)
    out = subprocess.run([sys.executable, "scripts/export_hf.py", str(run), str(run)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{run} is not an earlier export (it holds checkpoints, config.yaml" in errors[0]
    for target in (runs, tmp_path / "mine", run / "checkpoints" / "step_00000002", run / "config.yaml"):
        with pytest.raises(ValueError, match=rf"export directory {target} is (not an earlier export|a file)"):
            export_script.main([str(run), str(target)])
    assert _tree(tmp_path) == before

    # A new directory gets an export and its record; exporting again replaces it; a file added to it is kept.
    hf = tmp_path / "hf"
    export_script.main([str(run), str(hf)])
    assert (hf / EXPORT_RECORD).is_file() and (hf / "config.json").is_file()
    export_script.main([str(run / "checkpoints" / "step_00000002"), str(hf)])
    (hf / "README.md").write_text("model card")
    with pytest.raises(ValueError, match=r"an earlier export with other files added \(it holds README\.md\)"):
        export_script.main([str(run), str(hf)])
    assert (hf / "README.md").read_text() == "model card"


def test_export_hf_at_end_is_checked_before_training(tiny_run_config):
    cfg = tiny_run_config("train.steps=1", "checkpoint.export_hf_at_end=true")
    hf = Path(cfg.train.output_dir) / "hf"
    hf.mkdir(parents=True)
    (hf / "weights.bin").write_bytes(b"someone's")
    with pytest.raises(ValueError, match=rf"export directory {hf} is not an earlier export \(it holds weights.bin"):
        train.run(cfg)
    assert not (Path(cfg.train.output_dir) / "metrics.jsonl").exists()
    (hf / "weights.bin").unlink()
    train.run(cfg)
    train.run(tiny_run_config("train.steps=1", "checkpoint.export_hf_at_end=true", "train.resume=auto"))  # replaced
    assert (hf / EXPORT_RECORD).is_file()


# ------------------------------------------------------------------------------------- 9. init_from dtypes
ARCH = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = get_spec("qwen3_moe").model_cls(build_args("qwen3_moe", ARCH))
    model.init_weights()
    return model


@pytest.mark.parametrize("disk_name,ours", [
    ("model.norm.weight", "model.norm.weight"),
    ("model.layers.0.mlp.experts.1.up_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"),  # a fused part
])
def test_an_integer_tensor_for_a_floating_parameter_is_refused_by_name(tmp_path, disk_name, ours):
    model = _tiny_model()
    export_state_dict_hf(model.state_dict(), "qwen3_moe", model.args, tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].bfloat16()  # a float cast loads
    shape = tensors[disk_name].shape
    tensors[disk_name] = torch.tensor([2, -1, 0, 1, 5], dtype=torch.int8).repeat(shape.numel())[:shape.numel()] \
        .reshape(shape)  # the issue's values: before, they loaded as 2.0, -1.0, ...
    save_file(tensors, weights, metadata={"format": "pt"})
    target = _tiny_model()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=rf"not floating-point .*: {ours} \(I8 for a float32 parameter\)"):
        load_hf_into_model(target, tmp_path / "hf")
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())  # nothing copied
    with pytest.raises(ValueError, match=rf"{ours} \(int8 for a float32 parameter\)"):
        load_into_model(target, {**model.state_dict(), ours: model.state_dict()[ours].to(torch.int8)})


# ------------------------------------------------------------------------------------- 6. data changed under a resume
def _texts(path: Path, n: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(CHAT_WORDS, size=12))}) + "\n" for _ in range(n)))
    return path


def _jsonl_loader(path: Path, cache: Path):
    cfg = DataConfig(name="jsonl", path=str(path), seq_len=8, cache_dir=str(cache))
    return build_data_loader(cfg, seed=0, local_batch_size=2, dp_rank=0, dp_size=1)


def test_a_jsonl_rewritten_in_place_is_refused_on_resume(tmp_path, caplog):
    docs = _texts(tmp_path / "docs.jsonl", 200)
    loader = _jsonl_loader(docs, tmp_path / "cache")
    next(loader)
    state = json.loads(json.dumps(loader.state_dict()))  # as train_state.json holds it
    _texts(docs, 50, seed=1)  # same path, other contents (before: resumed at a meaningless place)
    with pytest.raises(ValueError, match=r"would change what is trained: the data's contents changed since the "
                                         r"checkpoint \('jsonl' [0-9a-f]{12}\.\.\. -> [0-9a-f]{12}\.\.\.: .*"
                                         r"train\.allow_changes=\[data\.path\]"):
        _jsonl_loader(docs, tmp_path / "cache").load_state_dict(state)
    with caplog.at_level("WARNING"):
        _jsonl_loader(docs, tmp_path / "cache").load_state_dict(state, ["data.path"])
    assert "resuming anyway (train.allow_changes)" in caplog.text


def _as_if_killed_after(run_dir: Path, step: int) -> None:
    """Leave the run as a kill after ``step``'s checkpoint would: that checkpoint is its newest, nothing final."""
    for later in ckpt.step_dirs(run_dir / "checkpoints"):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    (run_dir / "model.safetensors").unlink(missing_ok=True)
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:step]))


def test_a_token_shard_changed_under_a_resume_is_refused_and_old_checkpoints_warn(tiny_run_config, tmp_path, caplog):
    shard = write_tokens(tmp_path / "shard.npy", 4096)
    config = lambda *overrides: tiny_run_config("train.steps=4", f"data.path={shard}", *overrides)  # noqa: E731
    train.run(config("checkpoint.interval=2"))
    run_dir = Path(config().train.output_dir)
    step2 = run_dir / "checkpoints" / "step_00000002"
    _as_if_killed_after(run_dir, step=2)
    original = shard.read_bytes()
    np.save(shard, np.load(shard)[::-1].copy())  # the same ids and size, in another order
    with pytest.raises(ValueError, match=r"the data's contents changed since the checkpoint \('shard' .*"
                                         r"train\.allow_changes=\[data\.path\]"):
        train.run(config(f"train.resume={step2}"))
    resumed = train.run(config(f"train.resume={step2}", "train.allow_changes=[data]"))  # deliberate
    assert [m["step"] for m in resumed] == [3, 4]
    _as_if_killed_after(run_dir, step=2)
    shard.write_bytes(original)
    state_file = step2 / ckpt.TRAIN_STATE
    state = json.loads(state_file.read_text())
    del state["loader"]["data"]  # a checkpoint from before data identities were recorded
    state_file.write_text(json.dumps(state))
    with caplog.at_level("WARNING"):
        assert [m["step"] for m in train.run(config(f"train.resume={step2}"))] == [3, 4]
    assert "records no identity of its data" in caplog.text


# ------------------------------------------------------------------------------------- 7. caches and shards checked
def test_a_damaged_tokenized_cache_is_tokenized_again(tmp_path, caplog):
    cfg = DataConfig(name="jsonl", path=str(_texts(tmp_path / "docs.jsonl", 100)), seq_len=8,
                     cache_dir=str(tmp_path / "cache"))
    stream = tokenized_corpus(cfg, "qwen3").stream
    [cache] = (tmp_path / "cache").glob("*.npy")
    data = cache.read_bytes()
    cache.write_bytes(data[:200] + bytes(len(data) - 400) + data[-200:])  # zeroed, same size (before: trained on 0)
    with caplog.at_level("WARNING"):
        again = tokenized_corpus(cfg, "qwen3").stream
    np.testing.assert_array_equal(again, stream)
    assert f"{cache} does not match what was written ({cache.name} bytes [0, {len(data)}) differ" in caplog.text
    np.testing.assert_array_equal(np.load(cache), stream)  # rewritten


def test_a_swapped_shard_with_ids_beyond_the_vocabulary_is_named(tiny_run_config, tmp_path):
    shard = write_tokens(tmp_path / "shard.npy", 4096)
    train.run(tiny_run_config("train.steps=1", f"data.path={shard}"))  # the shard's id range is cached
    stat = shard.stat()
    ids = np.load(shard)
    np.save(shard, (ids % 100 + 300).astype(ids.dtype))  # ids 300..399, same size (before: a bare IndexError)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same mtime
    with pytest.raises(ValueError, match=rf"data.path: token shard {shard} holds ids up to 399, and "
                                         r"model.arch.vocab_size=256"):
        train.run(tiny_run_config("train.steps=1", f"data.path={shard}", f"train.output_dir={tmp_path / 'other'}"))


def test_a_damaged_pretokenized_shard_is_refused(tmp_path):
    source = tmp_path / "chats.jsonl"
    write_chats(source, 40)
    tokenize_to_shards(source, tmp_path / "shards", "qwen3", docs_per_shard=10)
    cfg = DataConfig(name="tokens", path=str(tmp_path / "shards"), seq_len=8, cache_dir=str(tmp_path / "cache"))
    build_data_loader(cfg, seed=0, local_batch_size=2, dp_rank=0, dp_size=1)
    shard = tmp_path / "shards" / "shard_00001.npy"
    data = shard.read_bytes()
    shard.write_bytes(data[:-64] + bytes(64))  # zeroed ids and mask at the end, same size
    with pytest.raises(ValueError, match=rf"data.path: token shard {shard} differs from what scripts/pretokenize.py "
                                         rf"wrote \(shard_00001.npy bytes \[0, {len(data)}\) differ"):
        build_data_loader(cfg, seed=0, local_batch_size=2, dp_rank=0, dp_size=1)


# ------------------------------------------------------------------------------------- 8. special tokens only
@pytest.mark.parametrize("rows,mask,says", [
    ([{"text": ""}] * 3000, False, r"100\.0% of the 3,000 trained tokens are special tokens \(<\|endoftext\|>\)"),
    ([{"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": ""}]}
      for i in range(50)], True, r"100\.0% of the 50 trained tokens are special tokens \(<\|im_end\|>\)"),
])
def test_a_corpus_of_special_tokens_only_is_refused_with_the_key_to_accept_it(tmp_path, rows, mask, says):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(name="jsonl", path=str(path), seq_len=8, cache_dir=str(tmp_path / "cache"),
                     mask_non_assistant=mask)
    with pytest.raises(ValueError, match=rf"data.path={path}: {says}.*data.allow_special_only=true"):
        build_data_loader(cfg, seed=0, local_batch_size=2, dp_rank=0, dp_size=1)
    cfg.allow_special_only = True
    batch = next(build_data_loader(cfg, seed=0, local_batch_size=2, dp_rank=0, dp_size=1))
    assert batch["input_ids"].shape == (2, 8)


def test_allow_special_only_is_for_text_data():
    with pytest.raises(ValueError, match=r"data.allow_special_only=true .* data=tokens is not checked"):
        validate_data_config(DataConfig(name="tokens", path="x.npy", allow_special_only=True))


@pytest.mark.parametrize("tokenizer", ["qwen3", "qwen3_5"])
def test_special_tokens_are_the_ids_after_the_bpe_ids(tokenizer):
    """The special-token share counts ids >= the first special id: exact only if no BPE id comes after it."""
    assert sorted(special_tokens(tokenizer).values())[0] == max(bpe_ranks(tokenizer).values()) + 1
