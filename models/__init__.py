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


def build_args(model_type: str, arch: dict[str, Any]):
    """Hyper-parameter dataclass of the family from a dict, rejecting keys the family does not have."""
    args_cls = get_spec(model_type).args_cls
    known = {f.name for f in dataclasses.fields(args_cls)}
    unknown = sorted(set(arch) - known)
    if unknown:
        raise ValueError(f"model.arch has keys {unknown} that {model_type} does not know; known: {sorted(known)}")
    args = args_cls(**arch)
    args.validate()
    return args


def all_training_knobs() -> set[str]:
    """Every registered family's training knobs (``models.args.knob``): the keys conf/model/hf.yaml lists."""
    return {name for spec in _REGISTRY.values() for name in training_knobs(spec.args_cls)}


def arch_given(arch: dict[str, Any]) -> dict[str, Any]:
    """The ``model.arch`` keys a ``model=hf`` config sets over config.json's architecture (or, on a resume, the
    checkpoint's): every key but the training knobs that conf/model/hf.yaml leaves null (no knob takes null)."""
    knobs = all_training_knobs()
    return {key: value for key, value in arch.items() if not (value is None and key in knobs)}


register(ModelSpec("qwen3_moe", Qwen3MoeArgs, Qwen3MoeForCausalLM, "Qwen3MoeForCausalLM"))
# Qwen3.5-MoE: the text model's checkpoints, and the published multimodal ones (text under language_model; the
# vision tower matches no prefix: not trained, carried to the export). Without a source both export as the text model.
# The MTP head (mtp.*, trained where model.arch.mtp_loss_weight > 0) has the same names in both.
_QWEN3_5_CP_HEADS = (("num_attention_heads", "num_key_value_heads"), ("linear_num_value_heads", "linear_num_key_heads"))
_QWEN3_5 = dict(cp_heads=_QWEN3_5_CP_HEADS, hf_names="models.qwen3_5_moe.hf_names", mtp_blocks="mtp.layers")
register(ModelSpec("qwen3_5_moe_text", Qwen3_5MoeArgs, Qwen3_5MoeForCausalLM, "Qwen3_5MoeForCausalLM",
                   hf_prefixes=(("model.", "model."), ("lm_head.", "lm_head."), ("mtp.", "mtp.")), **_QWEN3_5))
register(ModelSpec("qwen3_5_moe", Qwen3_5MoeArgs, Qwen3_5MoeForCausalLM, "Qwen3_5MoeForCausalLM",
                   hf_prefixes=(("model.language_model.", "model."), ("lm_head.", "lm_head."), ("mtp.", "mtp.")),
                   hf_export_type="qwen3_5_moe_text", **_QWEN3_5))
