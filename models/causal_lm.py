"""The part every family shares: a decoder (embeddings, blocks, final norm) under an LM head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn

from models.moe import RouterStats


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, T, V]
    router_stats: list[RouterStats]  # one per MoE layer


class MoeCausalLM(nn.Module):
    """``model`` (the family's ``decoder_cls``, built from ``args``) and ``lm_head``, with transformers' names.
    A family subclass sets ``decoder_cls`` and writes ``init_weights``."""

    decoder_cls: ClassVar[type[nn.Module]]

    def __init__(self, args: Any) -> None:
        super().__init__()
        self.args = args
        self.model = self.decoder_cls(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids_BT: torch.Tensor, position_ids: torch.Tensor | None = None) -> CausalLMOutput:
        """``position_ids`` [B, T] (or a family's multimodal [3, B, T]); default 0..T-1 for every row."""
        if position_ids is None:
            position_ids = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device).expand_as(input_ids_BT)
        h_BTD, stats = self.model(input_ids_BT, position_ids)
        return CausalLMOutput(logits=self.lm_head(h_BTD), router_stats=stats)
