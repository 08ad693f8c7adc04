"""Hugging Face interop: round trips through transformers, sharded checkpoints, error reporting, config
translation, and loading into FSDP2/EP DTensor shards on 2 gloo ranks.

transformers is imported inside the tests that use it: the spawned gloo ranks import this module and
should not pay for it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

from models import build_args, get_spec
from models.hf_io import (EXPORT_RECORD, INDEX, SAFETENSORS, args_from_hf_config, export_hf, export_state_dict_hf,
                          load_hf_into_model, load_hf_state_dict, load_into_model, preset_differences,
                          read_hf_config)
from tests.dist_utils import run_distributed

REPO = Path(__file__).resolve().parents[1]
ARCH = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            rope_theta=1e6, max_position_embeddings=256, initializer_range=0.1)
SMALL_SHARD = 100_000  # bytes: the tiny model (~0.56 MB in fp32) then spans several shards


def _model(seed: int = 0, **overrides) -> nn.Module:
    torch.manual_seed(seed)
    model = get_spec("qwen3_moe").model_cls(build_args("qwen3_moe", {**ARCH, **overrides}))
    model.init_weights()
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, ARCH["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))


def _hf_model(config: dict) -> nn.Module:
    import transformers

    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config))


def test_export_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ours = _model()
    export_hf(ours, "qwen3_moe", tmp_path / "hf", max_shard_bytes=SMALL_SHARD)
    index = json.loads((tmp_path / "hf" / INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in index["weight_map"]
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    assert hf.config.num_experts == 8 and hf.config.rope_parameters["rope_theta"] == 1e6
    torch.testing.assert_close(hf(_ids()).logits, ours(_ids()).logits, rtol=0, atol=1e-5)


def test_export_replaces_an_earlier_export(tmp_path: Path) -> None:
    model = _model()
    export_state_dict_hf(model.state_dict(), "qwen3_moe", model.args, tmp_path / "hf", max_shard_bytes=SMALL_SHARD)
    export_state_dict_hf(model.state_dict(), "qwen3_moe", model.args, tmp_path / "hf", dtype=torch.bfloat16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary or old directory left
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [EXPORT_RECORD, "config.json", SAFETENSORS]
    assert read_hf_config(tmp_path / "hf")["torch_dtype"] == "bfloat16"
    assert load_file(tmp_path / "hf" / SAFETENSORS)["lm_head.weight"].dtype == torch.bfloat16


def test_transformers_checkpoint_loads_into_ours(tmp_path: Path) -> None:
    config = {k: v for k, v in ARCH.items() if k != "rope_theta"} | {"rope_parameters": {"rope_theta": 1e6}}
    hf = _hf_model(config)
    hf.save_pretrained(tmp_path / "hf", max_shard_size=SMALL_SHARD)
    cfg = read_hf_config(tmp_path / "hf")
    assert "num_local_experts" in cfg and "rope_parameters" in cfg  # transformers 5's own spelling
    assert len(set(json.loads((tmp_path / "hf" / INDEX).read_text())["weight_map"].values())) > 2

    model_type, args = args_from_hf_config(cfg)
    assert (model_type, args) == ("qwen3_moe", build_args("qwen3_moe", ARCH))
    ours = get_spec(model_type).model_cls(args)
    load_into_model(ours, load_hf_state_dict(tmp_path / "hf"))
    torch.testing.assert_close(ours(_ids()).logits, hf(_ids()).logits, rtol=0, atol=1e-5)


def test_fused_expert_names_on_disk_load(tmp_path: Path) -> None:
    ours = _model()
    export_hf(ours, "qwen3_moe", tmp_path / "hf")
    save_file(ours.state_dict(), tmp_path / "hf" / SAFETENSORS)  # overwrite with the in-memory names
    loaded = load_hf_state_dict(tmp_path / "hf")
    assert loaded.keys() == ours.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in ours.state_dict().items())


def test_incomplete_per_expert_tensors_are_listed(tmp_path: Path) -> None:
    export_hf(_model(), "qwen3_moe", tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / SAFETENSORS)
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, tmp_path / "hf" / SAFETENSORS)
    with pytest.raises(ValueError, match=r"lacks 1 per-expert .*model\.layers\.0\.mlp\.experts\.3\.up_proj"):
        load_hf_state_dict(tmp_path / "hf")


def test_mismatches_raise_one_error_and_change_nothing() -> None:
    model = _model()
    state = {k: v.clone() for k, v in _model(seed=1).state_dict().items()}
    del state["model.norm.weight"]
    state["model.layers.0.mlp.experts.w1"] = torch.zeros(1)
    state["model.layers.1.mlp.experts.down_proj"] = torch.zeros(8, 64, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as err:
        load_into_model(model, state)
    message = str(err.value)
    assert "missing (1): model.norm.weight" in message
    assert "unexpected (1): model.layers.0.mlp.experts.w1" in message
    assert "mis-shaped (1): model.layers.1.mlp.experts.down_proj (checkpoint (8, 64, 16), model (8, 64, 32))" \
        in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_tied_embeddings_load_from_either_name() -> None:
    model = _model(tie_word_embeddings=True)
    state = {k: v for k, v in _model(seed=1, tie_word_embeddings=True).state_dict().items() if k != "lm_head.weight"}
    load_into_model(model, state)
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])


def _hub_config(**changes) -> dict:
    """A config.json as the hub's Qwen3-MoE checkpoints spell it (transformers 4 style)."""
    cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "rope_scaling": None,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": 4096,
           "max_window_layers": 2, "attention_bias": False, "torch_dtype": "bfloat16", **ARCH}
    return {**cfg, **changes}


def test_hub_spelling_and_transformers_defaults() -> None:
    assert args_from_hf_config(_hub_config())[1] == build_args("qwen3_moe", ARCH)
    sparse = {k: v for k, v in _hub_config().items() if k not in ("head_dim", "norm_topk_prob")}
    args = args_from_hf_config(sparse)[1]
    assert args.head_dim == 64 // 4  # transformers' fallback: hidden / heads
    assert args.norm_topk_prob is False  # transformers' default, not our preset's


def test_preset_differences() -> None:
    preset = build_args("qwen3_moe", ARCH)
    assert preset_differences(preset, _hub_config()) == []
    cfg = _hub_config(num_experts=16, rope_theta=1e4)
    assert preset_differences(preset, cfg) == ["num_experts: preset 8 vs config.json 16",
                                               "rope_theta: preset 1000000.0 vs config.json 10000.0"]


@pytest.mark.parametrize("changes, key", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
])
def test_unsupported_features_raise(changes: dict, key: str) -> None:
    with pytest.raises(ValueError, match=f"not implemented here: {key}"):
        args_from_hf_config(_hub_config(**changes))


def test_unregistered_model_type_raises() -> None:
    with pytest.raises(ValueError, match="'llama' is not registered"):
        args_from_hf_config(_hub_config(model_type="llama"))


def _write_run(run_dir: Path) -> nn.Module:
    model = _model()
    run_dir.mkdir()
    save_file(model.state_dict(), run_dir / "model.safetensors")
    config = {"model": {"model_type": "qwen3_moe", "arch": dataclasses.asdict(model.args)}, "seed": 0}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return model


def test_export_script(tmp_path: Path) -> None:
    model = _write_run(tmp_path / "run")
    subprocess.run([sys.executable, "scripts/export_hf.py", str(tmp_path / "run" / "model.safetensors"),
                    str(tmp_path / "hf"), "--max-shard-bytes", str(SMALL_SHARD)], cwd=REPO, check=True)
    loaded = load_hf_state_dict(tmp_path / "hf")
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    assert (tmp_path / "hf" / INDEX).is_file()


def test_export_script_errors(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("export_hf_script", REPO / "scripts" / "export_hf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(FileNotFoundError, match="model.safetensors not found"):
        script.main([str(tmp_path), str(tmp_path / "hf")])
    _write_run(tmp_path / "run")
    (tmp_path / "run" / "config.yaml").write_text("model: {model_type: null}\n")
    with pytest.raises(ValueError, match="lacks model.model_type or model.arch"):
        script.main([str(tmp_path / "run"), str(tmp_path / "hf")])


def _dtensor_load_worker(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2,))
    fsdp = nn.Module()
    fsdp.uneven = nn.Parameter(torch.zeros(3, 4))  # chunks of 2 and 1 rows
    fsdp.tail = nn.Parameter(torch.zeros(1, 5))  # rank 1's shard is empty
    fsdp.cols = nn.Parameter(torch.zeros(4, 6))  # Shard(1) (FSDP2 needs it even there)
    fully_shard(fsdp, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p is fsdp.cols else Shard(0))
    model = nn.Module()
    model.fsdp = fsdp
    # EP x EFSDP-like layouts: two placements, applied left to right.
    ep_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "efsdp"))
    model.experts = nn.Parameter(distribute_tensor(torch.zeros(5, 3, 4), ep_mesh, [Shard(0), Shard(1)]))
    efsdp_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("ep", "efsdp"))
    model.expert_cols = nn.Parameter(  # uneven Shard(1): 3 and 2 columns
        distribute_tensor(torch.zeros(2, 5), efsdp_mesh, [Replicate(), Shard(1)]))
    model.replicated = nn.Parameter(distribute_tensor(torch.zeros(2, 3), mesh, [Replicate()]))

    generator = torch.Generator().manual_seed(0)  # the same full tensors on both ranks
    full = {name: torch.randn(p.shape, generator=generator) for name, p in model.named_parameters()}
    load_into_model(model, full)
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), full[name]), name


@pytest.mark.torch_apis
def test_load_into_dtensor_shards_on_two_gloo_ranks(tmp_path: Path) -> None:
    run_distributed(_dtensor_load_worker, 2)


def test_reading_a_box_of_the_disk_equals_slicing_the_full_tensor(tmp_path: Path) -> None:
    """The per-rank reader: any box of a fused expert tensor (rows across the gate/up boundary, a subset of
    experts, empty boxes) read from per-expert files equals the same box of the full tensor."""
    from models.hf_io import _disk_sources
    export_state_dict_hf(_model().state_dict(), "qwen3_moe", build_args("qwen3_moe", ARCH), tmp_path / "hf",
                         max_shard_bytes=SMALL_SHARD)
    full = load_hf_state_dict(tmp_path / "hf")
    boxes = [(slice(2, 5), slice(20, 45), slice(0, 64)), (slice(7, 8), slice(0, 64), slice(3, 9)),
             (slice(4, 4), slice(0, 64), slice(0, 64)), (slice(0, 8), slice(40, 40), slice(0, 64))]
    with _disk_sources(tmp_path / "hf") as sources:
        src = sources["model.layers.1.mlp.experts.gate_up_proj"]
        for box in boxes:
            assert torch.equal(src.read(box), full["model.layers.1.mlp.experts.gate_up_proj"][box]), box


def _sharded_hf_load_worker(rank: int, world_size: int, hf_dir: str) -> None:
    mesh = init_device_mesh("cpu", (2,))
    with torch.device("meta"):
        model = get_spec("qwen3_moe").model_cls(build_args("qwen3_moe", ARCH))
    for layer in model.model.layers:  # experts sharded on dim 1 (rows), the rest on dim 0
        fully_shard(layer.mlp.experts, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    load_hf_into_model(model, hf_dir)
    full = load_hf_state_dict(hf_dir)
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), full[name]), name


@pytest.mark.torch_apis
def test_each_rank_reads_its_own_slices_into_an_fsdp_model(tmp_path: Path) -> None:
    export_state_dict_hf(_model().state_dict(), "qwen3_moe", build_args("qwen3_moe", ARCH), tmp_path / "hf",
                         max_shard_bytes=SMALL_SHARD)
    run_distributed(_sharded_hf_load_worker, 2, str(tmp_path / "hf"))
