"""Qwen3.5-MoE: Gated DeltaNet and gated full attention layers, MoE with a shared expert on every layer, and the
vision tower of the published multimodal model (``vision.py``).

Letters as in DEVELOPERS.md (in DeltaNet H are the value heads, h the query/key heads; r = head_dim x
partial_rotary_factor rotary channels; the tower's J, U, Y, A).
"""

from models.qwen3_5_moe.args import Qwen3_5MoeArgs, VisionArgs
from models.qwen3_5_moe.model import Qwen3_5MoeForCausalLM

__all__ = ["Qwen3_5MoeArgs", "Qwen3_5MoeForCausalLM", "VisionArgs"]
