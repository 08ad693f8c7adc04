"""Qwen3-MoE in plain PyTorch, numerically the same model as transformers' ``Qwen3MoeForCausalLM``.

Parameter names equal transformers 5's in-memory names, so a transformers state dict loads as is.
No parallel plumbing here: ``parallelisms/`` shards this module from the outside.
"""

from __future__ import annotations

from typing import ClassVar, Mapping

import torch
import torch.nn as nn

from models.causal_lm import MoeCausalLM
from models.init import ShardedInit, constant, normal
from models.layers import RMSNorm, apply_rotary, causal_attention, document_ids, rotary_cos_sin
from models.moe import GroupedExperts, RouterStats, SparseMoeBlock, TopKRouter
from models.qwen3_moe.args import Qwen3MoeArgs


class Attention(nn.Module):
    """GQA with per-head RMSNorm on q and k before RoPE, through torch SDPA."""

    kernel_slots: ClassVar[Mapping[str, str]] = {"rotary": "apply_rotary"}
    sequence_ops: ClassVar[Mapping[str, str]] = {"core_attention": "attention"}

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_attention_heads, args.num_key_value_heads, args.head_dim)
        D = args.hidden_size
        self.q_proj = nn.Linear(D, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, D, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.rotary = apply_rotary

    def forward(self, x_BTD: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor,
                doc_ids_BT: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BHTd = self.q_norm(self.q_proj(x_BTD).view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        k_BHTd = self.k_norm(self.k_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v_BHTd = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q_BHTd, k_BHTd = self.rotary(q_BHTd, cos_BTd, sin_BTd), self.rotary(k_BHTd, cos_BTd, sin_BTd)
        o_BHTd = self.core_attention(q_BHTd, k_BHTd, v_BHTd, doc_ids_BT)
        return self.o_proj(o_BHTd.transpose(1, 2).reshape(B, T, -1))

    def core_attention(self, q_BHTd: torch.Tensor, k_BHTd: torch.Tensor, v_BHTd: torch.Tensor,
                       doc_ids_BT: torch.Tensor | None) -> torch.Tensor:
        """Attention over the whole sequence on the heads given (a sequence op: CP passes a head shard)."""
        return causal_attention(q_BHTd, k_BHTd, v_BHTd, doc_ids_BT, scale=self.head_dim**-0.5)


class DecoderLayer(nn.Module):
    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = SparseMoeBlock(args.hidden_size, args.num_experts, args.num_experts_per_tok,
                                  args.moe_intermediate_size, args.norm_topk_prob)

    def forward(self, x_BTD: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor,
                doc_ids_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, RouterStats]:
        x_BTD = x_BTD + self.self_attn(self.input_layernorm(x_BTD), cos_BTd, sin_BTd, doc_ids_BT)
        moe_BTD, stats = self.mlp(self.post_attention_layernorm(x_BTD))
        return x_BTD + moe_BTD, stats


class Qwen3MoeModel(nn.Module):
    sequence_ops: ClassVar[Mapping[str, str]] = {"find_documents": "documents"}

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor
                ) -> tuple[torch.Tensor, list[RouterStats]]:
        h_BTD = self.embed_tokens(input_ids_BT)
        cos_BTd, sin_BTd = rotary_cos_sin(position_ids_BT, self.args.head_dim, self.args.rope_theta, h_BTD.dtype)
        doc_ids_BT = self.find_documents(position_ids_BT)
        stats = []
        for layer in self.layers:
            h_BTD, layer_stats = layer(h_BTD, cos_BTd, sin_BTd, doc_ids_BT)
            stats.append(layer_stats)
        return self.norm(h_BTD), stats

    def find_documents(self, position_ids_BT: torch.Tensor) -> torch.Tensor | None:
        """Document ids of the whole sequence (a sequence op: under CP, of every cp rank's position ids)."""
        return document_ids(position_ids_BT)


class Qwen3MoeForCausalLM(MoeCausalLM):
    decoder_cls = Qwen3MoeModel

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """transformers' init: N(0, initializer_range) for matrices and embeddings, ones for norms; the
        values depend on the seed and parameter names only, not on the parallel layout."""
        init, std = ShardedInit(self, seed), normal(self.args.initializer_range)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, TopKRouter)):
                init(module.weight, std)
            elif isinstance(module, RMSNorm):
                init(module.weight, constant(module.init_value))
            elif isinstance(module, GroupedExperts):
                init(module.gate_up_proj, std)
                init(module.down_proj, std)
