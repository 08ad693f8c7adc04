"""Qwen3.5 as it ships: a run from a multimodal checkpoint (text model, vision tower, MTP head) exports every tensor
it did not train byte for byte, in the source's names, dtypes and layout, with its config, generation, tokenizer and
processor files; the trained tensors are the run's weights, and transformers' multimodal class loads the export
with our logits."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import train
from models import build_args, get_spec
from models.hf_io import INDEX, check_export_source, load_hf_state_dict, read_hf_config
from models.qwen3_5_moe.args import FULL_ATTENTION
from models.qwen3_5_moe.model import DecoderLayer
from tests.conftest import compose_config, write_tokens
from tests.test_qwen35_parity import ARCH, _hf_config

TEXT = dict(ARCH, vocab_size=256)
_SCRIPT = importlib.util.spec_from_file_location("export_hf_script", Path(__file__).parents[1] / "scripts" / "export_hf.py")
export_script = importlib.util.module_from_spec(_SCRIPT)
_SCRIPT.loader.exec_module(export_script)
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 4}  # copied as is, never parsed


def _mtp_tensors(args, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """An MTP head in the published names: fc over [embedding; hidden], two pre-fc norms, one full-attention layer
    with the MoE block (per-expert names on disk), its final norm."""
    D = args.hidden_size
    layer = {f"mtp.layers.0.{name}": p.detach() for name, p in DecoderLayer(args, FULL_ATTENTION).named_parameters()}
    for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        stacked = layer.pop(f"mtp.layers.0.mlp.experts.{fused}")
        for j, expert in enumerate(stacked):
            for part, rows in zip(parts, expert.chunk(len(parts))):
                layer[f"mtp.layers.0.mlp.experts.{j}.{part}.weight"] = rows
    tensors = {**layer, "mtp.fc.weight": torch.empty(D, 2 * D), "mtp.norm.weight": torch.empty(D),
               "mtp.pre_fc_norm_embedding.weight": torch.empty(D), "mtp.pre_fc_norm_hidden.weight": torch.empty(D)}
    return {name: torch.randn(t.shape, generator=generator) * 0.1 for name, t in tensors.items()}


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory) -> Path:
    """A tiny published-layout Qwen3.5 checkpoint written by transformers' multimodal class: the text model in fp32,
    the vision tower in bf16 (so a copy that casts would show), an MTP head, sharded, with processor files."""
    path = tmp_path_factory.mktemp("qwen35-vlm") / "source"
    vision = transformers.models.qwen3_5_moe.configuration_qwen3_5_moe.Qwen3_5MoeVisionConfig(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT["hidden_size"],
        patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(
        text_config=_hf_config(TEXT).to_dict(), vision_config=vision.to_dict())).float()
    hf.model.visual.to(torch.bfloat16)
    hf.save_pretrained(path, max_shard_size="200KB")
    generator = torch.Generator().manual_seed(1)
    save_file(_mtp_tensors(build_args("qwen3_5_moe", TEXT), generator), path / "mtp.safetensors",
              metadata={"format": "pt"})
    index = json.loads((path / INDEX).read_text())
    index["weight_map"] |= {name: "mtp.safetensors" for name in safe_open(path / "mtp.safetensors", "pt").keys()}
    (path / INDEX).write_text(json.dumps(index))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def _source_tensors(path: Path) -> dict[str, torch.Tensor]:
    weight_map = json.loads((path / INDEX).read_text())["weight_map"]
    return {name: t for file in sorted(set(weight_map.values())) for name, t in load_file(path / file).items()}


def _exported(path: Path) -> dict[str, torch.Tensor]:
    if (path / INDEX).is_file():
        return _source_tensors(path)
    return load_file(path / "model.safetensors")


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _run(tmp_path: Path, source: Path, name: str, *overrides: str) -> Path:
    write_tokens(tmp_path / "tokens.npy", 2048)
    cfg = compose_config([
        "model=hf", f"model.init_from={source}", "model.tokenizer=none", "data=tokens",
        f"data.path={tmp_path / 'tokens.npy'}", "data.seq_len=16", f"data.cache_dir={tmp_path / 'cache'}",
        f"train.output_dir={tmp_path / name}", "train.steps=2", "train.local_batch_size=2", "optim.warmup_steps=0",
        "optim.lr=1e-2", "logging.tensorboard=false", "train.device=cpu", "train.mixed_precision=fp32",
        "checkpoint.export_hf_at_end=true", "checkpoint.at_end=false", *overrides])
    train.run(cfg)
    return tmp_path / name


def test_export_keeps_every_untrained_tensor_and_the_source_layout(tmp_path, multimodal, caplog):
    run = _run(tmp_path, multimodal, "run")
    source, exported, trained = _source_tensors(multimodal), _exported(run / "hf"), load_file(run / "model.safetensors")
    assert "are not part of the qwen3_5_moe model built and are not trained (model.visual, mtp.fc, mtp.layers" \
        in (run / "train.log").read_text()
    untrained = [name for name in source if name.startswith(("model.visual.", "mtp."))]
    assert untrained and set(exported) == set(source)
    for name in untrained:
        assert _bitwise_equal(exported[name], source[name]), name
    assert exported["model.visual.blocks.0.attn.qkv.weight"].dtype == torch.bfloat16
    # The trained tensors are the run's weights (changed by training), in the source's names.
    changed = 0
    for name, value in trained.items():
        disk = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        if ".mlp.experts.gate_up_proj" in name or ".mlp.experts.down_proj" in name:
            parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            module = disk.rsplit(".", 1)[0]
            on_disk = torch.stack([torch.cat([exported[f"{module}.{j}.{p}.weight"] for p in parts])
                                   for j in range(value.shape[0])])
        else:
            on_disk = exported[disk]
        assert torch.equal(on_disk, value), name
        changed += not torch.equal(on_disk, source[disk]) if disk in source else 0
    assert changed > 0
    for name in ("config.json", "generation_config.json", "preprocessor_config.json"):
        assert (run / "hf" / name).read_bytes() == (multimodal / name).read_bytes(), name
    # transformers' multimodal class loads it, with the text logits of the run's weights.
    loaded = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(run / "hf", dtype=torch.float32).eval()
    assert loaded.model.visual.blocks[0].attn.qkv.weight.dtype == torch.float32  # dtype=float32 casts it on load
    model_type, args = "qwen3_5_moe", build_args("qwen3_5_moe", {**TEXT})
    ours = get_spec(model_type).model_cls(args)
    ours.load_state_dict(trained, strict=True)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(loaded(input_ids=ids).logits, ours.eval()(ids).logits, rtol=1e-5, atol=1e-5)
    # scripts/export_hf.py writes the same from the run directory; --source none the trained text model alone.
    export_script.main([str(run), str(tmp_path / "again")])
    assert {name: t.dtype for name, t in _exported(tmp_path / "again").items()} == \
        {name: t.dtype for name, t in exported.items()}
    export_script.main([str(run), str(tmp_path / "alone"), "--source", "none"])
    alone = _exported(tmp_path / "alone")
    assert not any(name.startswith(("model.visual.", "mtp.", "model.language_model.")) for name in alone)
    assert read_hf_config(tmp_path / "alone")["model_type"] == "qwen3_5_moe_text"


def test_trained_mtp_head_is_exported_and_reloads_exactly(tmp_path, multimodal):
    run = _run(tmp_path, multimodal, "mtp", "model.arch.mtp_loss_weight=0.3")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["mtp_loss"] > 0 for m in metrics if "loss" in m)
    source, exported, trained = _source_tensors(multimodal), _exported(run / "hf"), load_file(run / "model.safetensors")
    mtp = [name for name in trained if name.startswith("mtp.")]
    assert "mtp.fc.weight" in mtp and "mtp.layers.0.mlp.experts.gate_up_proj" in mtp
    for name in mtp:  # trained: changed, and exported as the run's weights (per expert on disk, as the source)
        assert torch.equal(exported[name], trained[name]) if name in exported else name.endswith("_proj"), name
        assert name not in source or not torch.equal(trained[name], source[name]), name
    assert set(exported) == set(source)  # the source's names: the MTP experts one by one
    for name in source:
        if name.startswith("model.visual."):
            assert _bitwise_equal(exported[name], source[name]), name
    # Loaded back (the MTP head with it), the export is the run's weights exactly.
    reloaded = load_hf_state_dict(run / "hf", mtp=True)
    assert reloaded.keys() == trained.keys()
    assert all(torch.equal(reloaded[name], trained[name]) for name in trained)


def test_export_refuses_a_source_that_is_gone_or_of_another_architecture(tmp_path, multimodal):
    args = build_args("qwen3_5_moe", TEXT)
    assert check_export_source(multimodal, "qwen3_5_moe", args) == "qwen3_5_moe"
    with pytest.raises(ValueError, match="is gone"):
        check_export_source(tmp_path / "moved", "qwen3_5_moe", args)
    with pytest.raises(ValueError, match="rope_theta: preset 5000.0 vs config.json 10000.0"):
        check_export_source(multimodal, "qwen3_5_moe", build_args("qwen3_5_moe", {**TEXT, "rope_theta": 5000.0}))
    assert read_hf_config(multimodal)["model_type"] == "qwen3_5_moe"
