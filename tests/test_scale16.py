"""Sixteen gloo ranks, one launch: ep16 (Qwen3.5-MoE, 16 experts: one per rank) and cp2_ep4_efsdp2 (both
families) train through ``train.run`` like one process: the same loss and grad norm over 3 steps (fp32, rel 1e-4:
the layouts differ only in summation order). The ep16 run checkpoints after step 1; that checkpoint resumes on 8
ranks (ep8: two experts a rank) and on one process onto the same curve. One single-process reference per family
serves every layout: all of them train the same global batch of 16 sequences."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

import train
from models import build_args, get_spec
from models.hf_io import export_hf
from tests.conftest import compose_config, write_tokens
from tests.dist_utils import assert_same_curve, run_distributed

pytestmark = pytest.mark.torch_apis  # FSDP2 / EP / CP layouts on 16 gloo ranks

WORLD, STEPS, SEQ, GLOBAL_BATCH = 16, 3, 32, 16
TINY = {  # per family: the debug preset cut to the synthetic 256-token vocabulary; Qwen3.5 with an expert per rank
    "qwen3_moe": ["model=qwen3_moe_debug", "model.arch.vocab_size=256", "model.arch.hidden_size=32",
                  "model.arch.head_dim=8", "model.arch.moe_intermediate_size=16"],
    "qwen3_5_moe": ["model=qwen35_moe_debug", "model.arch.vocab_size=256", "model.arch.hidden_size=32",
                    "model.arch.moe_intermediate_size=16", "model.arch.shared_expert_intermediate_size=16",
                    f"model.arch.num_experts={WORLD}"],
}
LAYOUTS = {"qwen35-ep16": ("qwen3_5_moe", "ep16"), "qwen35-cp2_ep4_efsdp2": ("qwen3_5_moe", "cp2_ep4_efsdp2"),
           "qwen3-cp2_ep4_efsdp2": ("qwen3_moe", "cp2_ep4_efsdp2")}
SAVED = "qwen35-ep16"  # the run that checkpoints (after step 1) and is resumed on 8 ranks and on one


def config(tmp_path: Path, family: str, parallel: str, run: str, world: int, *overrides: str):
    """3 steps from tmp_path/<family> on tmp_path/tokens.npy, a global batch of GLOBAL_BATCH, clipping active."""
    dp = world // compose_config([f"parallel={parallel}"]).parallel.cp_size
    return compose_config([
        *TINY[family], f"model.init_from={tmp_path / family}", f"parallel={parallel}", "data=tokens",
        f"data.path={tmp_path / 'tokens.npy'}", f"data.seq_len={SEQ}", f"data.cache_dir={tmp_path / 'cache'}",
        f"train.output_dir={tmp_path / run}", f"train.steps={STEPS}", f"train.local_batch_size={GLOBAL_BATCH // dp}",
        "train.save_final=false", "optim.warmup_steps=0", "optim.lr=1e-2", "optim.grad_clip=0.5",
        "logging.tensorboard=false", "train.device=cpu", "train.mixed_precision=fp32", *overrides])


def worker(rank: int, world_size: int, cfgs: dict) -> dict:
    gc.freeze()  # what the rank inherited (the fork server's imports) is kept out of every GC pass: ~4x less GC CPU
    return {name: train.run(cfg) for name, cfg in cfgs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("scale16")
    write_tokens(tmp_path / "tokens.npy", 4096)
    for family in TINY:  # one seeded checkpoint per family that every layout loads
        cfg = config(tmp_path, family, "single", "init", 1)
        args = build_args(cfg.model.model_type, dict(cfg.model.arch))
        model = get_spec(cfg.model.model_type).model_cls(args)
        model.init_weights()
        export_hf(model, cfg.model.model_type, tmp_path / family)
    reference = {family: train.run(config(tmp_path, family, "single", f"single-{family}", 1)) for family in TINY}
    cfgs = {run: config(tmp_path, family, parallel, run, WORLD, *(["checkpoint.interval=1"] if run == SAVED else []))
            for run, (family, parallel) in LAYOUTS.items()}
    # Forked from a server that imported torch once: 16 spawned ranks would each spend ~2.4 s of CPU importing it.
    results = run_distributed(worker, WORLD, cfgs, timeout_s=600)
    saved = f"train.resume={tmp_path / SAVED / 'checkpoints' / 'step_00000001'}"
    resume8 = config(tmp_path, "qwen3_5_moe", "ep8", "resume-8", 8, saved)
    results |= run_distributed(worker, 8, {"resume-8": resume8}, timeout_s=600)
    results["resume-1"] = train.run(config(tmp_path, "qwen3_5_moe", "single", "resume-1", 1, saved))
    return reference, results


@pytest.mark.parametrize("run", list(LAYOUTS))
def test_16_ranks_train_like_one_process(runs, run):
    reference, results = runs
    family = LAYOUTS[run][0]
    assert [m["step"] for m in results[run]] == [1, 2, 3]
    assert_same_curve(results[run], reference[family])
    assert reference[family][0]["grad_norm"] > 0.5  # max_norm 0.5 really clipped


@pytest.mark.parametrize("world", [8, 1])
def test_checkpoint_saved_on_16_ranks_resumes_on_fewer(runs, world):
    reference, results = runs
    assert [m["step"] for m in results[f"resume-{world}"]] == [2, 3]
    assert_same_curve(results[f"resume-{world}"], reference["qwen3_5_moe"])
