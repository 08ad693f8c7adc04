"""Qwen3-MoE in plain PyTorch, numerically the same model as transformers' ``Qwen3MoeForCausalLM``.

Parameter names equal transformers 5's in-memory names, so a transformers state dict loads as is.
No parallel plumbing here: ``parallelisms/`` shards this module from the outside.
"""

from __future__ import annotations

import torch

from models.attention import Attention
from models.causal_lm import MoeCausalLM, MoeDecoder, MoeDecoderLayer
from models.layers import Documents, RMSNorm, rotary_cos_sin
from models.moe import SparseMoeBlock
from models.qwen3_moe.args import Qwen3MoeArgs


class DecoderLayer(MoeDecoderLayer):
    """GQA with per-head RMSNorm on q and k before RoPE, then the routed experts."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args.hidden_size, args.num_attention_heads, args.num_key_value_heads,
                                   args.head_dim, args.rms_norm_eps, norm=RMSNorm)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = SparseMoeBlock(args.hidden_size, args.num_experts, args.num_experts_per_tok,
                                  args.moe_intermediate_size, args.norm_topk_prob,
                                  expert_bias=args.router_bias_update_rate > 0, z_loss=args.router_z_loss_coef > 0,
                                  force_balance=args.router_force_balance)

    def mix(self, h_BTD: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor,
            docs: Documents | None) -> torch.Tensor:
        return self.self_attn(h_BTD, cos_BTr, sin_BTr, docs)


class Qwen3MoeModel(MoeDecoder):
    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__(args, [DecoderLayer(args) for _ in range(args.num_hidden_layers)],
                         RMSNorm(args.hidden_size, args.rms_norm_eps))

    def rotary_tables(self, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(position_ids_BT, self.args.head_dim, self.args.rope_theta, dtype)


class Qwen3MoeForCausalLM(MoeCausalLM):
    decoder_cls = Qwen3MoeModel
