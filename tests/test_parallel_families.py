"""Eight gloo ranks, one spawn: Qwen3.5-MoE under ep2 and ep4_efsdp2 (and with its MTP head trained, under ep2),
a checkpoint saved under ep4_efsdp2 resumed under ep2 and under fsdp2, and Qwen3.5 with its vision tower trained on
windows with images (tests/vision_data.py: some rows with an image of one of four sizes, some without, so that some
ranks' micro-batches hold none and run the tower's dummy) under EP with expert FSDP, HSDP (the tower frozen) and CP +
EP (every cp rank runs the window's images, each keeps its shard's tokens; images cross the cp shards), each against
the single-process run (fp32, rel 1e-4)."""

from __future__ import annotations

from pathlib import Path

import pytest

import train
from models import build_args, get_spec
from models.hf_io import export_hf
from tests.conftest import compose_config, write_tokens
from tests.dist_utils import assert_same_curve, run_distributed
from tests.vision_data import images_in_token_data, vision_overrides
from training.startup import resolve_model

pytestmark = pytest.mark.torch_apis  # FSDP2 / EP / CP layouts on gloo ranks

WORLD = 8
TINY = {  # per family: a tiny architecture on the synthetic 256-token vocabulary
    "qwen3_moe": ["model=qwen3_moe_debug", "model.arch.vocab_size=256", "model.arch.hidden_size=32",
                  "model.arch.head_dim=8", "model.arch.moe_intermediate_size=16"],
    "qwen3_5_moe": ["model=qwen35_moe_debug", "model.arch.vocab_size=256", "model.arch.hidden_size=32",
                    "model.arch.moe_intermediate_size=16", "model.arch.shared_expert_intermediate_size=16"],
}


MTP = ["model.arch.mtp_loss_weight=0.3"]  # from a checkpoint with the head (<family>-mtp), trained
VISION = vision_overrides()  # from a checkpoint with the tower (<family>-vision), trained
# EP with expert FSDP (ep2 on 8 ranks: efsdp 4), HSDP with the tower frozen, CP with EP and expert FSDP
VISION_LAYOUTS = {"ep2": [], "hsdp": ["model.freeze_vision=true"], "cp2_ep2_efsdp2": []}


def config(tmp_path: Path, family: str, parallel: str, run: str, *overrides: str, steps: int = 4):
    cp = compose_config([f"parallel={parallel}"]).parallel.cp_size
    local_batch = 8 if parallel == "single" else cp  # the same global batch of 8 sequences
    source = tmp_path / (f"{family}-mtp" if MTP[0] in overrides else f"{family}-vision" if VISION[0] in overrides
                         else family)
    return compose_config([
        *TINY[family], f"model.init_from={source}", f"parallel={parallel}", "data=tokens",
        f"data.path={tmp_path / 'tokens.npy'}", "data.seq_len=16", f"data.cache_dir={tmp_path / 'cache'}",
        f"train.output_dir={tmp_path / run}", f"train.steps={steps}", f"train.local_batch_size={local_batch}",
        "train.save_final=false", "optim.warmup_steps=0", "optim.lr=1e-2", "logging.tensorboard=false",
        "train.device=cpu", "train.mixed_precision=fp32", *overrides])


def worker(rank: int, world_size: int, cfgs: dict, vision_cfgs: dict) -> dict:
    results = {name: train.run(cfg) for name, cfg in cfgs.items()}  # in order: the resumes follow the save
    for name, cfg in vision_cfgs.items():
        with images_in_token_data(resolve_model(cfg)[1].vision_config):
            results[name] = train.run(cfg)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("families")
    write_tokens(tmp_path / "tokens.npy", 4096)
    for family in TINY:  # one seeded checkpoint per family that every layout loads
        cfg = config(tmp_path, family, "single", "init")
        args = build_args(cfg.model.model_type, dict(cfg.model.arch))
        model = get_spec(cfg.model.model_type).model_cls(args)
        model.init_weights()
        export_hf(model, cfg.model.model_type, tmp_path / family)
    cfg = config(tmp_path, "qwen3_5_moe", "single", "init", *MTP)
    model = get_spec(cfg.model.model_type).model_cls(build_args(cfg.model.model_type, dict(cfg.model.arch)))
    model.init_weights()
    export_hf(model, cfg.model.model_type, tmp_path / "qwen3_5_moe-mtp")
    cfg = config(tmp_path, "qwen3_5_moe", "single", "init", *VISION)
    model = get_spec(cfg.model.model_type).model_cls(build_args(cfg.model.model_type, dict(cfg.model.arch), True))
    model.init_weights()
    export_hf(model, cfg.model.model_type, tmp_path / "qwen3_5_moe-vision")  # the multimodal layout
    reference = {family: train.run(config(tmp_path, family, "single", f"single-{family}")) for family in TINY}
    reference["qwen3_5_moe-mtp"] = train.run(config(tmp_path, "qwen3_5_moe", "single", "single-mtp", *MTP))
    for frozen in ([], ["model.freeze_vision=true"]):
        cfg = config(tmp_path, "qwen3_5_moe", "single", f"single-vision{len(frozen)}", *VISION, *frozen, steps=3)
        with images_in_token_data(resolve_model(cfg)[1].vision_config):
            reference[f"qwen3_5_moe-vision{len(frozen)}"] = train.run(cfg)
    saved = tmp_path / "ep4_efsdp2-ckpt" / "checkpoints" / "step_00000002"
    parallel = {
        "qwen35-ep2": config(tmp_path, "qwen3_5_moe", "ep2", "qwen35-ep2"),
        "qwen35-ep4_efsdp2": config(tmp_path, "qwen3_5_moe", "ep4_efsdp2", "qwen35-ep4_efsdp2"),
        "qwen35-mtp-ep2": config(tmp_path, "qwen3_5_moe", "ep2", "qwen35-mtp-ep2", *MTP),
        "save-ep4_efsdp2": config(tmp_path, "qwen3_moe", "ep4_efsdp2", "ep4_efsdp2-ckpt", "checkpoint.interval=2"),
        "resume-ep2": config(tmp_path, "qwen3_moe", "ep2", "resume-ep2", f"train.resume={saved}"),
        "resume-fsdp2": config(tmp_path, "qwen3_moe", "fsdp2", "resume-fsdp2", f"train.resume={saved}"),
    }
    vision = {f"vision-{layout}": config(tmp_path, "qwen3_5_moe", layout, f"vision-{layout}", *VISION, *extra, steps=3)
              for layout, extra in VISION_LAYOUTS.items()}
    return reference, run_distributed(worker, WORLD, parallel, vision, timeout_s=900)


@pytest.mark.parametrize("preset", ["ep2", "ep4_efsdp2"])
def test_qwen35_trains_like_one_process(runs, preset):
    reference, results = runs
    assert [m["step"] for m in results[f"qwen35-{preset}"]] == [1, 2, 3, 4]
    assert_same_curve(results[f"qwen35-{preset}"], reference["qwen3_5_moe"])


def test_qwen35_mtp_head_trains_like_one_process_under_ep(runs):
    reference, results = runs
    got, want = results["qwen35-mtp-ep2"], reference["qwen3_5_moe-mtp"]
    assert_same_curve(got, want)
    assert [g["mtp_loss"] == pytest.approx(w["mtp_loss"], rel=1e-4) for g, w in zip(got, want)] == [True] * 4


@pytest.mark.parametrize("layout", ["ep2", "fsdp2"])
def test_checkpoint_from_ep4_efsdp2_resumes_in_another_layout(runs, layout):
    reference, results = runs
    assert_same_curve(results["save-ep4_efsdp2"], reference["qwen3_moe"])
    assert [m["step"] for m in results[f"resume-{layout}"]] == [3, 4]
    assert_same_curve(results[f"resume-{layout}"], reference["qwen3_moe"])


@pytest.mark.parametrize("layout", VISION_LAYOUTS)
def test_qwen35_with_its_vision_tower_trains_like_one_process(runs, layout):
    reference, results = runs
    assert [m["step"] for m in results[f"vision-{layout}"]] == [1, 2, 3]
    assert_same_curve(results[f"vision-{layout}"], reference[f"qwen3_5_moe-vision{len(VISION_LAYOUTS[layout])}"])
