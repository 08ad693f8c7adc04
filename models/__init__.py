"""Model families and the parallel plan each one declares.

A family registers a ``ModelSpec``: how to build it from its hyper-parameters and where its parallel
units live. ``parallelisms/`` reads only the spec, never module names of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

from models.args import training_knobs
from models.qwen3_5_moe import Qwen3_5MoeArgs, Qwen3_5MoeForCausalLM
from models.qwen3_moe import Qwen3MoeArgs, Qwen3MoeForCausalLM


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    args_cls: type
    model_cls: Callable[[Any], nn.Module]
    hf_architecture: str  # config.json "architectures" entry for export
    # Parallel plan (FQNs relative to the causal-LM module).
    embeddings: str = "model.embed_tokens"
    blocks: str = "model.layers"  # ModuleList of decoder blocks (FSDP units)
    # ModuleList of the blocks of a multi-token-prediction head, where the model has one (``named_blocks``).
    mtp_blocks: str | None = None
    experts: str = "mlp.experts"  # relative to a block: the GroupedExperts module (EP splits its dim 0)
    final: tuple[str, ...] = ("model.norm", "lm_head")  # run after the last block
    # Context parallelism (Ulysses) splits heads: per token mixer, (model.arch key of the heads split over cp, key
    # of the heads they share, which are split too or, when fewer than cp, repeated). Checked by parallelisms.
    cp_heads: tuple[tuple[str, str], ...] = (("num_attention_heads", "num_key_value_heads"),)
    # HF checkpoints may nest the text model (multimodal layouts); maps a prefix on disk to ours.
    hf_prefixes: tuple[tuple[str, str], ...] = (("model.", "model."), ("lm_head.", "lm_head."))
    # Module with the family's config.json translation and on-disk expert names (see models/hf_io.py).
    hf_names: str = "models.{model_type}.hf_names"
    hf_export_type: str | None = None  # export as this registered model_type instead (e.g. multimodal -> text)
    # A vision tower, where the model has one (built only where it trains: ``with_vision``): the module, and the
    # ModuleList of its blocks. The plan makes each block an FSDP unit (activation checkpointing too) and the rest of
    # the tower (patch embedding, positions, merger) one more; no EP, no CP (every cp rank runs the whole tower).
    vision: str | None = None
    vision_blocks: str | None = None

    def named_blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """(FQN, block) of every decoder block the parallel plan treats alike (FSDP unit, EP and expert FSDP on its
        ``experts``, activation checkpointing, compile): the model's, then its MTP head's where it has one."""
        lists = [self.blocks] + ([self.mtp_blocks] if self.mtp_blocks and _has(model, self.mtp_blocks) else [])
        return [(f"{name}.{i}", block) for name in lists for i, block in enumerate(model.get_submodule(name))]

    def mtp_head(self, model: nn.Module) -> nn.Module | None:
        """The module holding the MTP head's blocks and its own layers (fc, norms), where the model has one."""
        if not (self.mtp_blocks and _has(model, self.mtp_blocks)):
            return None
        return model.get_submodule(self.mtp_blocks.rpartition(".")[0]) if "." in self.mtp_blocks else model

    def vision_tower(self, model: nn.Module) -> nn.Module | None:
        """The vision tower, where the model has one."""
        return model.get_submodule(self.vision) if self.vision and _has(model, self.vision) else None

    def named_vision_blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """(FQN, block) of the vision tower's blocks, where the model has a tower."""
        if self.vision_tower(model) is None or not self.vision_blocks:
            return []
        return [(f"{self.vision_blocks}.{i}", block) for i, block in enumerate(model.get_submodule(self.vision_blocks))]

    def parameter_counts(self, model: nn.Module) -> tuple[int, int]:
        """(total, active per token) parameters of a built (possibly meta) model: of the routed experts' weights a
        token uses num_experts_per_tok / num_experts; everything else (shared experts, attention, embeddings) is
        active."""
        total = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for _, block in self.named_blocks(model)
                      for p in block.get_submodule(self.experts).parameters())
        args = model.args
        return total, total - experts + experts * args.num_experts_per_tok // args.num_experts

    def cp_head_counts(self, args: Any) -> list[tuple[str, int, str, int]]:
        """(key, heads split over cp, key, heads they share) of each token mixer, for the parallel checks."""
        return [(split, getattr(args, split), shared, getattr(args, shared)) for split, shared in self.cp_heads]


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


_REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> None:
    _REGISTRY[spec.model_type] = spec


def get_spec(model_type: str) -> ModelSpec:
    if model_type not in _REGISTRY:
        raise ValueError(f"model.model_type={model_type!r} is not registered; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[model_type]


def with_vision(args: Any, vision: bool) -> Any:
    """The hyper-parameters a model is built from (``model.vision``): the vision tower's (``vision_config``) kept
    where it trains, dropped where not (text data: the text model alone, a checkpoint's tower carried to the export
    untouched)."""
    has = getattr(args, "vision_config", None) is not None
    if vision and not has:
        raise ValueError("model.vision=true trains the vision tower, and model.arch.vision_config is unset: use a "
                         "preset with one (model=qwen35_moe, qwen35_moe_debug) or model=hf with a multimodal "
                         "checkpoint (config.json's vision_config)" if hasattr(args, "vision_config") else
                         f"model.vision=true: {type(args).__name__} models have no vision tower")
    if vision:
        args.validate_vision()
        return args
    return dataclasses.replace(args, vision_config=None) if has else args


def build_args(model_type: str, arch: dict[str, Any], vision: bool = False):
    """Hyper-parameter dataclass of the family from a dict, rejecting keys the family does not have. ``vision``
    (model.vision): keep the vision tower's hyper-parameters (``with_vision``); by default a model is built without
    its tower, whatever the preset or config.json describes."""
    args_cls = get_spec(model_type).args_cls
    known = {f.name for f in dataclasses.fields(args_cls)}
    unknown = sorted(set(arch) - known)
    if unknown:
        raise ValueError(f"model.arch has keys {unknown} that {model_type} does not know; known: {sorted(known)}")
    args = args_cls(**arch)
    args.validate()
    return with_vision(args, vision)


def all_training_knobs() -> set[str]:
    """Every registered family's training knobs (``models.args.knob``): the keys conf/model/hf.yaml lists."""
    return {name for spec in _REGISTRY.values() for name in training_knobs(spec.args_cls)}


def arch_given(arch: dict[str, Any]) -> dict[str, Any]:
    """The ``model.arch`` keys a ``model=hf`` config sets over config.json's architecture (or, on a resume, the
    checkpoint's): every key but the training knobs that conf/model/hf.yaml leaves null (no knob takes null)."""
    knobs = all_training_knobs()
    return {key: value for key, value in arch.items() if not (value is None and key in knobs)}


register(ModelSpec("qwen3_moe", Qwen3MoeArgs, Qwen3MoeForCausalLM, "Qwen3MoeForCausalLM"))
# Qwen3.5-MoE: the text model's checkpoints, and the published multimodal ones (text under language_model, the
# vision tower under model.visual: loaded and trained where model.vision=true, else not built and carried to the
# export). Without a source a model without a tower exports as the text model, one with a tower as the multimodal one.
# The MTP head (mtp.*, trained where model.arch.mtp_loss_weight > 0) has the same names in both.
_QWEN3_5_CP_HEADS = (("num_attention_heads", "num_key_value_heads"), ("linear_num_value_heads", "linear_num_key_heads"))
_QWEN3_5 = dict(cp_heads=_QWEN3_5_CP_HEADS, hf_names="models.qwen3_5_moe.hf_names", mtp_blocks="mtp.layers",
                vision="visual", vision_blocks="visual.blocks")
register(ModelSpec("qwen3_5_moe_text", Qwen3_5MoeArgs, Qwen3_5MoeForCausalLM, "Qwen3_5MoeForCausalLM",
                   hf_prefixes=(("model.", "model."), ("lm_head.", "lm_head."), ("mtp.", "mtp.")), **_QWEN3_5))
register(ModelSpec("qwen3_5_moe", Qwen3_5MoeArgs, Qwen3_5MoeForCausalLM, "Qwen3_5MoeForConditionalGeneration",
                   hf_prefixes=(("model.language_model.", "model."), ("lm_head.", "lm_head."), ("mtp.", "mtp."),
                                ("model.visual.", "visual.")),
                   hf_export_type="qwen3_5_moe_text", **_QWEN3_5))
