"""The training loop end to end on one process: it learns, it measures, it fails early on bad input."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.errors import ConfigCompositionException
from safetensors.torch import load_file

import train
import training.batch
from models import build_args, get_spec
from tests.conftest import TINY_MODEL, compose_config, write_chats
from training.data.loader import build_data_loader
from training.data.tokenizer import QwenTokenizer

REPO = Path(__file__).resolve().parents[1]
REQUIRED_METRICS = {"step", "loss", "aux_loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_per_device",
                    "mfu", "peak_mem_gib"}


def test_loss_on_a_fixed_batch_falls_far_below_its_start(tiny_run_config):
    # 4 windows of 33 tokens = exactly one global batch, so every step sees the same data.
    cfg = tiny_run_config("train.steps=40", "optim.lr=1e-2", "optim.warmup_steps=2", num_tokens=4 * 33)
    history = train.run(cfg)
    assert [m["step"] for m in history] == list(range(1, 41))
    assert history[-1]["loss"] < 0.25 * history[0]["loss"]


def test_run_directory_holds_config_metrics_tensorboard_and_weights(tiny_run_config):
    cfg = tiny_run_config("train.steps=3", "logging.tensorboard=true")
    history = train.run(cfg)
    run_dir = Path(cfg.train.output_dir)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines == json.loads(json.dumps(history))
    assert all(REQUIRED_METRICS <= set(m) for m in lines)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "num_experts: 8" in (run_dir / "config.yaml").read_text()
    weights = load_file(run_dir / "model.safetensors")
    assert weights["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 32, 32)


def test_steps_zero_logs_first_batch_loss_without_updating(tiny_run_config, tmp_path):
    cfg = tiny_run_config("train.steps=0")
    history = train.run(cfg)
    assert [m["step"] for m in history] == [0]
    # Nothing was updated: the saved weights are the seeded initialisation.
    saved = load_file(Path(cfg.train.output_dir) / "model.safetensors")
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta"):  # as train.run builds it: meta construction draws no random numbers
        fresh = get_spec("qwen3_moe").model_cls(build_args("qwen3_moe", dict(cfg.model.arch)))
    fresh.to_empty(device="cpu").init_weights()
    for name, tensor in fresh.state_dict().items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0)
    # Step 0 is the loss that step 1 starts from: same init, same first batch.
    first = train.run(tiny_run_config("train.steps=1", f"train.output_dir={tmp_path / 'step1'}"))[0]
    assert history[0]["loss"] == pytest.approx(first["loss"], rel=1e-6)


def test_grad_accumulation_equals_the_larger_batch(tiny_run_config, tmp_path):
    # The aux loss is a product of batch means, so it is defined per global micro-batch: accumulation
    # changes it by design. The cross-entropy part must not change at all.
    no_aux = "model.arch.router_aux_loss_coef=0.0"
    big = train.run(tiny_run_config("train.steps=3", "train.local_batch_size=4", no_aux))
    accum = train.run(tiny_run_config("train.steps=3", "train.local_batch_size=2", "train.grad_accum_steps=2", no_aux,
                                      f"train.output_dir={tmp_path / 'accum'}"))
    assert len(big) == len(accum) == 3
    for a, b in zip(big, accum):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_grad_accumulation_of_equal_micro_batches_equals_the_larger_batch_with_the_router_losses(tiny_run_config,
                                                                                                 tmp_path):
    """With the router aux and z-losses on: where every window is the same, each micro-batch's router statistics are
    the larger batch's, so accumulating 2 x 2 must give the 4-row batch's losses and gradients exactly (each
    micro-batch's router losses count 1 / grad_accum_steps, as its cross-entropy does)."""
    window = np.random.default_rng(0).integers(0, 256, size=33)
    np.save(tmp_path / "same.npy", np.tile(window, 4))  # 4 windows of 33 tokens, all one: one global batch
    same = (f"data.path={tmp_path / 'same.npy'}", "model.arch.router_aux_loss_coef=0.1",
            "model.arch.router_z_loss_coef=0.1")
    big = train.run(tiny_run_config("train.steps=3", "train.local_batch_size=4", *same))
    accum = train.run(tiny_run_config("train.steps=3", "train.local_batch_size=2", "train.grad_accum_steps=2", *same,
                                      f"train.output_dir={tmp_path / 'accum'}"))
    assert len(big) == len(accum) == 3 and big[0]["aux_loss"] > 0 and big[0]["z_loss"] > 0
    for a, b in zip(big, accum):
        for key in ("loss", "aux_loss", "z_loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key


def test_adamw_choice_and_fused_adamw_trains_like_foreach(tiny_run_config, tmp_path):
    from training.config import OptimConfig
    from training.optim import adamw_kind

    assert adamw_kind(OptimConfig(), "cuda") == "project" and adamw_kind(OptimConfig(), "cpu") == "torch_foreach"
    assert adamw_kind(OptimConfig(fused=True), "cuda") == adamw_kind(OptimConfig(fused=True), "cpu") == "torch_fused"
    assert adamw_kind(OptimConfig(fused=False), "cuda") == "torch_foreach"
    assert adamw_kind(OptimConfig(state_dtype="bfloat16"), "cpu") == "project"
    foreach = train.run(tiny_run_config("train.steps=3", "optim.fused=false"))
    fused = train.run(tiny_run_config("train.steps=3", "optim.fused=true", f"train.output_dir={tmp_path / 'fused'}"))
    assert len(foreach) == len(fused) == 3
    for a, b in zip(foreach, fused):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_automatic_gc_is_off_during_the_loop_and_back_after(tiny_run_config, monkeypatch):
    import gc

    collected, seen_enabled = [], []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or 0)
    step = train.train_step
    monkeypatch.setattr(train, "train_step", lambda *a, **k: seen_enabled.append(gc.isenabled()) or step(*a, **k))
    train.run(tiny_run_config("train.steps=5", "train.gc_every=2"))
    assert seen_enabled == [False] * 5 and gc.isenabled()
    assert collected == [2, 1, 1]  # a full collection before the loop, then steps 2 and 4


def test_masked_chats_train_the_same_with_the_lm_head_on_the_trained_rows_only(tmp_path, monkeypatch):
    """data.mask_non_assistant=true: each batch takes its ``trained_rows``, and the run's losses and gradient norms
    are those of the LM head over every row."""
    chats = write_chats(tmp_path / "chats.jsonl")

    def run(name: str) -> list[dict]:
        return train.run(compose_config([
            *TINY_MODEL, f"model.arch.vocab_size={QwenTokenizer().vocab_size}", "data=jsonl", f"data.path={chats}",
            "data.mask_non_assistant=true", "data.seq_len=32", f"data.cache_dir={tmp_path / 'cache'}",
            f"train.output_dir={tmp_path / name}", "train.steps=3", "train.local_batch_size=2",
            "logging.tensorboard=false", "train.device=cpu"]))

    selected, trained_rows = [], training.batch.trained_rows

    def recorded(labels_BT: torch.Tensor, dev: torch.device) -> torch.Tensor | None:
        selected.append(trained_rows(labels_BT, dev))
        return selected[-1]

    monkeypatch.setattr(training.batch, "trained_rows", recorded)
    rows = run("rows")
    assert len(selected) == 3 and all(rows_N is not None for rows_N in selected)
    monkeypatch.setattr(training.batch, "trained_rows", lambda labels_BT, dev: None)
    every = run("every")
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in rows] == pytest.approx([m[key] for m in every], rel=1e-5)


def test_the_first_loss_on_masked_chats_is_the_cross_entropy_over_the_trained_labels(tmp_path):
    """The loss is a mean over the trained labels only (not over the rows labelled -100, most of a masked chat): the
    logged loss of step 0 against F.cross_entropy of the saved initial model over the loader's first batch."""
    chats = write_chats(tmp_path / "chats.jsonl")
    cfg = compose_config([*TINY_MODEL, f"model.arch.vocab_size={QwenTokenizer().vocab_size}", "data=jsonl",
                          f"data.path={chats}", "data.mask_non_assistant=true", "data.seq_len=32",
                          f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path / 'run'}",
                          "train.steps=0", "train.local_batch_size=2", "logging.tensorboard=false", "train.device=cpu"])
    logged = train.run(cfg)[0]["loss"]
    model = get_spec("qwen3_moe").model_cls(build_args("qwen3_moe", dict(cfg.model.arch)))
    model.load_state_dict(load_file(Path(cfg.train.output_dir) / "model.safetensors"))
    batch = next(build_data_loader(cfg.data, seed=cfg.train.seed, local_batch_size=2, dp_rank=0, dp_size=1,
                                   tokenizer=cfg.model.tokenizer, model_vocab_size=QwenTokenizer().vocab_size))
    trained = (batch["labels"] != -100).float().mean().item()
    assert 0.05 < trained < 0.95  # both kinds of rows in the batch
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"]).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    assert logged == pytest.approx(want.item(), rel=1e-5)


def test_unknown_config_key_is_rejected_by_name():
    with pytest.raises(ConfigCompositionException, match="num_expert"):
        compose_config(["model.arch.num_expert=4"])
    cfg = compose_config(["+model.arch.num_expert=4"])  # slips past Hydra (arch is free-form) ...
    with pytest.raises(ValueError, match=r"model.arch has keys \['num_expert'\]"):  # ... but not the family
        train.run(cfg)
    with pytest.raises(ConfigCompositionException, match="stepz"):
        compose_config(["train.stepz=3"])
    with pytest.raises(ValueError, match=r"parallel.backend has unknown keys \['cp_size'\]"):  # Hydra's + adds it
        compose_config(["+parallel.backend.cp_size=2"])


@pytest.mark.parametrize("override, message", [
    ("model.arch.num_experts_per_tok=9", r"model.arch.num_experts_per_tok=9 must be in \[1, model.arch.num_experts=8\]"),
    ("model.arch.num_key_value_heads=3", "model.arch.num_attention_heads=4 must be a multiple of"),
    ("train.local_batch_size=0", "train.local_batch_size=0 must be positive"),
    ("data.seq_len=0", "data.seq_len"),
    ("optim.lr=-1", "optim.lr=-1.0 must be positive"),
])
def test_impossible_sizes_fail_early_naming_the_key(tiny_run_config, override, message):
    with pytest.raises(ValueError, match=message):
        train.run(tiny_run_config(override))


def test_missing_data_file_names_the_key(tiny_run_config, tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path"):
        train.run(tiny_run_config(f"data.path={tmp_path / 'nope.npy'}"))


def test_vocabulary_smaller_than_the_data_is_rejected(tmp_path):
    from tests.conftest import write_tokens
    data = write_tokens(tmp_path / "t.npy", 2000, vocab_size=300)
    cfg = compose_config([*TINY_MODEL, "data=tokens", f"data.path={data}", "data.seq_len=32",
                          f"train.output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path}"])
    with pytest.raises(ValueError, match="model.arch.vocab_size=256"):
        train.run(cfg)


def test_the_readme_command_runs_the_default_config(tmp_path, data_cache_dir):
    """`python train.py` as a user runs it (Hydra CLI, real tokenizer and chitchat corpus), shortened."""
    out = subprocess.run(
        [sys.executable, "train.py", "train.steps=2", "data.seq_len=32", "train.local_batch_size=2",
         f"train.output_dir={tmp_path}", f"data.cache_dir={data_cache_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step     2/2" in out.stdout + out.stderr
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_model_hf_builds_from_config_json_and_loads_the_weights(tiny_run_config, tmp_path, caplog):
    first = train.run(tiny_run_config("train.steps=0"))[0]  # saves its (initial) weights
    from models.hf_io import export_state_dict_hf
    cfg = tiny_run_config("train.steps=0")  # the first run's config: its directory holds the weights
    export_state_dict_hf(load_file(Path(cfg.train.output_dir) / "model.safetensors"), "qwen3_moe",
                         build_args("qwen3_moe", dict(cfg.model.arch)), tmp_path / "hf")
    hf_cfg = dataclasses.replace(cfg, model=compose_config(["model=hf", f"model.init_from={tmp_path / 'hf'}"]).model,
                                 train=dataclasses.replace(cfg.train, output_dir=str(tmp_path / "hf-run")))
    assert train.run(hf_cfg)[0]["loss"] == pytest.approx(first["loss"], rel=1e-6)
    assert "num_experts: 8" in (tmp_path / "hf-run" / "config.yaml").read_text()  # the resolved architecture
    # A named preset with init_from: differences are listed, and weights that cannot fit are an error.
    with pytest.raises(ValueError, match="mis-shaped"):
        train.run(tiny_run_config(f"model.init_from={tmp_path / 'hf'}", "model.arch.moe_intermediate_size=8",
                                  "train.steps=0", f"train.output_dir={tmp_path / 'preset-run'}"))
    assert "moe_intermediate_size: preset 8 vs config.json 16" in caplog.text


@pytest.mark.parametrize("model, mode", [("qwen3_moe_debug", "full"), ("qwen35_moe_debug", "selective")])
def test_activation_checkpointing_from_the_first_forward_of_a_fresh_process(tmp_path, model, mode):
    """In a new process the grouped-GEMM support probe runs inside the first (checkpointed) forward: it must
    not disturb the recomputation."""
    from tests.conftest import write_tokens
    data = write_tokens(tmp_path / "t.npy", 2000)
    out = subprocess.run(
        [sys.executable, "train.py", f"model={model}", "model.arch.vocab_size=256", "data=tokens", f"data.path={data}",
         "data.seq_len=32", "train.steps=2", f"parallel.activation_checkpoint={mode}",
         f"train.output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", "logging.tensorboard=false"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_loop_waits_for_the_device_only_after_a_checkpoint_and_around_a_profile(tiny_run_config, monkeypatch):
    """No device sync at the end of a step (the host logs and fetches the next batch while the device runs the
    optimizer): over 6 steps with a checkpoint every 2 and a profiled window of steps 3-4, the loop waits for the
    device after each checkpoint (steps 2, 4, 6) and at the window's start and end, nowhere else."""
    from core import device

    synced: list[str] = []
    monkeypatch.setattr(device, "synchronize", lambda dev_type: synced.append(dev_type))
    history = train.run(tiny_run_config("train.steps=6", "checkpoint.interval=2", "logging.profile_step=3",
                                        "logging.profile_steps=2"))
    assert [m["step"] for m in history] == [1, 2, 3, 4, 5, 6]
    assert len(synced) == 3 + 2
    assert all(m["step_time_s"] > 0 for m in history)


def test_only_a_step_that_logs_brings_the_routing_summary_to_the_host(tiny_run_config, monkeypatch):
    """The routing summary (an all-reduce under data parallelism, then a copy to the host) is fetched only on the
    steps that log it: the metric line (every logging.log_every steps and the last) and the routing record (every
    logging.routing_every); the metric lines still carry the MoE metrics."""
    fetched: list[int] = []
    reduce = train.reduce_routing
    monkeypatch.setattr(train, "reduce_routing", lambda routing_LX, group: fetched.append(1) or reduce(routing_LX,
                                                                                                     group))
    lines: list[dict] = []
    monkeypatch.setattr(train.MetricLogger, "log", lambda self, metrics: lines.append(metrics))
    train.run(tiny_run_config("train.steps=7", "logging.log_every=3", "logging.routing_every=2"))
    assert [m["step"] for m in lines] == [3, 6, 7]
    assert all("moe/max_imbalance" in m for m in lines)
    assert len(fetched) == len({3, 6, 7} | {2, 4, 6})  # steps 2, 3, 4, 6, 7
