"""The same end-to-end parity on 2 GPUs over NCCL (skipped without them): fp32 layouts match one GPU, and
bf16 mixed precision (FSDP2's policy; autocast under DDP) with selective checkpointing stays close to fp32."""

from __future__ import annotations

import math

import pytest
import torch

import train
from tests.dist_utils import run_distributed
from tests.test_parallel_train import train_config, train_worker, write_inputs

pytestmark = [pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"), pytest.mark.torch_apis]
WORLD, LOCAL_BATCH = 2, 2
FP32 = ["ddp", "fsdp2", "ep2", "hsdp"]
BF16 = {"ep2_bf16": "ep2", "ddp_bf16": "ddp"}


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("parallel_gpu")
    single = train_config(tmp_path, "single", LOCAL_BATCH * WORLD, device="cuda")
    write_inputs(tmp_path, dict(single.model.arch))
    reference = train.run(single)
    cfgs = {p: train_config(tmp_path, p, LOCAL_BATCH, device="cuda") for p in FP32}
    cfgs.update({run: train_config(tmp_path, p, LOCAL_BATCH, "parallel.activation_checkpoint=selective", run=run,
                                   device="cuda", mixed_precision="bf16") for run, p in BF16.items()})
    return reference, run_distributed(train_worker, WORLD, cfgs, backend="nccl", fork_server=False)


@pytest.mark.parametrize("preset", FP32)
def test_fp32_layout_on_gpus_matches_one_gpu(gpu_runs, preset):
    reference, results = gpu_runs
    assert [m["step"] for m in results[preset]] == [m["step"] for m in reference] == [1, 2, 3]
    for g, w in zip(results[preset], reference):
        # GPU kernels reduce in other orders than the CPU's: a looser bound than the gloo tests.
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-3), f"step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3), f"step {g['step']}"


@pytest.mark.parametrize("run", sorted(BF16))
def test_bf16_with_selective_checkpointing_stays_close_to_fp32(gpu_runs, run):
    reference, results = gpu_runs
    assert [m["step"] for m in results[run]] == [m["step"] for m in reference] == [1, 2, 3]
    for g, w in zip(results[run], reference):
        assert math.isfinite(g["loss"]) and g["loss"] == pytest.approx(w["loss"], rel=3e-2), f"step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=0.2), f"step {g['step']}"
