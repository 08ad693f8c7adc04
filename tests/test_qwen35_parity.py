"""Our Qwen3.5-MoE against transformers' Qwen3_5MoeForCausalLM in fp32 on CPU (transformers' torch fallbacks for
DeltaNet): logits, loss with the router aux loss, every parameter gradient, multimodal position ids, the
initialisation, and the presets' hyper-parameters and parameter counts."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from kernels.linear_attention.delta_rule import chunk_gated_delta_rule
from models import build_args, get_spec
from models.qwen3_5_moe.args import Qwen3_5MoeArgs
from models.qwen3_5_moe.deltanet import GatedDeltaNet
from tests.conftest import our_loss_like_transformers
from training.loss import router_loss_shares

CONF_MODEL = Path(__file__).resolve().parents[1] / "conf" / "model"
# Both layer kinds, full attention not only last; GVA (4 value heads on 2 q/k heads), key dim != value dim;
# 16 of 64 head channels rotated, mrope sections summing to the 8 rotary frequencies.
ARCH = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25,
            rope_theta=10000.0, mrope_section=[3, 3, 2], linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, rms_norm_eps=1e-6,
            router_aux_loss_coef=0.01, max_position_embeddings=256,
            initializer_range=0.1)  # larger than 0.02 so attention and routing are far from uniform
B, T = 2, 80  # T: one full and one partial chunk at transformers' chunk size 64
_ROPE_KEYS = ("rope_theta", "partial_rotary_factor", "mrope_section")


def _hf_config(arch: dict, **extra) -> transformers.Qwen3_5MoeTextConfig:
    rope = {key: arch[key] for key in _ROPE_KEYS if key in arch}
    return transformers.Qwen3_5MoeTextConfig(
        **{k: v for k, v in arch.items() if k not in _ROPE_KEYS},
        rope_parameters={"rope_type": "default", "mrope_interleaved": True, **rope}, **extra)


def _models(chunk_size: int = 64) -> tuple[torch.nn.Module, torch.nn.Module]:
    args = build_args("qwen3_5_moe", ARCH)
    torch.manual_seed(0)
    ours = get_spec("qwen3_5_moe").model_cls(args)
    ours.init_weights()
    with torch.no_grad():  # norms away from their init, so a misplaced (1 + w) or gated weight shows
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    for module in ours.modules():
        if isinstance(module, GatedDeltaNet):
            module.delta_rule = functools.partial(chunk_gated_delta_rule, chunk_size=chunk_size)
    hf = transformers.Qwen3_5MoeForCausalLM(_hf_config(ARCH, output_router_logits=True)).float()
    hf.load_state_dict(ours.state_dict(), strict=True)  # the same parameter names, by design
    hf.set_experts_implementation("eager")
    return ours, hf


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("chunk_size", [64, 16])  # transformers always chunks by 64
def test_forward_loss_and_grads_match_transformers(chunk_size: int) -> None:
    ours, hf = _models(chunk_size)
    torch.manual_seed(1)
    input_ids_BT = torch.randint(0, ARCH["vocab_size"], (B, T))
    with torch.no_grad():
        logits = ours(input_ids_BT).logits
    loss, out = our_loss_like_transformers(ours, input_ids_BT, ARCH["num_experts"], ARCH["router_aux_loss_coef"])
    aux = router_loss_shares(out.router_stats, ARCH["num_experts"])[0]
    loss.backward()
    ref = hf(input_ids=input_ids_BT, labels=input_ids_BT)  # output_router_logits: loss includes coef x aux
    ref.loss.backward()

    # Logits: 1e-5 relative (norm-wise). fp32 round-off of two layouts (and chunkings) of the same ops grows
    # through the layers, the per-token DeltaNet output norm scaling it up where the output is small; with logits
    # up to |3.5| single entries differ by up to 4e-5, the norm-wise error is <= 3e-6 (chunk 16), 1.4e-6 (64).
    assert _rel_err(logits, ref.logits) < 1e-5
    # Loss and aux are means over all tokens, so the round-off averages out: 1e-5 absolute.
    torch.testing.assert_close(aux, ref.aux_loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, ref.loss, rtol=0, atol=1e-5)
    hf_params = dict(hf.named_parameters())
    assert set(hf_params) == {name for name, _ in ours.named_parameters()}
    errors = {name: _rel_err(p.grad, hf_params[name].grad) for name, p in ours.named_parameters()}
    # Per parameter, norm-wise: <= 2e-5 measured, except the per-head decay parameters of the DeltaNet
    # layers (A_log, dt_bias): their gradients sum T x B terms of both signs, so round-off shows up to ~1.3e-4
    # (reordering only the cross-entropy's fp32 sums, logits path vs chunked LM head, moves them by 7e-5).
    decay = {name for name in errors if name.endswith(("linear_attn.A_log", "linear_attn.dt_bias"))}
    assert max(v for k, v in errors.items() if k not in decay) < 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    assert max(errors[k] for k in decay) < 3e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:5]


@torch.no_grad()
def test_position_ids_1d_and_3_streams() -> None:
    ours, hf = _models()
    input_ids_BT = torch.randint(0, ARCH["vocab_size"], (B, T), generator=torch.Generator().manual_seed(2))
    position_ids_BT = torch.arange(T).repeat(B, 1) + torch.tensor([[0], [7]])  # rows start at different offsets
    logits = ours(input_ids_BT, position_ids_BT).logits
    # Text: three equal streams are plain 1-D RoPE, bit for bit.
    assert torch.equal(ours(input_ids_BT, position_ids_BT.expand(3, B, T)).logits, logits)
    # Unequal (t, h, w) streams mix per rotary channel as transformers' interleaved MRoPE does.
    position_ids_3BT = torch.stack([position_ids_BT, position_ids_BT // 4, position_ids_BT % 5])
    mixed = ours(input_ids_BT, position_ids_3BT).logits
    ref = hf(input_ids=input_ids_BT, position_ids=position_ids_3BT).logits
    assert not torch.allclose(mixed, logits, atol=1e-3)  # the h and w streams matter
    assert _rel_err(mixed, ref) < 1e-5  # as the logits above


def test_init_matches_transformers() -> None:
    args = build_args("qwen3_5_moe", ARCH)
    torch.manual_seed(0)
    ours = get_spec("qwen3_5_moe").model_cls(args)
    ours.init_weights()
    hf = dict(transformers.Qwen3_5MoeForCausalLM(_hf_config(ARCH)).named_parameters())
    for name, p in ours.named_parameters():
        ref = hf[name].detach()
        if name.endswith("A_log"):  # log U(0.01, 16)
            assert p.min() >= math.log(0.01) and p.max() <= math.log(16), name
        elif ref.std() == 0 or ref.numel() == 1:  # constants: (1 + w) norms 0, the gated norm 1, dt_bias 1
            assert torch.equal(p, ref), name
        else:  # N(0, initializer_range); 25%: the std estimate of the smallest tensor (64 entries) is within ~9%
            assert abs(p.std().item() / ARCH["initializer_range"] - 1) < 0.25, name
            assert abs(ref.std().item() / ARCH["initializer_range"] - 1) < 0.25, name


@pytest.mark.parametrize("num_layers, interval", [(40, 4), (6, 3)])
def test_layer_types_follow_transformers(num_layers: int, interval: int) -> None:
    args = Qwen3_5MoeArgs(num_hidden_layers=num_layers, full_attention_interval=interval)
    ref = transformers.Qwen3_5MoeTextConfig(num_hidden_layers=num_layers, full_attention_interval=interval)
    assert args.resolved_layer_types() == ref.layer_types


def _preset(name: str) -> Qwen3_5MoeArgs:
    cfg = OmegaConf.to_object(OmegaConf.load(CONF_MODEL / f"{name}.yaml"))
    assert cfg["model_type"] == "qwen3_5_moe" and cfg["name"] == name
    return build_args(cfg["model_type"], cfg["arch"])


def test_published_preset_is_transformers_35b_a3b() -> None:
    args = _preset("qwen35_moe")
    ref = transformers.Qwen3_5MoeTextConfig()  # transformers' defaults describe Qwen3.5-35B-A3B ...
    # ... except these, where the published config.json differs from the class defaults.
    assert (args.rope_theta, args.max_position_embeddings) == (1e7, 262144)
    assert args.resolved_layer_types() == ref.layer_types
    for field in dataclasses.fields(args):
        if hasattr(ref, field.name) and field.name not in ("rope_theta", "max_position_embeddings", "layer_types"):
            assert getattr(args, field.name) == getattr(ref, field.name), field.name
    assert args.partial_rotary_factor == ref.rope_parameters["partial_rotary_factor"]


@pytest.mark.parametrize("mtp", [False, True])
@pytest.mark.parametrize("preset", ["qwen35_moe", "qwen35_moe_debug"])
def test_param_counts_match_the_module(preset: str, mtp: bool) -> None:
    args = dataclasses.replace(_preset(preset), mtp_loss_weight=0.3 if mtp else 0.0)
    spec = get_spec("qwen3_5_moe")
    with torch.device("meta"):
        model = spec.model_cls(args)
    total, active, embed = args.param_counts()
    assert total == sum(p.numel() for p in model.parameters())
    assert (total, active) == spec.parameter_counts(model)  # the MTP head's experts counted as routed ones too
    idle_experts = args.num_experts - args.num_experts_per_tok
    assert total - active == (args.num_hidden_layers + mtp) * idle_experts * 3 * args.hidden_size \
        * args.moe_intermediate_size
    assert embed == model.model.embed_tokens.weight.numel()
    assert args.flops_per_token(4096) > 6 * (active - embed)
    if preset == "qwen35_moe" and not mtp:  # "35B total, 3B active" (the published counts: with vision and MTP)
        assert 34e9 < total < 36e9 and 2.9e9 < active - embed < 3.1e9
    if mtp:  # the head's block, fc and norms, and the LM head's second pass over its rows
        without = dataclasses.replace(args, mtp_loss_weight=0.0)
        head = (active - without.param_counts()[1]) * 6 + 6 * args.vocab_size * args.hidden_size
        attention = 12 * args.num_attention_heads * args.head_dim * 4096
        assert args.flops_per_token(4096) - without.flops_per_token(4096) == head + attention
