"""How Qwen3-MoE is written in Hugging Face ``config.json`` files and checkpoints (read by ``models/hf_io.py``).

Checkpoints (hub and transformers 5 ``save_pretrained``, through its ``qwen2_moe`` weight converter) store
experts one by one as ``model.layers.N.mlp.experts.J.{gate_proj,up_proj,down_proj}.weight``; in memory
(ours and transformers') they are fused: ``gate_up_proj`` [E, 2I, D] with rows [gate; up], ``down_proj`` [E, D, I].
"""

from __future__ import annotations

from typing import Any

from models.qwen3_moe.args import Qwen3MoeArgs

# transformers' Qwen3MoeConfig defaults: a key missing from config.json means these values, not our preset's
# (e.g. norm_topk_prob defaults to False there).
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.001,
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
}

# Features transformers' Qwen3-MoE has and ours does not, as (config key, value meaning "off").
_OFF: tuple[tuple[str, Any], ...] = (
    ("mlp_only_layers", []),  # dense MLP layers
    ("decoder_sparse_step", 1),  # MoE only every n-th layer
    ("attention_bias", False),
    ("use_sliding_window", False),  # sliding_window is ignored unless this is set
    ("hidden_act", "silu"),
    ("attention_dropout", 0.0),
)


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes rope_parameters; hub configs (and transformers 4) rope_theta + rope_scaling.
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def unsupported(cfg: dict[str, Any]) -> list[str]:
    """Features switched on in ``cfg`` that this implementation does not have."""
    problems = [f"{key}={cfg[key]!r} (supported: {off!r})"
                for key, off in _OFF if cfg.get(key) is not None and cfg[key] != off]
    rope_type = _rope(cfg).get("rope_type", _rope(cfg).get("type", "default"))
    if rope_type != "default":
        problems.append(f"rope type {rope_type!r} (supported: 'default')")
    return problems


def arch_from_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``Qwen3MoeArgs`` fields from a config.json dict (feature checks are ``unsupported``'s job)."""
    arch = {key: cfg.get(key, default) for key, default in _HF_DEFAULTS.items()}
    # transformers 5 writes num_local_experts (num_experts is its alias); hub configs write num_experts.
    arch["num_experts"] = cfg.get("num_local_experts", arch["num_experts"])
    arch["rope_theta"] = float(_rope(cfg).get("rope_theta", cfg.get("rope_theta", arch["rope_theta"])))
    # transformers' attention falls back to hidden // heads when head_dim is absent.
    arch["head_dim"] = cfg.get("head_dim") or arch["hidden_size"] // arch["num_attention_heads"]
    return arch


def config_from_arch(args: Qwen3MoeArgs) -> dict[str, Any]:
    """config.json keys in the hub's spelling, which transformers 4.x, 5.x and vLLM all read."""
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.num_experts_per_tok,
        "moe_intermediate_size": args.moe_intermediate_size,
        "norm_topk_prob": args.norm_topk_prob,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": args.rms_norm_eps,
        "tie_word_embeddings": args.tie_word_embeddings,
        "router_aux_loss_coef": args.router_aux_loss_coef,
        "max_position_embeddings": args.max_position_embeddings,
        "initializer_range": args.initializer_range,
        "sliding_window": None,
        **dict(_OFF),
    }
