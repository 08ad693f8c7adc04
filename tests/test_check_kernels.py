"""scripts/check_kernels.py's selection, on CPU: the default run (the quickstart's check) covers every implementation
of every op that --full covers, on awkward shapes, so that making it quicker cannot silently drop a kernel. The
checks themselves run on accelerators only."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.config import FLA_OPS, KernelConfig
from kernels.registry import OPS
from scripts import check_kernels

ROOT = Path(__file__).resolve().parents[1]
CFG = KernelConfig(name="auto,flash-linear-attention", include_kernels=list(FLA_OPS))  # kernel_config=auto_fla
ENVS = {  # between them, every implementation in the registry can run
    "h100": check_kernels.ASSUMED_CUDA,
    "h100, triton of FLA #640": dataclasses.replace(check_kernels.ASSUMED_CUDA, triton_version="3.6.0"),
    "npu": dataclasses.replace(check_kernels.ASSUMED_CUDA, device_type="npu", capability=None, has_torch_npu=True,
                               cudnn_frontend_version=None, cudnn_version=None),
}
# The kernels that take fp32 as train.mixed_precision=fp32 hands it to them: checked in fp32 too by default.
FP32_OPS = ("rms_norm", "offset_rms_norm", "gated_rms_norm", "swiglu", "packed_swiglu", "apply_rotary",
            "softmax_cross_entropy", "gather_sum", "unpermute_backward", "adamw_step")
PACKED_OPS = ("chunk_gated_delta_rule", "causal_conv1d_silu", "document_attention")  # documents: cu_seqlens / ids


def _pairs(checks: list[check_kernels.Check]) -> set[tuple[str, str]]:
    return {(check.op, check.impl) for check in checks}


def _names(checks: list[check_kernels.Check]) -> set[tuple[str, str, str]]:
    return {(check.op, check.impl, check.case.name) for check in checks}


@pytest.mark.parametrize("cfg", [CFG, KernelConfig(name="auto")], ids=["auto,fla", "auto"])
@pytest.mark.parametrize("env", ENVS.values(), ids=ENVS)
def test_default_covers_every_op_and_implementation_of_full(env, cfg: KernelConfig) -> None:
    default, skipped = check_kernels.plan(cfg, env)
    full, skipped_full = check_kernels.plan(cfg, env, full=True)
    assert _pairs(default) == _pairs(full) and skipped == skipped_full
    assert _names(default) < _names(full)  # a strict subset: --full adds the model shapes
    assert len(_names(default)) == len(default)  # no check twice


def test_every_registry_kernel_is_checked_by_default() -> None:
    checked = set().union(*(_pairs(check_kernels.plan(CFG, env)[0]) for env in ENVS.values()))
    assert checked == {(op, impl.name) for op, spec in OPS.items() for impl in spec.kernels}
    assert set(check_kernels.CASES) == set(OPS)


def test_plan_follows_the_kernel_config() -> None:
    env = check_kernels.ASSUMED_CUDA
    fla = {op for op, impl in _pairs(check_kernels.plan(CFG, env)[0]) if impl.startswith("flash-linear-attention")}
    assert fla == set(FLA_OPS)
    # kernel_config without FLA: none of its kernels; DeltaNet's convolution is ours
    pairs = _pairs(check_kernels.plan(KernelConfig(name="auto"), env)[0])
    assert not any(impl.startswith("flash-linear-attention") for _, impl in pairs)
    assert ("causal_conv1d_silu", "triton") in pairs
    assert {op for op, _ in _pairs(check_kernels.plan(CFG, env, only=frozenset({"rms_norm"}))[0])} == {"rms_norm"}
    # on Hopper with the Tritons of FLA #640 the chunked rule is checked in the registry's #640-safe form
    env_640 = ENVS["h100, triton of FLA #640"]
    checks, skipped = check_kernels.plan(CFG, env_640, only=frozenset({"chunk_gated_delta_rule"}))
    assert {check.impl for check in checks} == {check_kernels.OPS["chunk_gated_delta_rule"].kernels[1].name}
    assert len(skipped) == 1 and "FLA #640" in skipped[0]


def _narrowest(inputs: dict[str, torch.Tensor]) -> torch.dtype:
    return min((t.dtype for t in inputs.values() if t.is_floating_point()), key=lambda d: torch.finfo(d).bits)


def test_default_cases_are_small_and_awkward() -> None:
    """Built on CPU: bf16 for every op, fp32 where the kernel takes it, a size that is no power of two, packed
    documents where the kernel takes them, and small enough for a quick run (the largest input 50M elements:
    the experts' weights)."""
    gen, cpu = torch.Generator().manual_seed(0), torch.device("cpu")
    for op, cases in check_kernels.CASES.items():
        built = [case.make(gen, cpu) for case in cases if case.default]
        assert built, op
        dtypes = {_narrowest(inputs) for inputs in built}
        assert dtypes == ({torch.bfloat16, torch.float32} if op in FP32_OPS else {torch.bfloat16}), op
        assert all(any(n & (n - 1) for t in inputs.values() for n in t.shape) for inputs in built), op
        if op in PACKED_OPS:
            assert any({"cu_seqlens", "ids"} & set(inputs) for inputs in built), op
        assert max(t.numel() for inputs in built for t in inputs.values()) <= 16 * 1536 * 2048, op


@pytest.mark.parametrize("kernels", [None, CFG.name])
def test_list_prints_the_default_plan(kernels) -> None:
    """Without --kernels: the training default's (kernel_config=auto) kernels; with FLA's plugin: FLA's as well."""
    out = subprocess.run([sys.executable, "scripts/check_kernels.py", "--list",
                          *([f"--kernels={kernels}"] if kernels else [])], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    default = check_kernels.plan(CFG if kernels else KernelConfig(name="auto", include_kernels=list(FLA_OPS)),
                                 check_kernels.ASSUMED_CUDA)[0]
    assert lines[0].startswith("# default checks on cuda (sm_90)") and lines[-1] == f"# {len(default)} checks"
    assert [line.split()[0] for line in lines if not line.startswith("#")] == [check.op for check in default]
