"""Grouped-query attention as both families write it: q/k/v/o projections, a per-head norm on q and k before the
rotary embedding (a kernel slot), the core attention over the whole sequence (a sequence op), and optionally
Qwen3.5's output gate (q_proj emits [q_h | gate_h] per head; out = o_proj(attn * sigmoid(gate)))."""

from __future__ import annotations

from typing import Callable, ClassVar, Mapping

import torch
import torch.nn as nn

from kernels.tokenwise.rotary import apply_rotary
from models.footprint import LayerActivations, SequenceExchange
from models.layers import DenseMaskAttention, Documents
from models.sequence_ops import Heads, Passed, SequenceOp

# q [B, H, t, d] and k, v [B, h, t, d] (shared by the query heads), the documents whole; the output like q.
CORE_ATTENTION = SequenceOp(args=(Heads(seq_dim=2, head_dim=1), Heads(2, 1, shared=True), Heads(2, 1, shared=True),
                                  Passed()), out=Heads(2, 1))


class Attention(nn.Module):
    """GQA, causal within packed documents (the ``attention`` slot: ``kernels/attention/attention.py``).
    ``norm(dim, eps)`` builds the q/k norms (RMSNorm, or Qwen3.5's (1 + w) form)."""

    kernel_slots: ClassVar[Mapping[str, str]] = {"rotary": "apply_rotary", "attention": "document_attention"}
    sequence_ops: ClassVar[Mapping[str, SequenceOp]] = {"core_attention": CORE_ATTENTION}

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 norm: Callable[[int, float], nn.Module], gated: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.gated = num_heads, num_kv_heads, head_dim, gated
        D = hidden_size
        self.q_proj = nn.Linear(D, num_heads * head_dim * (2 if gated else 1), bias=False)
        self.k_proj = nn.Linear(D, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(D, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, D, bias=False)
        self.q_norm = norm(head_dim, eps)
        self.k_norm = norm(head_dim, eps)
        self.rotary = apply_rotary
        self.attention = DenseMaskAttention()

    def forward(self, x_BTD: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor,
                docs: Documents | None = None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BTHd = self.q_proj(x_BTD).view(B, T, self.num_heads, -1)
        q_BTHd, gate_BTHd = q_BTHd.chunk(2, dim=-1) if self.gated else (q_BTHd, None)
        q_BHTd = self.q_norm(q_BTHd).transpose(1, 2)
        k_BhTd = self.k_norm(self.k_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v_BhTd = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q_BHTd, k_BhTd = self.rotary(q_BHTd, cos_BTr, sin_BTr), self.rotary(k_BhTd, cos_BTr, sin_BTr)
        o_BTHd = self.core_attention(q_BHTd, k_BhTd, v_BhTd, docs).transpose(1, 2)
        if gate_BTHd is not None:
            o_BTHd = o_BTHd * torch.sigmoid(gate_BTHd)
        return self.o_proj(o_BTHd.reshape(B, T, -1))

    def core_attention(self, q_BHTd: torch.Tensor, k_BhTd: torch.Tensor, v_BhTd: torch.Tensor,
                       docs: Documents | None) -> torch.Tensor:
        """Attention over the whole sequence on the heads given (a sequence op: CP passes a head shard)."""
        return self.attention(q_BHTd, k_BhTd, v_BhTd, docs, self.head_dim**-0.5)

    def saved_activations(self) -> LayerActivations:
        """Per token, with the pre-norm before it. Without checkpointing: the norm's input and output, q and k before
        their norms (+ rstd per head), q and k after rotary, v, the attention output (+ logsumexp per head); gated:
        q_proj's output is [q | gate], and sigmoid(gate) and the gated output are kept too. Selective: the
        projections' outputs, the attention output, o_proj's output."""
        D, q, kv = self.o_proj.out_features, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        proj = q * (2 if self.gated else 1) + 2 * kv
        none = 2 * D + proj + kv + 2 * q + (2 * q if self.gated else 0)
        return LayerActivations(none=none, none_fp32=1 + 2 * self.num_heads + self.num_kv_heads,
                                selective=proj + q + D, selective_fp32=self.num_heads)

    def cp_exchange(self, cp: int) -> SequenceExchange:
        """Per token: q, and k and v with their heads repeated to cp when fewer; back, the output like q."""
        kv = self.num_kv_heads if self.num_kv_heads % cp == 0 else cp
        return SequenceExchange(into=(self.num_heads + 2 * kv) * self.head_dim, into_fp32=0,
                                out=self.num_heads * self.head_dim)
