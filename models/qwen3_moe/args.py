"""Qwen3-MoE hyper-parameters, named as in transformers' ``Qwen3MoeConfig`` / config.json."""

from __future__ import annotations

from dataclasses import dataclass

from models.args import MoeArgs


@dataclass
class Qwen3MoeArgs(MoeArgs):
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1

    def validate(self) -> None:
        super().validate()
        if self.head_dim % 2:
            raise ValueError(f"model.arch.head_dim={self.head_dim} must be even for rotary embeddings")

    def param_counts(self) -> tuple[int, int, int]:
        """(total, active per token, embedding) parameter counts."""
        D, L, E, K = self.hidden_size, self.num_hidden_layers, self.num_experts, self.num_experts_per_tok
        d, H, h = self.head_dim, self.num_attention_heads, self.num_key_value_heads
        attn = D * d * (H + 2 * h) + H * d * D + 2 * d
        expert = 3 * D * self.moe_intermediate_size
        dense_per_layer = attn + E * D + 2 * D  # + router + two norms
        embed = self.vocab_size * D
        head = self.lm_head_params()
        total = embed + head + D + L * (dense_per_layer + E * expert)
        active = embed + head + D + L * (dense_per_layer + K * expert)
        return total, active, embed

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as torchtitan counts them: 6 x active non-embedding params (LM head
        included) + 12 x layers x heads x head_dim x seq_len for causal attention scores and values."""
        _, active, embed = self.param_counts()
        attention = 12 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * seq_len
        return 6 * (active - embed) + attention
