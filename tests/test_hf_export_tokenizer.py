"""The exported Hugging Face directory is usable end to end (issue 15): its tokenizer files give the training
tokenizer's ids (both vocabularies, chat template included), a trained and exported run generates text through
``transformers.pipeline``. And the model decides its tokenizer (``model.tokenizer``): presets, ``model=hf``
directories, mismatches refused at start-up, resume, the data cache."""

from __future__ import annotations

import contextlib
import importlib.resources
import importlib.util
import io
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException

import train
from tests.conftest import TINY_MODEL, compose_config, write_chats, write_tokens
from training.config import check_resume_config
from training.data.config import DataConfig
from training.data.loader import build_data_loader
from training.data.hf_tokenizer import (CHAT_TEMPLATE, TOKENIZER_FILES, identify_hf_tokenizer, run_tokenizer,
                                   write_hf_tokenizer)
from training.data.tokenizer import QwenTokenizer, special_tokens
from training import startup

REPO = Path(__file__).resolve().parents[1]
CHITCHAT_JSON = Path(str(importlib.resources.files("chitchat_dataset") / "dataset.json"))
VOCABS = ["qwen3", "qwen3_5"]
# Strings where byte-level BPE, the split regex or NFC could differ from tiktoken's.
TRICKY = ["I'LL be there, they'RE not!", "naïve café", "cafe\u0301 vs caf\u00e9", "emoji 🙂👍🏽 and ZWJ 👩‍💻",
          "中文和日本語のテキスト", "  leading spaces\n\n\ttabs\r\nand   runs   ", "numbers 1234567 3.14159 1e-9",
          "<|im_start|> is text here", "ünïcödé Ελληνικά русский עברית العربية", "a\u0300\u0301 e\u0308 क्षि",
          "x" * 300, " ", "\n"]


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")  # a test extra: only the tests that load the files need it


@pytest.fixture(scope="module")
def chitchat():
    return list(json.loads(CHITCHAT_JSON.read_bytes()).values())


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory, transformers):
    """Per vocabulary: (directory written by write_hf_tokenizer, its AutoTokenizer); written once per module."""
    cache: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in cache:
            out = tmp_path_factory.mktemp(f"tok-{name}")
            write_hf_tokenizer(name, out)
            cache[name] = out, transformers.AutoTokenizer.from_pretrained(out)
        return cache[name]

    return get


def chitchat_messages(conv: dict) -> list[dict]:
    """A conversation as training renders it (training/data.py: alternating user / assistant turns)."""
    utterances = [u for group in conv["messages"] for u in group]
    turns = ["\n".join(u["text"] for u in run) for _, run in itertools.groupby(utterances, key=lambda u: u["sender"])]
    return [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


def input_ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


# ------------------------------------------------------------------------------------ the tokenizer files


@pytest.mark.parametrize("name", VOCABS)
def test_exported_tokenizer_gives_the_training_ids(name, hf_tokenizer, chitchat):
    _, hf = hf_tokenizer(name)
    ours = QwenTokenizer(name)
    rng = random.Random(0)
    texts = [u["text"] for conv in rng.sample(chitchat, 300) for group in conv["messages"] for u in group]
    for text in texts[:2000] + TRICKY:
        if "<|" in text:  # special-token text: ours keeps it text, a HF tokenizer's added tokens split it out
            continue
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ids == ours.encode(text), text
        assert hf.decode(ids) == ours.decode(ids)
    assert hf.decode(ours.encode(TRICKY[0])) == TRICKY[0]


@pytest.mark.parametrize("name", VOCABS)
def test_chat_template_renders_like_render_chat(name, hf_tokenizer, chitchat):
    _, hf = hf_tokenizer(name)
    ours = QwenTokenizer(name)
    conversations = [chitchat_messages(c) for c in random.Random(1).sample(chitchat, 100)]
    conversations.append([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                          {"role": "assistant", "content": "Checking."}, {"role": "tool", "content": '{"t": 21}'}])
    for messages in conversations:
        expected, _ = ours.render_chat(messages)
        assert input_ids(hf.apply_chat_template(messages, tokenize=True)) == expected
    messages = conversations[-1]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert hf.apply_chat_template(messages, tokenize=False) == text
    prompt = input_ids(hf.apply_chat_template(messages[:2], tokenize=True, add_generation_prompt=True))
    assert prompt == ours.render_chat(messages[:2])[0] + [ours.im_start_id, *ours.encode("assistant\n")]
    with pytest.raises(Exception, match="unknown chat role bot"):
        hf.apply_chat_template([{"role": "bot", "content": "x"}], tokenize=False)


@pytest.mark.parametrize("name", VOCABS)
def test_special_tokens_and_generation_config(name, hf_tokenizer, transformers):
    out, hf = hf_tokenizer(name)
    ids = special_tokens(name)
    assert sorted(TOKENIZER_FILES) == sorted(p.name for p in out.iterdir())
    assert (hf.eos_token, hf.pad_token, hf.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert (hf.eos_token_id, hf.pad_token_id) == (ids["<|im_end|>"], ids["<|endoftext|>"])
    assert hf.convert_tokens_to_ids(list(ids)) == list(ids.values())
    assert len(hf) == QwenTokenizer(name).vocab_size
    assert hf.chat_template == CHAT_TEMPLATE
    # <think> is text in Qwen's files (kept by skip_special_tokens), <|im_start|> a control token
    assert hf.decode([ids["<|im_start|>"], ids["<think>"]], skip_special_tokens=True) == "<think>"
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert generation.pad_token_id == generation.bos_token_id == ids["<|endoftext|>"]
    assert identify_hf_tokenizer(out) == name


# ----------------------------------------------------------------------- train, export, generate


def load_export_script():
    spec = importlib.util.spec_from_file_location("export_hf_script", REPO / "scripts" / "export_hf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 2-step qwen3_moe_debug run (real vocabulary) on small chats, exported at the end and by the script."""
    tmp = tmp_path_factory.mktemp("e2e")
    chats = write_chats(tmp / "chats.jsonl", num_conversations=32)
    train.run(compose_config([
        "model=qwen3_moe_debug", "data=jsonl", f"data.path={chats}", "data.seq_len=32", "train.steps=2",
        "train.local_batch_size=2", f"train.output_dir={tmp / 'run'}", f"data.cache_dir={tmp / 'cache'}",
        "logging.tensorboard=false", "checkpoint.export_hf_at_end=true"]))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        load_export_script().main([str(tmp / "run"), str(tmp / "hf")])
    assert "with the qwen3 tokenizer" in printed.getvalue()
    return tmp


def test_exported_run_generates_through_the_pipeline(trained_run, transformers):
    hf = trained_run / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (151643, 151645)
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    text = "Hello there! How are you today?"
    assert tok.decode(tok(text)["input_ids"]) == text
    pipe = transformers.pipeline("text-generation", model=str(hf), device="cpu")
    prompt_ids = tok(text)["input_ids"]
    out = pipe(text, max_new_tokens=4, min_new_tokens=4, do_sample=False, return_tensors=True)
    assert out[0]["generated_token_ids"][:len(prompt_ids)] == prompt_ids
    assert len(out[0]["generated_token_ids"]) == len(prompt_ids) + 4
    chat = pipe([{"role": "user", "content": "Hi!"}], max_new_tokens=3, do_sample=False)
    assert chat[0]["generated_text"][-1]["role"] == "assistant"


def test_the_documented_check_runs_outside_the_repository_and_decodes_as_ours(trained_run, tmp_path):
    """docs/huggingface.md's check of an export, run as it says: from a directory outside the repository, with
    nothing of ours on sys.path, so that `kernels` is whatever transformers installed (the PyPI package from 5.25 on).
    Each greedy id it prints is our model's argmax after the same ids, up to fp32 round-off between the two."""
    from models import build_args, get_spec
    from safetensors.torch import load_file

    script = re.search(r"python - \S+ <<'EOF'\n(.*?)\nEOF\n", (REPO / "docs" / "huggingface.md").read_text(), re.S)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-", str(trained_run / "hf")], input=script.group(1), cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    prompt, greedy = (json.loads(ids) for ids in re.search(r"prompt (\[.*\]) greedy (\[.*\])", out.stdout).groups())
    assert len(greedy) == 8
    arch = dict(compose_config(["model=qwen3_moe_debug"]).model.arch)
    ours = get_spec("qwen3_moe").model_cls(build_args("qwen3_moe", arch))
    ours.load_state_dict(load_file(trained_run / "run" / "model.safetensors"))
    with torch.no_grad():
        logits_V = ours(torch.tensor([prompt + greedy])).logits[0, len(prompt) - 1:-1]
    chosen = logits_V.gather(1, torch.tensor(greedy)[:, None])[:, 0]
    torch.testing.assert_close(chosen, logits_V.max(dim=1).values, rtol=0, atol=1e-4)


def test_export_at_end_writes_the_same_tokenizer_files(trained_run):
    for file in TOKENIZER_FILES:
        assert (trained_run / "run" / "hf" / file).read_bytes() == (trained_run / "hf" / file).read_bytes(), file


# ------------------------------------------------------------------------- model.tokenizer decides


def test_presets_name_their_tokenizer_and_data_tokenizer_is_gone():
    assert compose_config([]).model.tokenizer == "qwen3"
    assert compose_config(["model=qwen3_moe_30b_a3b"]).model.tokenizer == "qwen3"
    assert compose_config(["model=qwen35_moe_debug"]).model.tokenizer == "qwen3_5"
    assert compose_config(["model=qwen35_moe"]).model.tokenizer == "qwen3_5"
    assert compose_config(["model=hf", "model.init_from=x"]).model.tokenizer == "auto"
    with pytest.raises(ConfigCompositionException, match="data.tokenizer"):
        compose_config(["data.tokenizer=qwen3_5"])


@pytest.mark.parametrize("overrides, message", [
    (["model.tokenizer=qwen3_5"], r"model.tokenizer=qwen3_5 has 248,077 ids .* model.arch.vocab_size=151,936"),
    (["model=qwen35_moe_debug", "model.tokenizer=qwen3"],
     r"model.arch.vocab_size=248,320 is the qwen3_5 vocabulary's size, but model.tokenizer=qwen3"),
    (["model.tokenizer=none"], "model.tokenizer=none names none"),
    (["model.tokenizer=gpt2"], "model.tokenizer='gpt2' is unknown"),
    (["model.tokenizer=auto"], "model.tokenizer=auto takes the tokenizer of model.init_from"),
])
def test_a_tokenizer_that_does_not_fit_fails_at_start_up(overrides, message):
    with pytest.raises(ValueError, match=message):
        startup.check_config(compose_config(overrides), world_size=1)


def test_pre_tokenized_data_of_another_vocabulary_has_no_tokenizer(tmp_path, caplog):
    data = write_tokens(tmp_path / "t.npy", 1000)
    cfg = compose_config([*TINY_MODEL, "data=tokens", f"data.path={data}", "checkpoint.export_hf_at_end=true"])
    with caplog.at_level("WARNING"):
        startup.check_config(cfg, world_size=1)
    assert run_tokenizer(cfg, 256) is None
    assert "will have no tokenizer files (model.tokenizer=qwen3 has 151,669 ids" in caplog.text
    assert run_tokenizer(compose_config(["data=tokens", f"data.path={data}"]), 151_936) == "qwen3"


def fake_hf_dir(path: Path, config: dict, tokenizer_dir: Path | None = None) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    for file in TOKENIZER_FILES if tokenizer_dir else ():
        shutil.copy(tokenizer_dir / file, path / file)
    return path


QWEN3_CONFIG = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
QWEN35_CONFIG = {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "num_experts": 8, "num_experts_per_tok": 2}


def test_model_hf_takes_the_tokenizer_of_its_directory(tmp_path, hf_tokenizer):
    def tokenizer(init_from: Path, *overrides: str) -> str | None:
        cfg = compose_config(["model=hf", f"model.init_from={init_from}", *overrides])
        startup.check_config(cfg, world_size=1)
        return run_tokenizer(cfg, startup.resolve_model(cfg)[1].vocab_size)

    qwen3 = fake_hf_dir(tmp_path / "qwen3", QWEN3_CONFIG, hf_tokenizer("qwen3")[0])
    qwen35 = fake_hf_dir(tmp_path / "qwen35", QWEN35_CONFIG, hf_tokenizer("qwen3_5")[0])
    assert tokenizer(qwen3) == "qwen3"
    assert tokenizer(qwen35) == "qwen3_5"
    # no tokenizer files: config.json's vocab_size, if it is a published one
    assert tokenizer(fake_hf_dir(tmp_path / "bare", QWEN35_CONFIG)) == "qwen3_5"
    tiny = fake_hf_dir(tmp_path / "tiny", {**QWEN3_CONFIG, "vocab_size": 256})
    data = write_tokens(tmp_path / "t.npy", 1000)
    assert tokenizer(tiny, "data=tokens", f"data.path={data}") is None
    with pytest.raises(ValueError, match="has no tokenizer files and its vocab_size is none of the published"):
        tokenizer(tiny)
    # a named preset (or tokenizer) that disagrees with the directory
    with pytest.raises(ValueError, match=r"model.tokenizer=qwen3 but model.init_from=.* is of the qwen3_5 vocabulary"):
        startup.check_config(compose_config([f"model.init_from={qwen35}"]), world_size=1)
    with pytest.raises(ValueError, match=r"is of the qwen3 vocabulary .* set model.tokenizer=qwen3 "):
        tokenizer(qwen3, "model.tokenizer=qwen3_5")


def test_a_directory_tokenizer_we_cannot_reproduce_is_refused(tmp_path):
    foreign = fake_hf_dir(tmp_path / "foreign", QWEN3_CONFIG)
    (foreign / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"50256": {"content": "<|endoftext|>", "special": True}}}))
    with pytest.raises(ValueError, match=r"not one this trainer reproduces offline: <\|endoftext\|> is 50256"):
        identify_hf_tokenizer(foreign)
    other_bpe = fake_hf_dir(tmp_path / "other_bpe", QWEN3_CONFIG)
    (other_bpe / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [{"id": 151643, "content": "<|endoftext|>"}], "model": {"type": "BPE", "vocab": {"a": 0}}}))
    with pytest.raises(ValueError, match="not the qwen3 vocabulary this trainer reproduces offline.*BPE entries"):
        identify_hf_tokenizer(other_bpe)
    wrong_ids = fake_hf_dir(tmp_path / "wrong_ids", {**QWEN3_CONFIG, "eos_token_id": 248046})
    with pytest.raises(ValueError, match=r"config.json: eos_token_id=248046 is not a special token of "
                                         r"model.tokenizer=qwen3"):
        startup.check_config(compose_config([f"model.init_from={wrong_ids}"]), world_size=1)


def test_a_changed_tokenizer_refuses_to_resume():
    with pytest.raises(ValueError, match=r"model.tokenizer: 'qwen3' -> 'qwen3_5'"):
        check_resume_config({"model.tokenizer": "qwen3"}, {"model.tokenizer": "qwen3_5"}, [], "ckpt")
    assert check_resume_config({"model.tokenizer": "qwen3"}, {"model.tokenizer": "qwen3_5"}, ["model.tokenizer"], "c")


def test_the_data_cache_is_per_tokenizer(tmp_path):
    cfg = DataConfig(name="jsonl", path=str(write_chats(tmp_path / "c.jsonl", 8)), seq_len=16,
                     cache_dir=str(tmp_path / "cache"))
    loaders = {name: build_data_loader(cfg, seed=0, local_batch_size=1, dp_rank=0, dp_size=1, tokenizer=name)
               for name in VOCABS}
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "cache").glob("*.npy")) == VOCABS
    assert {name: loader.vocab_size for name, loader in loaders.items()} == {"qwen3": 151_669, "qwen3_5": 248_077}
    with pytest.raises(ValueError, match="tokenizes its text with the model's tokenizer"):
        build_data_loader(cfg, seed=0, local_batch_size=1, dp_rank=0, dp_size=1, tokenizer=None)


def test_export_script_tokenizer_of_older_and_pre_tokenized_runs():
    script = load_export_script()
    assert script.run_tokenizer({"model": {"tokenizer": "qwen3_5"}}, 248_320, None)[0] == "qwen3_5"
    assert script.run_tokenizer({"data": {"tokenizer": "qwen3"}}, 151_936, None)[0] == "qwen3"  # before model.*
    assert script.run_tokenizer({"model": {"tokenizer": "qwen3"}}, 256, None) == (
        None, "model.tokenizer=qwen3 has 151,669 ids (up to 151668) but model.arch.vocab_size=256 has no row for the "
              "last 151,413 (pre-tokenized ids of another vocabulary?)")
    assert script.run_tokenizer({"model": {"tokenizer": "qwen3"}}, 151_936, "none")[0] is None
    with pytest.raises(ValueError, match="--tokenizer qwen3_5: model.tokenizer=qwen3_5 has 248,077 ids"):
        script.run_tokenizer({"model": {"tokenizer": "qwen3"}}, 151_936, "qwen3_5")


def test_the_export_hook_writes_the_image_processor_only_where_the_source_carried_none(tmp_path) -> None:
    """``hf_export_files``: the image processor is written beside the tokenizer files, unless the export already holds
    the source's preprocessor_config.json (copied before the hook runs), which stays as it was."""
    from training.data.hf_tokenizer import hf_export_files
    from training.data.vision import ImageProcessing, read_image_processing

    processing = ImageProcessing.for_tower(patch_size=16, temporal_patch_size=2, merge_size=2)
    assert hf_export_files(None, None) is None
    hf_export_files(None, processing)(tmp_path)
    assert read_image_processing(tmp_path) == processing
    carried = '{"patch_size": 16, "merge_size": 2, "image_mean": [0.1, 0.2, 0.3]}\n'
    (tmp_path / "preprocessor_config.json").write_text(carried)
    hf_export_files("qwen3_5", processing)(tmp_path)
    assert (tmp_path / "preprocessor_config.json").read_text() == carried
    assert (tmp_path / "tokenizer.json").is_file()
