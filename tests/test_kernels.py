"""The kernel registry on CPU: config validation, the choice per device and environment (fake CUDA environments,
a fake torch_npu), for the models' kernel slots and the dispatch path's kernel functions alike, and that installing
kernels into a model keeps its numerics. The device kernels themselves are checked on accelerators by
``scripts/check_kernels.py``; the torch_npu ones here on a fake torch_npu (our glue: dtypes, layouts, autograd)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from omegaconf import OmegaConf

import kernels.moe.permute as permute
import models
from kernels import installed
from kernels.attention.attention import Documents
from kernels.config import DEFAULT_FLA_OPS, FLA_OPS, KernelConfig, validate_kernel_config
from kernels.linear_attention import fla
from kernels.moe import npu as npu_moe
from kernels.moe.grouped_mm import per_group_mm
from kernels.registry import INSTALLED_OPS, OPS, SLOT_OPS, Env, apply_kernels, installed_kernels, select_kernels
from models.moe import GroupedExperts, compute_experts
from tests.fake_torch_npu import FLOATS, GLUE, FakeTorchNpu, install

ROOT = Path(__file__).resolve().parents[1]
AUTO_OPS = [op for op in OPS if op not in FLA_OPS]
DISPATCH_OPS = ("gather_sum", "unpermute_backward", "gather_quantize_rows", "moe_token_permute", "moe_token_unpermute",
                "grouped_mm", "cast_gradient", "adamw_step", "link_timer")
TRITON_ONLY = ("softmax_cross_entropy", "gather_sum", "unpermute_backward", "gather_quantize_rows", "adamw_step",
               "cast_gradient", "link_timer",
               "document_attention")  # no torch_npu kernel (packed-document attention: CUDA only)
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


@pytest.fixture(autouse=True)
def _nothing_installed_after():
    """apply_kernels installs the dispatch path's choices process-wide (per device type): undone after each test."""
    with installed_kernels():
        yield


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


@pytest.mark.parametrize("preset, name, ops", [("auto", "auto", DEFAULT_FLA_OPS),
                                               # FLA only: its short convolution too (ours is an auto kernel)
                                               ("flash_linear_attention", "flash-linear-attention", FLA_OPS),
                                               ("auto_fla", "auto,flash-linear-attention", DEFAULT_FLA_OPS)])
def test_presets_are_valid(preset: str, name: str, ops: tuple[str, ...]) -> None:
    merged = OmegaConf.merge(OmegaConf.structured(KernelConfig),
                             OmegaConf.load(ROOT / "conf" / "kernel_config" / f"{preset}.yaml"))
    cfg = OmegaConf.to_object(merged)
    validate_kernel_config(cfg)
    assert cfg.name == name and cfg.chunk_size == 64 and cfg.include_kernels == list(ops)


# --- selection ----------------------------------------------------------------------------------------------------

def test_cpu_gets_the_torch_references() -> None:
    kernels = select_kernels(KernelConfig(name="auto"), "cpu", Env("cpu"))
    assert {c.impl for c in kernels.choices.values()} == {"torch"}
    # An explicit FLA request on cpu is an error that says why and what to use instead.
    with pytest.raises(ValueError, match=r"asks for flash-linear-attention's chunk_gated_delta_rule, which cannot "
                                         r"run on cpu.*has kernels for cuda, npu only; fix: kernel_config=auto"):
        select_kernels(KernelConfig(name="flash-linear-attention"), "cpu", Env("cpu"))


def test_hopper_with_bad_triton_gets_fla_with_its_backward_step_made_safe() -> None:
    # FLA #640: the one miscompiled step (chunk_bwd_dqkwg) runs at 128-wide tiles or in torch, every other FLA
    # kernel stays, and the log line says so; the recurrent kernel (forward only) and the auto ops are not affected.
    kernels = select_kernels(KernelConfig(name="auto,flash-linear-attention"), "cuda", HOPPER_TRITON_36)
    chunk = kernels.choices["chunk_gated_delta_rule"]
    assert chunk.impl == "flash-linear-attention, #640-safe chunk_bwd_dqkwg" and "#640" in chunk.reason
    assert "128-wide tiles" in chunk.reason
    assert kernels.choices["fused_recurrent_gated_delta_rule"].impl == "flash-linear-attention"
    assert {kernels.choices[op].impl for op in ("rms_norm", "offset_rms_norm", "gated_rms_norm", "swiglu",
                                                "packed_swiglu", "apply_rotary", "softmax_cross_entropy")} \
        == {"triton"}


@pytest.mark.parametrize("triton_version, capability, broken", [
    ("3.6.0", (9, 0), True), ("3.4.0", (9, 0), True), ("3.7.0", (9, 0), True),
    ("3.7.1", (9, 0), False), ("3.8.0+git1234", (9, 0), False), ("3.3.1", (9, 0), False),
    ("3.6.0", (8, 0), False), ("3.6.0", (10, 0), False), (None, (9, 0), False), ("3.6.0", None, False),
])
def test_chunk_backward_bug_condition(triton_version, capability, broken: bool) -> None:
    assert (fla.chunk_backward_broken(triton_version, capability) is not None) == broken
    env = Env("cuda", triton_version=triton_version, capability=capability, fla_version="0.6.0")
    chosen = select_kernels(KernelConfig(name="flash-linear-attention"), "cuda", env).choices
    assert chosen["chunk_gated_delta_rule"].impl == ("flash-linear-attention, #640-safe chunk_bwd_dqkwg" if broken
                                                     else "flash-linear-attention")


def test_choosing_fla_logs_its_first_step_cost(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", "/shared/triton")
    with caplog.at_level(logging.INFO):
        select_kernels(KernelConfig(name="auto,flash-linear-attention"), "cuda", HOPPER_TRITON_36).log(
            logging.getLogger("train"))
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernel note:")]
    assert len(notes) == 1 and "first step can take minutes" in notes[0] and "/shared/triton" in notes[0]


def test_npu_never_gets_the_torch_backward_step() -> None:  # #640 is a CUDA (Hopper) bug; NPU runs triton-ascend
    env = Env("npu", triton_version="3.6.0", has_torch_npu=True, fla_version="0.6.0")
    chosen = select_kernels(KernelConfig(name="flash-linear-attention"), "npu", env).choices
    assert chosen["chunk_gated_delta_rule"].impl == "flash-linear-attention"


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
    assert chosen["chunk_gated_delta_rule"].impl == "torch"
    assert all(chosen[op].impl == "torch" for op in AUTO_OPS)  # auto not requested


def test_the_short_convolution_is_ours_on_cuda_unless_fla_s_is_listed() -> None:
    """Ours (kernels/linear_attention/triton_short_conv.py) measured faster than FLA's on an H200, so it is the auto
    kernel and FLA's is no longer in the default include_kernels: FLA's runs where listed. On NPU, where neither runs,
    the torch one with the reason logged; on CUDA without triton, torch."""
    env = Env("cuda", triton_version="3.7.1", capability=(9, 0), fla_version="0.6.0")
    default = KernelConfig(name="auto,flash-linear-attention")
    assert "causal_conv1d_silu" not in default.include_kernels
    assert select_kernels(default, "cuda", env).choices["causal_conv1d_silu"].impl == "triton"
    assert select_kernels(KernelConfig(), "cuda", env).choices["causal_conv1d_silu"].impl == "triton"
    listed = KernelConfig(name="auto,flash-linear-attention", include_kernels=list(FLA_OPS))
    assert select_kernels(listed, "cuda", env).choices["causal_conv1d_silu"].impl == "flash-linear-attention"
    fla_only = KernelConfig(name="flash-linear-attention", include_kernels=list(FLA_OPS))
    assert select_kernels(fla_only, "cuda", env).choices["causal_conv1d_silu"].impl == "flash-linear-attention"
    chosen = select_kernels(KernelConfig(name="flash-linear-attention"), "cuda", env).choices["causal_conv1d_silu"]
    assert (chosen.impl, chosen.reason) == ("torch", "not in kernel_config.include_kernels")
    npu = Env("npu", triton_version="3.2.0", fla_version="0.6.0", has_torch_npu=True)
    on_npu = select_kernels(listed, "npu", npu).choices
    assert on_npu["causal_conv1d_silu"].impl == "torch"
    assert on_npu["causal_conv1d_silu"].reason == ("flash-linear-attention has kernels for cuda only; "
                                                   "auto has kernels for cuda only")
    assert on_npu["chunk_gated_delta_rule"].impl == "flash-linear-attention"
    no_triton = select_kernels(KernelConfig(), "cuda", Env("cuda", capability=(9, 0))).choices["causal_conv1d_silu"]
    assert (no_triton.impl, no_triton.reason) == ("torch", "triton: triton is not installed")
    with pytest.raises(ImportError, match="flash-linear-attention"):  # FLA's asked for by name must be there
        select_kernels(listed, "cuda", Env("cuda", triton_version="3.7.1", capability=(9, 0)))


def test_cuda_without_triton_uses_torch() -> None:
    chosen = select_kernels(KernelConfig(), "cuda", Env("cuda", capability=(9, 0))).choices
    assert chosen["rms_norm"].impl == "torch" and "triton is not installed" in chosen["rms_norm"].reason


def test_unknown_device_type() -> None:
    with pytest.raises(ValueError, match="'xpu' is not one of cpu, cuda, npu"):
        select_kernels(KernelConfig(), "xpu", Env("xpu"))


@pytest.mark.torch_apis
def test_importing_the_registry_loads_no_device_package() -> None:
    # Beyond what torch's compiler loads by itself (torch.compiler.assume_constant_result imports torch._dynamo,
    # which imports triton wherever it is installed: torch 2.11's CUDA wheel brings it)
    code = ("import sys, torch._dynamo; torch_own = set(sys.modules); import kernels.registry; "
            "print(sorted({'fla', 'triton', 'torch_npu'} & (set(sys.modules) - torch_own)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _module_of(reference: Any) -> str:
    """The module of a torch reference: a function's, a ``functools.partial``'s function's, an instance's class's."""
    return (reference.func if isinstance(reference, functools.partial) else reference).__module__


def _modules_built_by(build: Callable) -> set[str]:
    """The project modules an ``Impl.build`` takes its kernel from: the module it imports by name (``_lazy``) and
    the modules and classes of the registry its body names."""
    named = [cell.cell_contents for cell in build.__closure__ or ()]
    named += [build.__globals__[name] for name in build.__code__.co_names if name in build.__globals__]
    modules = {value if isinstance(value, str) else value.__name__ if isinstance(value, types.ModuleType)
               else value.__module__ if isinstance(value, type) else "" for value in named}
    return {module for module in modules if module.startswith("kernels.")}


def test_every_kernel_sits_beside_its_torch_reference() -> None:
    # kernels/<group>/ holds an op's torch reference and every device kernel of it (tests/test_layering.py: the
    # groups), so a Triton or torch_npu kernel is found next to what it must equal.
    for op, spec in OPS.items():
        group = _module_of(spec.reference(KernelConfig())).rpartition(".")[0]
        assert group.startswith("kernels.") and group.count(".") == 1, f"{op}: reference in {group}"
        for impl in spec.kernels:
            modules = _modules_built_by(impl.build)
            assert modules, f"{op}: no module found for {impl.name}"
            assert {m.rpartition(".")[0] for m in modules} == {group}, (
                f"{op}: {impl.name} is in {sorted(modules)}, its torch reference in {group}")


# --- applying kernels ---------------------------------------------------------------------------------------------

def test_every_op_has_a_slot_and_every_slot_an_op() -> None:
    slots = {op for model in (_model("qwen3_5_moe", QWEN35), _model("qwen3_moe", QWEN3))
             for module in model.modules() for op in getattr(module, "kernel_slots", {}).values()}
    assert slots == set(SLOT_OPS)
    # The rest are the dispatch path's, which kernel functions call (installed per device type, not in slots).
    assert set(INSTALLED_OPS) == set(DISPATCH_OPS) == set(OPS) - set(SLOT_OPS)


@pytest.mark.parametrize("model_type, arch", [("qwen3_5_moe", QWEN35), ("qwen3_moe", QWEN3)])
def test_torch_references_equal_the_models_built_in_ops(model_type: str, arch: dict) -> None:
    model = _model(model_type, arch)
    applied = copy.deepcopy(model)
    counts = apply_kernels(applied, select_kernels(KernelConfig(name="auto"), "cpu", Env("cpu")))
    if model_type == "qwen3_moe":
        # per layer: input, post-attention, q and k norms; final norm; rotary per attention; the experts'
        # activation; the LM head's CE
        assert counts == {"rms_norm": 2 * 4 + 1, "apply_rotary": 2, "packed_swiglu": 2, "softmax_cross_entropy": 1,
                          "document_attention": 2 + 1}  # and the decoder, which builds the documents
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


@pytest.fixture
def fake_torch_npu(monkeypatch: pytest.MonkeyPatch) -> FakeTorchNpu:
    # GLUE: fp32, so every kernel compares exactly with its torch reference (DOCUMENTED: tests/test_npu_contract.py).
    monkeypatch.setattr(npu_moe, "PERMUTE_DTYPES", FLOATS)
    return install(FakeTorchNpu(GLUE), monkeypatch)


@pytest.mark.parametrize("model_type, arch, ops", [
    ("qwen3_5_moe", QWEN35, {"npu_rms_norm": 2 * 4 + 2 * 2 + 1 + 2, "npu_swiglu": 4 + 4, "npu_rotary_mul": 2 * 2}),
    ("qwen3_moe", QWEN3, {"npu_rms_norm": 2 * 4 + 1, "npu_rotary_mul": 2 * 2, "npu_swiglu": 2}),
])
def test_npu_gets_torch_npu_ops(fake_torch_npu: FakeTorchNpu, model_type: str, arch: dict, ops: dict) -> None:
    kernels = select_kernels(KernelConfig(name="auto"), "npu", Env("npu", has_torch_npu=True))
    # Every auto op but the LM head's cross-entropy step and the permutes' K-to-one steps (Triton on CUDA only)
    # has a torch_npu kernel.
    assert {kernels.choices[op].impl for op in AUTO_OPS if op not in TRITON_ONLY} == {"torch_npu"}
    assert {kernels.choices[op].impl for op in TRITON_ONLY} == {"torch"}
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


# --- the dispatch path --------------------------------------------------------------------------------------------

def _dispatch_impls(cfg: KernelConfig, env: Env) -> dict[str, str]:
    chosen = select_kernels(cfg, env.device_type, env).choices
    return {op: chosen[op].impl for op in DISPATCH_OPS}


def test_dispatch_path_choice_per_device() -> None:
    triton = {"gather_sum": "triton", "unpermute_backward": "triton", "gather_quantize_rows": "triton",
              "cast_gradient": "triton", "adamw_step": "triton", "link_timer": "triton"}
    none = dict.fromkeys(DISPATCH_OPS, "torch")
    assert _dispatch_impls(KernelConfig(), Env("cuda", triton_version="3.7.1", capability=(9, 0))) == {
        **none, **triton, "grouped_mm": "torch._grouped_mm"}
    no_triton = Env("cuda", capability=(9, 0))
    assert _dispatch_impls(KernelConfig(), no_triton) == {**none, "grouped_mm": "torch._grouped_mm"}
    assert _dispatch_impls(KernelConfig(), Env("cpu")) == none
    assert _dispatch_impls(KernelConfig(), Env("npu", has_torch_npu=True)) == {
        **none, "moe_token_permute": "torch_npu", "moe_token_unpermute": "torch_npu", "grouped_mm": "torch_npu"}
    chosen = select_kernels(KernelConfig(), "npu", Env("npu")).choices
    assert {chosen[op].impl for op in DISPATCH_OPS} == {"torch"}
    assert "pip install '.[npu]'" in chosen["grouped_mm"].reason


@pytest.mark.parametrize("env", [Env("cuda", triton_version="3.7.1", capability=(9, 0)),
                                 Env("npu", has_torch_npu=True)], ids=lambda env: env.device_type)
def test_kernel_config_without_auto_picks_torch_everywhere(env: Env) -> None:  # (cpu: FLA cannot run, an error)
    env = dataclasses.replace(env, fla_version="0.6.0")
    chosen = select_kernels(KernelConfig(name="flash-linear-attention"), env.device_type, env).choices
    assert {chosen[op].impl for op in AUTO_OPS} == {"torch"}
    assert all(chosen[op].reason == "kernel_config.name does not include auto" for op in AUTO_OPS)


def test_the_token_permutes_are_chosen_together() -> None:
    # The unpermute reads the state its own permute left (torch: (order, inv); torch_npu: its row map).
    for env in (Env("cpu"), Env("cuda", triton_version="3.7.1", capability=(9, 0), fla_version="0.6.0"),
                Env("npu", has_torch_npu=True, fla_version="0.6.0"), Env("npu", fla_version="0.6.0")):
        for name in ("auto",) if env.device_type == "cpu" else ("auto", "flash-linear-attention",
                                                                 "auto,flash-linear-attention"):
            chosen = select_kernels(KernelConfig(name=name), env.device_type, env).choices
            assert chosen["moe_token_permute"].impl == chosen["moe_token_unpermute"].impl, (env, name)


def test_dispatch_kernels_are_logged_with_the_others(caplog: pytest.LogCaptureFixture) -> None:
    kernels = select_kernels(KernelConfig(), "cuda", Env("cuda", triton_version="3.7.1", capability=(9, 0)))
    with caplog.at_level(logging.INFO):
        kernels.log(logging.getLogger("train"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 + len(OPS) and lines[0].startswith("kernels for cuda (sm_90)")  # one line per op
    assert "kernel rms_norm: triton: on cuda" in lines and "kernel gather_sum: triton: on cuda" in lines
    assert "kernel moe_token_permute: torch: auto has kernels for npu only" in lines
    assert ("kernel grouped_mm: torch._grouped_mm: on cuda; where it supports the dtype (probed at the first call), "
            "else the per-expert loop") in lines


def test_apply_kernels_installs_the_dispatch_path_for_its_device_type(fake_torch_npu: FakeTorchNpu) -> None:
    kernels = select_kernels(KernelConfig(), "npu", Env("npu", has_torch_npu=True))
    assert apply_kernels(GroupedExperts(2, 8, 4), kernels) == {"packed_swiglu": 1}  # the slots: counted
    assert installed.snapshot() == {("npu", op): kernels.get(op) for op in DISPATCH_OPS}
    assert installed.snapshot()[("npu", "grouped_mm")] is npu_moe.grouped_mm
    x = torch.randn(4, 8)  # not an NPU tensor: the torch reference
    assert installed.kernel("grouped_mm", x, per_group_mm) is per_group_mm


@pytest.mark.parametrize("counts", [[3, 2, 4], [3, 0, 6]])
def test_npu_grouped_mm_matches_the_loop_and_leaves_an_empty_expert_to_it(fake_torch_npu: FakeTorchNpu,
                                                                           counts: list[int]) -> None:
    torch.manual_seed(0)
    experts = GroupedExperts(3, 16, 8)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x_MD, counts_E = torch.randn(sum(counts), 16), torch.tensor(counts)

    def run(counts_host: list[int] | None) -> list[torch.Tensor]:
        experts.zero_grad()
        x = x_MD.clone().requires_grad_()
        y = compute_experts(experts.expert_weights(), x, counts_E, counts_host)
        y.square().sum().backward()
        return [y.detach(), x.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()]

    want = run(None)  # nothing installed: the per-expert loop
    with installed_kernels(select_kernels(KernelConfig(), "npu", Env("npu", has_torch_npu=True)), "cpu"):
        with torch.no_grad():  # the EP dispatchers pass the host counts: no sync to decide
            compute_experts(experts.expert_weights(), x_MD, counts_E, counts)
        # Both GEMMs in torch_npu's grouped matmul, or (an expert without rows) both in the loop.
        assert fake_torch_npu.calls.get("npu_grouped_matmul", 0) == (0 if 0 in counts else 2)
        for got in (run(counts), run(None)):  # each: 2 GEMMs forward, and dx and the K-grouped dw of each backward
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w)
    assert fake_torch_npu.calls.get("npu_grouped_matmul", 0) == (0 if 0 in counts else 2 + 2 * 6)


def test_npu_token_permutes_match_the_torch_ones(fake_torch_npu: FakeTorchNpu) -> None:
    g = torch.Generator().manual_seed(0)
    experts_NK = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(11)])
    x_ND, weights_NK = torch.randn(11, 16, generator=g), torch.rand(11, 2, generator=g)

    def run() -> list[torch.Tensor]:
        x, w = x_ND.clone().requires_grad_(), weights_NK.clone().requires_grad_()
        x_MD, state = permute.moe_token_permute(x, experts_NK)
        y_ND = permute.moe_token_unpermute(x_MD * 2.0, w, state)
        y_ND.square().sum().backward()
        return [x_MD.detach(), y_ND.detach(), x.grad, w.grad]

    want = run()  # nothing installed: the torch gathers
    with installed_kernels(select_kernels(KernelConfig(), "npu", Env("npu", has_torch_npu=True)), "cpu"):
        got = run()
    assert fake_torch_npu.calls == {"npu_moe_token_permute": 1, "npu_moe_token_unpermute": 1}
    for g_, w_ in zip(got, want, strict=True):
        torch.testing.assert_close(g_, w_, rtol=1e-6, atol=1e-6)  # fp32: the same products, summed in other orders


def test_host_chunk_indices_are_fla_s_chunk_indices_built_on_the_host() -> None:
    """(sequence, chunk within it) for every chunk, in order, as FLA's prepare_chunk_indices lays them out;
    one-token and exact-multiple documents included."""
    lengths = [1, 64, 65, 130, 1, 7]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    expected = [[n, c] for n, length in enumerate(lengths) for c in range(-(-length // 64))]
    got = fla.host_chunk_indices(cu, 64, torch.device("cpu"))
    assert got.tolist() == expected and got.dtype == cu.dtype
    assert fla.host_chunk_indices(cu, 16, torch.device("cpu")).shape == (sum(-(-n // 16) for n in lengths), 2)


def test_fla_wrappers_hand_fla_packed_documents_as_they_take_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Against stand-ins for FLA's entry points (FLA itself needs triton). The delta rule over rows of packed
    documents (cu_seqlens over the flattened rows): from RESET_MIN_ROWS rows, FLA's launch for the rows, every
    document's first decay reset, no cu_seqlens; one row, FLA's varlen launch of a batch of one, with chunk_indices
    where the host knows the offsets. A state in or out is refused with documents. The short convolution: FLA's
    varlen launch, with chunk_indices where the host knows the offsets (FLA then reads nothing back)."""
    import types

    calls = []
    rule_module, conv_module = types.ModuleType("fla.ops.gated_delta_rule"), types.ModuleType("fla.modules.causal_conv1d")
    rule_module.chunk_gated_delta_rule = lambda *args, **kwargs: calls.append((args, kwargs)) or (args[2], None)
    conv_module.causal_conv1d = lambda x, w, **kwargs: calls.append(("conv", kwargs)) or (x, None)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", rule_module)
    monkeypatch.setitem(sys.modules, "fla.modules.causal_conv1d", conv_module)
    rule = fla.chunk_gated_delta_rule(32)
    assert fla.RESET_MIN_ROWS == 2
    cu2 = torch.tensor([0, 3, 40, 70, 80])  # two rows of 40
    q2, v2, g2 = torch.zeros(2, 40, 1, 4), torch.zeros(2, 40, 2, 4), -torch.rand(2, 40, 2)
    rule(q2, q2, v2, g=g2, beta=g2, cu_seqlens=cu2, cu_seqlens_cpu=cu2)
    (args, packed), = calls
    assert args[0].shape == (2, 40, 1, 4) and "cu_seqlens" not in packed and "chunk_indices" not in packed
    assert packed["chunk_size"] == 32
    starts = torch.zeros(80, dtype=torch.bool).index_fill_(0, cu2[:-1], True)
    assert (packed["g"].flatten(0, 1)[starts] == fla.DOCUMENT_RESET_G).all()
    assert torch.equal(packed["g"].flatten(0, 1)[~starts], g2.flatten(0, 1)[~starts])
    cu = torch.tensor([0, 3, 70, 80])  # one row of 80
    q1, v1, g1 = torch.zeros(1, 80, 1, 4), torch.zeros(1, 80, 2, 4), -torch.rand(1, 80, 2)
    o, _ = rule(q1, q1, v1, g=g1, beta=g1, cu_seqlens=cu, cu_seqlens_cpu=cu)
    args, known = calls[-1]
    assert known["chunk_indices"].tolist() == [[0, 0], [1, 0], [1, 1], [1, 2], [2, 0]] and known["g"] is not g1
    assert torch.equal(known["g"], g1) and torch.equal(known["cu_seqlens"], cu) and o.shape == v1.shape
    rule(q1, q1, v1, g=g1, beta=g1, cu_seqlens=cu)
    assert "chunk_indices" not in calls[-1][1]
    rule(q2, q2, v2, g=g2, beta=g2)
    assert calls[-1][1]["g"] is g2 and "cu_seqlens" not in calls[-1][1]
    with pytest.raises(NotImplementedError, match="initial_state"):
        rule(q2, q2, v2, g=g2, beta=g2, cu_seqlens=cu2, initial_state=torch.zeros(4, 2, 4, 4))
    docs = Documents(torch.zeros(1, 80, dtype=torch.long), cu, host_cu_seqlens_n1=cu)
    fla.causal_conv1d_silu()(torch.zeros(1, 80, 4), torch.zeros(4, 4), docs)
    assert calls[-1][1]["chunk_indices"].tolist() == [[0, 0], [1, 0], [1, 1], [2, 0]]  # chunks of 64
    fla.causal_conv1d_silu()(torch.zeros(1, 80, 4), torch.zeros(4, 4), Documents(docs.ids_BT, cu))
    assert calls[-1][1]["chunk_indices"] is None
