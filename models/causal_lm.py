"""The part every family shares: a decoder (embeddings, blocks, final norm) under an LM head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch
import torch.nn as nn

from kernels.linear_cross_entropy import SoftmaxCrossEntropy, linear_cross_entropy_sum, softmax_cross_entropy_
from models.moe import RouterStats


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # [B, T, V]; None when the loss was asked for instead
    router_stats: list[RouterStats]  # one per MoE layer
    loss_sum: torch.Tensor | None = None  # fp32 summed token cross-entropy over labels != -100


class LMHead(nn.Linear):
    """``nn.Linear`` to the vocabulary that can also return the summed cross-entropy without materialising
    the logits (``kernels.linear_cross_entropy``). It stays one module called through ``__call__`` so that
    FSDP's hooks gather the weight either way. The per-chunk softmax + gradient is a kernel slot."""

    kernel_slots: ClassVar[Mapping[str, str]] = {"ce_fn": "softmax_cross_entropy"}

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.ce_fn: SoftmaxCrossEntropy = softmax_cross_entropy_

    def forward(self, h_BTD: torch.Tensor, labels_BT: torch.Tensor | None = None) -> torch.Tensor:
        if labels_BT is None:
            return super().forward(h_BTD)
        return linear_cross_entropy_sum(h_BTD.flatten(0, 1), self.weight, labels_BT.flatten(), ce_fn=self.ce_fn)


class MoeCausalLM(nn.Module):
    """``model`` (the family's ``decoder_cls``, built from ``args``) and ``lm_head``, with transformers' names.
    A family subclass sets ``decoder_cls`` and writes ``init_weights``."""

    decoder_cls: ClassVar[type[nn.Module]]

    def __init__(self, args: Any) -> None:
        super().__init__()
        self.args = args
        self.model = self.decoder_cls(args)
        self.lm_head = LMHead(args.hidden_size, args.vocab_size)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids_BT: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels_BT: torch.Tensor | None = None) -> CausalLMOutput:
        """``position_ids`` [B, T] (or a family's multimodal [3, B, T]); default 0..T-1 for every row.
        With ``labels_BT`` (already shifted, -100 = ignore) the output has ``loss_sum`` and no logits."""
        if position_ids is None:
            position_ids = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device).expand_as(input_ids_BT)
        h_BTD, stats = self.model(input_ids_BT, position_ids)
        if labels_BT is None:
            return CausalLMOutput(logits=self.lm_head(h_BTD), router_stats=stats)
        return CausalLMOutput(logits=None, router_stats=stats, loss_sum=self.lm_head(h_BTD, labels_BT))
