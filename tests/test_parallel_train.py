"""End to end through ``train.run``: every 4-rank preset loads the same Hugging Face weights, trains 3 steps on
the same token file and logs the loss and grad norm of the single-process run (fp32, rel 1e-4: the layouts
differ only in summation order). One EP layout also trains on chat data with only the assistant tokens trained,
where the dp ranks hold different numbers of trained tokens: the loss is normalised by the global count. With the
research knobs on (aux-loss-free balancing biases, router z-loss, held-out validation), EP and CP layouts log the
single process's losses and validation losses and end with its biases. Round-robin routing (the benchmarks'
``--routing balanced``) trains alike in EP and CP layouts too: it goes by a token's position in the rows a rank
holds, which a cp rank's half of a row repeats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train
from models import build_args, get_spec
from models.hf_io import export_hf
from tests.conftest import TINY_MODEL, compose_config, trained_tokens_per_rank, write_chats, write_tokens
from tests.dist_utils import run_distributed, seeded_weights
from training.data.tokenizer import QwenTokenizer

pytestmark = pytest.mark.torch_apis  # FSDP2 / EP layouts on gloo ranks

WORLD, LOCAL_BATCH = 4, 2
PRESETS = ["ddp", "fsdp2", "hsdp", "ep2", "ep4", "ep2_edp2"]
CHATS = "ep2"  # the layout (dp 4) that also trains on masked chats
KNOBS = ["model.arch.router_bias_update_rate=0.01", "model.arch.router_z_loss_coef=0.01", "data.val_fraction=0.3",
         "train.eval_every=1", "train.eval_batches=1", "train.save_final=true"]
KNOB_LAYOUTS = {"ep2": LOCAL_BATCH, "cp2": 2 * LOCAL_BATCH}  # the local batch of the reference's global batch
BALANCED = ["model.arch.router_force_balance=true"]


def train_config(tmp_path: Path, parallel: str, local_batch: int, *overrides: str, run: str | None = None,
                 device: str = "cpu", mixed_precision: str = "fp32", chats: bool = False):
    """3 steps of the tiny model from tmp_path/hf on tmp_path/tokens.npy, with clipping active. chats: from
    tmp_path/chats-hf (the tokenizer's vocabulary) on tmp_path/chats.jsonl, training only the assistant tokens."""
    if chats:
        model = [f"model.arch.vocab_size={QwenTokenizer().vocab_size}", f"model.init_from={tmp_path / 'chats-hf'}"]
        data = ["data=jsonl", f"data.path={tmp_path / 'chats.jsonl'}", "data.mask_non_assistant=true"]
    else:
        model = [f"model.init_from={tmp_path / 'hf'}"]
        data = ["data=tokens", f"data.path={tmp_path / 'tokens.npy'}"]
    return compose_config([
        *TINY_MODEL, *model, f"parallel={parallel}", *data, "data.seq_len=16", f"data.cache_dir={tmp_path / 'cache'}",
        f"train.output_dir={tmp_path / (run or parallel)}",
        "train.steps=3", f"train.local_batch_size={local_batch}", "train.save_final=false", "optim.warmup_steps=0",
        "optim.lr=1e-2", "optim.grad_clip=0.5", "logging.tensorboard=false", f"train.device={device}",
        f"train.mixed_precision={mixed_precision}", *overrides,
    ])


def write_inputs(tmp_path: Path, arch: dict, chats: bool = False) -> None:
    """The token file (chats: the chat file) and the Hugging Face checkpoint of a seeded model that every run
    starts from."""
    if chats:
        write_chats(tmp_path / "chats.jsonl")
    else:
        write_tokens(tmp_path / "tokens.npy", 4096)
    args = build_args("qwen3_moe", arch)
    model = get_spec("qwen3_moe").model_cls(args)
    model.load_state_dict(seeded_weights(args))
    export_hf(model, "qwen3_moe", tmp_path / ("chats-hf" if chats else "hf"))


def train_worker(rank: int, world_size: int, cfgs: dict) -> dict:
    return {name: train.run(cfg) for name, cfg in cfgs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("parallel_train")
    single = train_config(tmp_path, "single", LOCAL_BATCH * WORLD)
    write_inputs(tmp_path, dict(single.model.arch))
    single_chats = train_config(tmp_path, "single", LOCAL_BATCH * WORLD, run="single-chats", chats=True)
    write_inputs(tmp_path, dict(single_chats.model.arch), chats=True)
    single_knobs = train_config(tmp_path, "single", LOCAL_BATCH * WORLD, *KNOBS, run="single-knobs", chats=True)
    single_balanced = train_config(tmp_path, "single", LOCAL_BATCH * WORLD, *BALANCED, run="single-balanced")
    reference = {"tokens": train.run(single), "chats": train.run(single_chats), "knobs": train.run(single_knobs),
                 "balanced": train.run(single_balanced)}
    cfgs = {p: train_config(tmp_path, p, LOCAL_BATCH) for p in PRESETS}
    cfgs[f"{CHATS}-chats"] = train_config(tmp_path, CHATS, LOCAL_BATCH, run=f"{CHATS}-chats", chats=True)
    for layout, local_batch in KNOB_LAYOUTS.items():
        cfgs[f"{layout}-knobs"] = train_config(tmp_path, layout, local_batch, *KNOBS, run=f"{layout}-knobs",
                                               chats=True)
        cfgs[f"{layout}-balanced"] = train_config(tmp_path, layout, local_batch, *BALANCED, run=f"{layout}-balanced")
    return reference, run_distributed(train_worker, WORLD, cfgs), cfgs


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_trains_like_one_process(runs, preset):
    """Loss and grad norm of each step against the single-process run on the whole global batch."""
    references, results, _ = runs
    got, reference = results[preset], references["tokens"]
    assert [m["step"] for m in got] == [m["step"] for m in reference] == [1, 2, 3]
    for g, w in zip(got, reference):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4), f"step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), f"step {g['step']}"
    assert reference[0]["grad_norm"] > 0.5  # max_norm 0.5 really clipped


def test_masked_chats_with_unequal_token_counts_train_like_one_process(runs):
    """ep2 (dp 4) on chats with only assistant tokens trained against the single-process run: each rank's loss
    share is normalised by the global count of trained tokens, which differs from dp x its own count here."""
    references, results, cfgs = runs
    counts = [c for [c] in trained_tokens_per_rank(cfgs[f"{CHATS}-chats"], dp=WORLD)]
    assert len(set(counts)) > 1, counts  # the ranks really train different numbers of tokens
    got, want = results[f"{CHATS}-chats"], references["chats"]
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4), f"step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), f"step {g['step']}"
    assert want[0]["grad_norm"] > 0.5  # max_norm 0.5 really clipped


@pytest.mark.parametrize("layout", list(KNOB_LAYOUTS))
def test_router_knobs_and_validation_are_the_same_in_every_layout(runs, layout):
    """Losses (with the z-loss's gradient in them), validation losses and the final balancing biases against the
    single-process run: the biases move by the global expert loads, the validation batches are cut like training's."""
    references, results, cfgs = runs
    got, want = results[f"{layout}-knobs"], references["knobs"]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "grad_norm", "z_loss", "val_loss"):
            assert g[key] == pytest.approx(w[key], rel=1e-4), f"step {g['step']} {key}"
    run_dir = Path(cfgs[f"{layout}-knobs"].train.output_dir)
    biases = [{k: v for k, v in load_file(d / "model.safetensors").items() if k.endswith("expert_bias")}
              for d in (run_dir, run_dir.parent / "single-knobs")]
    assert sorted(biases[0]) == sorted(biases[1]) and len(biases[0]) == 2
    assert any(t.abs().sum() > 0 for t in biases[1].values())  # the biases really moved
    for name, bias in biases[0].items():
        torch.testing.assert_close(bias, biases[1][name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", list(KNOB_LAYOUTS))
def test_round_robin_routing_trains_alike_in_every_layout(runs, layout):
    """Loss and grad norm with ``model.arch.router_force_balance`` against the single-process run, and the
    routing really changed the run (its losses are not the learned router's)."""
    references, results, _ = runs
    got, want = results[f"{layout}-balanced"], references["balanced"]
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4), f"step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), f"step {g['step']}"
    assert want[-1]["loss"] != pytest.approx(references["tokens"][-1]["loss"], rel=1e-3)
