"""The kernel registry on CPU: config validation, the choice per device and environment (fake CUDA environments,
a fake torch_npu), and that installing kernels into a model keeps its numerics. The device kernels themselves
are checked on accelerators by ``scripts/check_kernels.py``."""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import models
from kernels import fla
from kernels.config import FLA_OPS, KernelConfig, validate_kernel_config
from kernels.registry import OPS, Env, apply_kernels, select_kernels
from models.layers import rotate_half

ROOT = Path(__file__).resolve().parents[1]
AUTO_OPS = [op for op in OPS if op not in FLA_OPS]
HOPPER_TRITON_36 = Env("cuda", triton_version="3.6.0", capability=(9, 0), fla_version="0.6.0")
QWEN35 = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=12, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=16, shared_expert_intermediate_size=24)
QWEN3 = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _model(model_type: str, arch: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    model = models.get_spec(model_type).model_cls(models.build_args(model_type, arch))
    model.init_weights()
    with torch.no_grad():  # norm weights away from their init, so a misapplied weight or offset shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _logits_and_grads(model: torch.nn.Module, T: int = 40) -> list[torch.Tensor]:
    input_ids = torch.randint(0, 96, (2, T), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids).logits
    logits.square().mean().backward()
    return [logits.detach(), *(p.grad for p in model.parameters())]


# --- config -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["auto", "flash-linear-attention", "auto,flash-linear-attention",
                                  "flash-linear-attention, auto"])
def test_valid_names(name: str) -> None:
    validate_kernel_config(KernelConfig(name=name))


@pytest.mark.parametrize("cfg, match", [
    (KernelConfig(chunk_size=48), r"kernel_config\.chunk_size=48 must be one of 16, 32, 64"),
    (KernelConfig(name="liger"), r"kernel_config\.name='liger'.*auto, flash-linear-attention"),
    (KernelConfig(name="auto,auto"), r"kernel_config\.name='auto,auto'.*each once"),
    (KernelConfig(include_kernels=["chunk_delta"]), r"kernel_config\.include_kernels has \['chunk_delta'\]; valid: "
                                                    "chunk_gated_delta_rule, fused_recurrent_gated_delta_rule"),
    (KernelConfig(name="flash-linear-attention", include_kernels=[]), r"kernel_config\.include_kernels is empty"),
])
def test_invalid_configs_name_the_key(cfg: KernelConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_kernel_config(cfg)


@pytest.mark.parametrize("preset, name", [("auto", "auto"), ("flash_linear_attention", "flash-linear-attention"),
                                          ("auto_fla", "auto,flash-linear-attention")])
def test_presets_are_valid(preset: str, name: str) -> None:
    merged = OmegaConf.merge(OmegaConf.structured(KernelConfig),
                             OmegaConf.load(ROOT / "conf" / "kernel_config" / f"{preset}.yaml"))
    cfg = OmegaConf.to_object(merged)
    validate_kernel_config(cfg)
    assert cfg.name == name and cfg.chunk_size == 64 and cfg.include_kernels == list(FLA_OPS)


# --- selection ----------------------------------------------------------------------------------------------------

def test_cpu_gets_the_torch_references() -> None:
    kernels = select_kernels(KernelConfig(name="auto"), "cpu", Env("cpu"))
    assert {c.impl for c in kernels.choices.values()} == {"torch"}
    assert not any(c.fallback for c in kernels.choices.values())  # auto on cpu: the reference is the answer
    # An explicit FLA request on cpu falls back, and says so.
    kernels = select_kernels(KernelConfig(name="flash-linear-attention"), "cpu", Env("cpu"))
    assert all(kernels.choices[op].fallback and kernels.choices[op].impl == "torch" for op in FLA_OPS)


def test_hopper_with_bad_triton_falls_back_to_torch_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    kernels = select_kernels(KernelConfig(name="auto,flash-linear-attention"), "cuda", HOPPER_TRITON_36)
    chunk = kernels.choices["chunk_gated_delta_rule"]
    assert chunk.impl == "torch" and chunk.fallback
    assert "#640" in chunk.reason and "3.7.1" in chunk.reason and "triton 3.6.0" in chunk.reason
    # The recurrent kernel (forward only) is not affected; the auto ops get Triton kernels.
    assert kernels.choices["fused_recurrent_gated_delta_rule"].impl == "flash-linear-attention"
    assert {kernels.choices[op].impl for op in ("rms_norm", "offset_rms_norm", "gated_rms_norm", "swiglu",
                                                "packed_swiglu", "apply_rotary", "softmax_cross_entropy")} \
        == {"triton"}
    with caplog.at_level(logging.INFO):
        kernels.log(logging.getLogger("train"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "chunk_gated_delta_rule: torch (fallback)" in warnings[0]


@pytest.mark.parametrize("triton_version, capability, broken", [
    ("3.6.0", (9, 0), True), ("3.4.0", (9, 0), True), ("3.7.0", (9, 0), True),
    ("3.7.1", (9, 0), False), ("3.8.0+git1234", (9, 0), False), ("3.3.1", (9, 0), False),
    ("3.6.0", (8, 0), False), ("3.6.0", (10, 0), False), (None, (9, 0), False), ("3.6.0", None, False),
])
def test_chunk_backward_bug_condition(triton_version, capability, broken: bool) -> None:
    assert (fla.chunk_backward_broken(triton_version, capability) is not None) == broken
    env = Env("cuda", triton_version=triton_version, capability=capability, fla_version="0.6.0")
    chosen = select_kernels(KernelConfig(name="flash-linear-attention"), "cuda", env).choices
    assert chosen["chunk_gated_delta_rule"].impl == ("torch" if broken else "flash-linear-attention")


def test_fla_missing_names_the_pip_extra() -> None:
    env = Env("cuda", triton_version="3.7.1", capability=(9, 0), fla_version=None)
    with pytest.raises(ImportError, match=r"pip install '\.\[gpu\]'"):
        select_kernels(KernelConfig(name="auto,flash-linear-attention"), "cuda", env)
    select_kernels(KernelConfig(name="auto"), "cuda", env)  # not requested: no error


def test_only_the_included_fla_kernels_are_installed() -> None:
    env = Env("cuda", triton_version="3.7.1", capability=(9, 0), fla_version="0.6.0")
    cfg = KernelConfig(name="flash-linear-attention", include_kernels=["fused_recurrent_gated_delta_rule"])
    chosen = select_kernels(cfg, "cuda", env).choices
    assert chosen["fused_recurrent_gated_delta_rule"].impl == "flash-linear-attention"
    assert chosen["chunk_gated_delta_rule"].impl == "torch" and not chosen["chunk_gated_delta_rule"].fallback
    assert all(chosen[op].impl == "torch" for op in AUTO_OPS)  # auto not requested


def test_cuda_without_triton_uses_torch() -> None:
    chosen = select_kernels(KernelConfig(), "cuda", Env("cuda", capability=(9, 0))).choices
    assert chosen["rms_norm"].impl == "torch" and "triton is not installed" in chosen["rms_norm"].reason


def test_unknown_device_type() -> None:
    with pytest.raises(ValueError, match="'xpu' is not one of cpu, cuda, npu"):
        select_kernels(KernelConfig(), "xpu", Env("xpu"))


def test_importing_the_registry_loads_no_device_package() -> None:
    code = "import sys, kernels.registry; print(sorted({'fla', 'triton', 'torch_npu'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- applying kernels ---------------------------------------------------------------------------------------------

def test_every_op_has_a_slot_and_every_slot_an_op() -> None:
    slots = {op for model in (_model("qwen3_5_moe", QWEN35), _model("qwen3_moe", QWEN3))
             for module in model.modules() for op in getattr(module, "kernel_slots", {}).values()}
    assert slots == set(OPS)


@pytest.mark.parametrize("model_type, arch", [("qwen3_5_moe", QWEN35), ("qwen3_moe", QWEN3)])
def test_torch_references_equal_the_models_built_in_ops(model_type: str, arch: dict) -> None:
    model = _model(model_type, arch)
    applied = copy.deepcopy(model)
    counts = apply_kernels(applied, select_kernels(KernelConfig(name="auto,flash-linear-attention"), "cpu",
                                                   Env("cpu")))
    if model_type == "qwen3_moe":
        # per layer: input, post-attention, q and k norms; final norm; rotary per attention; the experts'
        # activation; the LM head's CE
        assert counts == {"rms_norm": 2 * 4 + 1, "apply_rotary": 2, "packed_swiglu": 2, "softmax_cross_entropy": 1}
    else:
        assert counts["chunk_gated_delta_rule"] == 2 and counts["gated_rms_norm"] == 2 and counts["swiglu"] == 4
    for a, b in zip(_logits_and_grads(model), _logits_and_grads(applied)):
        assert torch.equal(a, b)


def test_short_evaluation_takes_the_recurrent_slot() -> None:
    model = _model("qwen3_5_moe", QWEN35)
    calls = []
    for module in model.modules():
        if hasattr(module, "recurrent_delta_rule"):
            rule = module.recurrent_delta_rule
            module.recurrent_delta_rule = lambda *a, rule=rule, **k: calls.append(1) or rule(*a, **k)
    input_ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    chunked = model(input_ids).logits.detach()  # training mode: the chunked rule
    assert not calls
    model.eval()
    with torch.no_grad():
        recurrent = model(input_ids).logits
    assert len(calls) == 2  # both DeltaNet layers
    # The two exact forms of one recurrence: fp32 reordering only (1e-5 as in test_delta_rule.py).
    torch.testing.assert_close(recurrent, chunked, rtol=0, atol=1e-5)


class FakeTorchNpu(types.ModuleType):
    """torch_npu's fused ops as documented, in torch, counting calls."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def npu_rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
        self._count("npu_rms_norm")
        assert gamma.dtype == x.dtype  # torch_npu's constraint
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
        return (x.float() * rstd * gamma.float()).to(x.dtype), rstd

    def npu_swiglu(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self._count("npu_swiglu")
        a, b = x.chunk(2, dim=dim)
        return F.silu(a) * b

    def npu_rotary_mul(self, x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
        self._count("npu_rotary_mul")
        assert x.dim() == r1.dim() == r2.dim() == 4 and x.dtype == r1.dtype
        return r1 * x + r2 * rotate_half(x)


@pytest.fixture
def fake_torch_npu(monkeypatch: pytest.MonkeyPatch) -> FakeTorchNpu:
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.delitem(sys.modules, "kernels.npu", raising=False)  # re-imported against the fake
    return fake


@pytest.mark.parametrize("model_type, arch, ops", [
    ("qwen3_5_moe", QWEN35, {"npu_rms_norm": 2 * 4 + 2 * 2 + 1 + 2, "npu_swiglu": 4 + 4, "npu_rotary_mul": 2 * 2}),
    ("qwen3_moe", QWEN3, {"npu_rms_norm": 2 * 4 + 1, "npu_rotary_mul": 2 * 2, "npu_swiglu": 2}),
])
def test_npu_gets_torch_npu_ops(fake_torch_npu: FakeTorchNpu, model_type: str, arch: dict, ops: dict) -> None:
    kernels = select_kernels(KernelConfig(name="auto"), "npu", Env("npu", has_torch_npu=True))
    # Every auto op but the LM head's cross-entropy step (Triton on CUDA only) has a torch_npu kernel.
    assert {kernels.choices[op].impl for op in AUTO_OPS if op != "softmax_cross_entropy"} == {"torch_npu"}
    assert kernels.choices["softmax_cross_entropy"].impl == "torch"
    model = _model(model_type, arch)
    applied = copy.deepcopy(model)
    apply_kernels(applied, kernels)
    input_ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    ref, got = model(input_ids).logits, applied(input_ids).logits
    assert fake_torch_npu.calls == ops  # per forward: every norm, shared and routed experts, q and k rotary
    # fp32: the wrappers compute what the references do, up to reordering.
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_npu_without_torch_npu_uses_torch() -> None:
    chosen = select_kernels(KernelConfig(), "npu", Env("npu", has_torch_npu=False)).choices
    assert chosen["rms_norm"].impl == "torch" and "pip install '.[npu]'" in chosen["rms_norm"].reason


def test_check_kernels_has_nothing_to_check_on_cpu() -> None:
    out = subprocess.run([sys.executable, "scripts/check_kernels.py", "--device", "cpu"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0 and "nothing to check" in out.stdout
