"""How Qwen3.5-MoE is written in Hugging Face ``config.json`` files and checkpoints (read by ``models/hf_io.py``).

Two layouts: the text model (``model_type: qwen3_5_moe_text``, tensors under ``model.layers.N``) and the
published multimodal one (``qwen3_5_moe``: the text hyper-parameters under ``text_config``, text tensors under
``model.language_model.layers.N``, plus ``model.visual.*`` and ``mtp.*``; the vision tower's hyper-parameters under
``vision_config``, its token ids at the top level). Experts are per-expert on disk as for Qwen3-MoE (fused names are
accepted too); ``rope_parameters`` nests the rotary settings. A run from a checkpoint exports in its layout, carrying
what it does not train (``models.hf_io.export_source``); otherwise export writes the text layout, which
``AutoModelForCausalLM`` loads, or for a model with its vision tower the multimodal one
(``AutoModelForImageTextToText``).
"""

from __future__ import annotations

from typing import Any

from models.qwen3_5_moe.args import Qwen3_5MoeArgs, VisionArgs

# transformers' Qwen3_5MoeTextConfig defaults: a key missing from config.json means these values.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "router_aux_loss_coef": 0.001,
    "max_position_embeddings": 32768, "initializer_range": 0.02, "layer_types": None,
}
_ROPE_DEFAULTS: dict[str, Any] = {"rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                  "mrope_section": [11, 11, 10]}
_OFF: tuple[tuple[str, Any], ...] = (("attention_bias", False), ("hidden_act", "silu"), ("attention_dropout", 0.0))
# transformers' Qwen3_5MoeVisionConfig defaults (vision_config) and Qwen3_5MoeConfig's token ids (the top level).
_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304, "num_heads": 16,
    "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584,
    "num_position_embeddings": 2304, "initializer_range": 0.02,
}
_TOKEN_DEFAULTS: dict[str, int] = {"image_token_id": 248056, "video_token_id": 248057,
                                   "vision_start_token_id": 248053, "vision_end_token_id": 248054}


def _text(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("text_config") or cfg


def unsupported(cfg: dict[str, Any]) -> list[str]:
    text = _text(cfg)
    problems = [f"{key}={text[key]!r} (supported: {off!r})"
                for key, off in _OFF if text.get(key) is not None and text[key] != off]
    rope = text.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope type {rope['rope_type']!r} (supported: 'default')")
    vision = cfg.get("vision_config") or {}
    if vision.get("deepstack_visual_indexes"):  # Qwen3-VL's extra mergers: Qwen3.5's tower has none
        problems.append(f"vision_config.deepstack_visual_indexes={vision['deepstack_visual_indexes']} (supported: [])")
    vision_rope = vision.get("rope_parameters") or {}
    if vision_rope.get("rope_type", "axial") != "axial":
        problems.append(f"vision rope type {vision_rope['rope_type']!r} (supported: 'axial')")
    return problems


def arch_from_config(cfg: dict[str, Any]) -> dict[str, Any]:
    text = _text(cfg)
    arch = {key: text.get(key, default) for key, default in _HF_DEFAULTS.items()}
    rope = text.get("rope_parameters") or {}
    arch.update({key: rope.get(key, text.get(key, default)) for key, default in _ROPE_DEFAULTS.items()})
    arch["rope_theta"] = float(arch["rope_theta"])
    arch["tie_word_embeddings"] = cfg.get("tie_word_embeddings", arch["tie_word_embeddings"])
    if cfg.get("vision_config"):  # the multimodal layout: its tower (built where model.vision=true)
        vision = cfg["vision_config"]
        arch["vision_config"] = {**{key: vision.get(key, default) for key, default in _VISION_DEFAULTS.items()},
                                 "rope_theta": float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                                 **{key: cfg.get(key, default) for key, default in _TOKEN_DEFAULTS.items()}}
    return arch


def config_from_arch(args: Qwen3_5MoeArgs) -> dict[str, Any]:
    """A text-model config.json (``qwen3_5_moe_text``), as transformers' save_pretrained writes it; for a model with
    its vision tower the multimodal one's keys (``qwen3_5_moe``: ``text_config``, ``vision_config``, the token ids)."""
    config = {key: getattr(args, key) for key in _HF_DEFAULTS}
    config["layer_types"] = args.resolved_layer_types()
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": args.rope_theta,
                                 "partial_rotary_factor": args.partial_rotary_factor,
                                 "mrope_section": list(args.mrope_section), "mrope_interleaved": True}
    text = {**config, **dict(_OFF)}
    if args.vision_config is None:
        return text
    return {"text_config": {**text, "model_type": "qwen3_5_moe_text"},
            "vision_config": _vision_config(args.vision_config),
            "tie_word_embeddings": args.tie_word_embeddings,
            **{key: getattr(args.vision_config, key) for key in _TOKEN_DEFAULTS}}


def _vision_config(vision: VisionArgs) -> dict[str, Any]:
    return {"model_type": "qwen3_5_moe_vision", **{key: getattr(vision, key) for key in _VISION_DEFAULTS},
            "rope_parameters": {"rope_type": "axial", "rope_theta": vision.rope_theta}}
