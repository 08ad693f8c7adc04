"""Qwen3.5-MoE (text): Gated DeltaNet and gated full attention layers, MoE with a shared expert on every layer.

Shape letters as in ``models/layers.py``, plus: d head dim, r rotary channels (head_dim x partial_rotary_factor),
F DeltaNet's [q | k | v] conv channels, v value head dim; ``kernels/delta_rule.py`` defines its own (value heads H there).
"""

from models.qwen3_5_moe.args import Qwen3_5MoeArgs
from models.qwen3_5_moe.model import Qwen3_5MoeForCausalLM

__all__ = ["Qwen3_5MoeArgs", "Qwen3_5MoeForCausalLM"]
