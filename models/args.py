"""The hyper-parameters every family has, named as in transformers' configs: sizes, attention heads, the MoE block
and its router, initialisation. A family's args dataclass extends ``MoeArgs`` with its own fields and defaults."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

_TRAINING_KNOB = "training_knob"


def knob(default: Any) -> Any:
    """A field of how the model is trained, not of its architecture or weights (a loss weight or coefficient, the
    routers' balancing): ``model=hf`` takes it from ``model.arch`` over config.json, and ``conf/model/hf.yaml`` lists
    every family's, so that it is set as in the presets, without a leading ``+``."""
    return dataclasses.field(default=default, metadata={_TRAINING_KNOB: True})


def training_knobs(args_cls: type) -> list[str]:
    """The fields of a family's args dataclass declared ``knob``."""
    return [f.name for f in dataclasses.fields(args_cls) if f.metadata.get(_TRAINING_KNOB)]


@dataclass
class MoeArgs:
    vocab_size: int = 151936
    hidden_size: int = 2048
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    # MoE on every layer: num_experts_per_tok of num_experts routed experts (TopKRouter), each a SwiGLU of
    # moe_intermediate_size; the Switch aux loss is added with router_aux_loss_coef.
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    router_aux_loss_coef: float = knob(0.001)
    # Training-only router knobs (not in config.json): the router z-loss (ST-MoE: mean over layers and tokens of
    # logsumexp(router logits)^2) added with this coefficient; aux-loss-free balancing (DeepSeek-V3): a per-expert
    # routing bias moved by this much per step from the global expert loads (0: off, no bias)
    router_z_loss_coef: float = knob(0.0)
    router_bias_update_rate: float = knob(0.0)
    # Benchmarks only (torchtitan's debug.moe_force_load_balance): every router sends token slot i to expert i mod E
    # (round robin: equal loads whatever the data), its weights still the softmax's, so throughput compares the
    # data path, not an untrained router's collapse. What the experts learn is then not a model anyone wants.
    router_force_balance: bool = knob(False)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02

    def lm_head_params(self) -> int:
        """The LM head's own parameters: none when it is the tied embedding (counted as the embedding)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def validate(self) -> None:
        """Raise ValueError naming the ``model.arch`` key; a family adds its own checks after these."""
        for f in dataclasses.fields(self):  # nan passes every comparison (a nan weight would mean "off"): none is one
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"model.arch.{f.name}={value} must be a finite number")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim", "moe_intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.arch.{name}={getattr(self, name)} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"model.arch.num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"model.arch.num_key_value_heads={self.num_key_value_heads}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.arch.{name}={getattr(self, name)} must be >= 0 (0 turns it off)")
        if self.rope_theta <= 0:
            raise ValueError(f"model.arch.rope_theta={self.rope_theta} must be positive (the rotary base)")
        for name in ("rms_norm_eps", "initializer_range"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.arch.{name}={getattr(self, name)} must be >= 0")
        if self.router_force_balance and self.router_bias_update_rate > 0:
            raise ValueError(f"model.arch.router_force_balance=true routes round robin, so "
                             f"model.arch.router_bias_update_rate={self.router_bias_update_rate} has no loads to "
                             f"balance; set it to 0")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"model.arch.num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
                             f"model.arch.num_experts={self.num_experts}]")
