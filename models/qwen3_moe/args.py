"""Qwen3-MoE hyper-parameters, named as in transformers' ``Qwen3MoeConfig`` / config.json."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Qwen3MoeArgs:
    vocab_size: int = 151936
    hidden_size: int = 2048
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = True
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.001
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.arch.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"model.arch.num_key_value_heads={self.num_key_value_heads}"
            )
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model.arch.num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
                f"model.arch.num_experts={self.num_experts}]"
            )
        if self.head_dim % 2:
            raise ValueError(f"model.arch.head_dim={self.head_dim} must be even for rotary embeddings")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "moe_intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.arch.{name}={getattr(self, name)} must be positive")

    def param_counts(self) -> tuple[int, int, int]:
        """(total, active per token, embedding) parameter counts."""
        D, L, E, K = self.hidden_size, self.num_hidden_layers, self.num_experts, self.num_experts_per_tok
        hd, H, Hkv = self.head_dim, self.num_attention_heads, self.num_key_value_heads
        attn = D * hd * (H + 2 * Hkv) + H * hd * D + 2 * hd
        expert = 3 * D * self.moe_intermediate_size
        dense_per_layer = attn + E * D + 2 * D  # + router + two norms
        embed = self.vocab_size * D
        head = 0 if self.tie_word_embeddings else self.vocab_size * D
        total = embed + head + D + L * (dense_per_layer + E * expert)
        active = embed + head + D + L * (dense_per_layer + K * expert)
        return total, active, embed

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as torchtitan counts them: 6 x active non-embedding params (LM head
        included) + 12 x layers x heads x head_dim x seq_len for causal attention scores and values."""
        _, active, embed = self.param_counts()
        attention = 12 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * seq_len
        return 6 * (active - embed) + attention
