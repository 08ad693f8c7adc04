from models.qwen3_moe.args import Qwen3MoeArgs
from models.qwen3_moe.model import Qwen3MoeForCausalLM

__all__ = ["Qwen3MoeArgs", "Qwen3MoeForCausalLM"]
