"""Qwen3.5-MoE Hugging Face interop both ways, for the text layout and the multimodal one."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from models import get_spec
from models.hf_io import (args_from_hf_config, export_state_dict_hf, load_hf_into_model, load_hf_state_dict,
                          load_into_model, read_hf_config)
from tests.test_qwen35_parity import ARCH, _hf_config

IDS = torch.randint(0, ARCH["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))


def _transformers_text_checkpoint(path: Path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForCausalLM(_hf_config(ARCH)).float().eval()
    hf.save_pretrained(path)
    return hf


def _ours_from(path: Path) -> torch.nn.Module:
    model_type, args = args_from_hf_config(read_hf_config(path))
    model = get_spec(model_type).model_cls(args)
    load_into_model(model, load_hf_state_dict(path))
    return model.eval()


def test_transformers_text_checkpoint_loads_with_the_same_logits(tmp_path):
    hf = _transformers_text_checkpoint(tmp_path / "hf")
    assert read_hf_config(tmp_path / "hf")["model_type"] == "qwen3_5_moe_text"
    torch.testing.assert_close(_ours_from(tmp_path / "hf")(IDS).logits, hf(IDS).logits, rtol=1e-5, atol=1e-5)


def test_multimodal_checkpoint_loads_the_text_model_and_logs_the_rest(tmp_path, caplog):
    hf = _transformers_text_checkpoint(tmp_path / "text")
    # The published layout: text tensors under model.language_model., a vision tower and an MTP head beside.
    tensors = {name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: t
               for name, t in load_file(tmp_path / "text" / "model.safetensors").items()}
    tensors |= {"model.visual.blocks.0.attn.qkv.weight": torch.zeros(4, 4), "mtp.fc.weight": torch.zeros(4, 4)}
    (tmp_path / "vlm").mkdir()
    save_file(tensors, tmp_path / "vlm" / "model.safetensors", metadata={"format": "pt"})
    text_config = json.loads((tmp_path / "text" / "config.json").read_text())
    (tmp_path / "vlm" / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
         "text_config": text_config, "vision_config": {"depth": 1}, "tie_word_embeddings": False}))
    with caplog.at_level(logging.INFO):
        ours = _ours_from(tmp_path / "vlm")
    assert "2 tensors are not part of the qwen3_5_moe model built and are not trained (model.visual, mtp.fc)" \
        in caplog.text
    torch.testing.assert_close(ours(IDS).logits, hf(IDS).logits, rtol=1e-5, atol=1e-5)


def test_export_of_either_layout_loads_in_transformers(tmp_path):
    hf = _transformers_text_checkpoint(tmp_path / "hf")
    ours = _ours_from(tmp_path / "hf")
    for model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        out = tmp_path / f"export-{model_type}"
        export_state_dict_hf(ours.state_dict(), model_type, ours.args, out, max_shard_bytes=200_000)
        assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        torch.testing.assert_close(loaded(IDS).logits, hf(IDS).logits, rtol=1e-5, atol=1e-5)


def test_an_mtp_head_to_train_needs_one_in_the_checkpoint(tmp_path):
    _transformers_text_checkpoint(tmp_path / "hf")  # transformers writes no mtp.* tensors
    model_type, args = args_from_hf_config(read_hf_config(tmp_path / "hf"))
    model = get_spec(model_type).model_cls(dataclasses.replace(args, mtp_loss_weight=0.3))
    with pytest.raises(ValueError, match=r"mtp_loss_weight=0.3 trains the MTP head, and .* has none \(no mtp"):
        load_hf_into_model(model, tmp_path / "hf")
