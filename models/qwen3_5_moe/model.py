"""Qwen3.5-MoE (text) in plain PyTorch, numerically the same model as transformers' ``Qwen3_5MoeForCausalLM``.

Parameter names equal transformers 5's in-memory names, so a transformers state dict loads as is. Layers mix
Gated DeltaNet (``linear_attn``) and gated full attention (``self_attn``); every layer has the MoE block.
No parallel plumbing here: ``parallelisms/`` shards this module from the outside.
"""

from __future__ import annotations

from typing import ClassVar, Mapping

import torch
import torch.nn as nn

from models.causal_lm import MoeCausalLM
from models.layers import RMSNorm, document_ids
from models.init import ShardedInit, constant, normal
from models.moe import GroupedExperts, RouterStats, TopKRouter
from models.qwen3_5_moe.args import FULL_ATTENTION, Qwen3_5MoeArgs
from models.qwen3_5_moe.deltanet import GatedDeltaNet
from models.qwen3_5_moe.layers import GatedAttention, OffsetRMSNorm, SharedExpertMoeBlock, mrope_cos_sin


class DecoderLayer(nn.Module):
    def __init__(self, args: Qwen3_5MoeArgs, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)
        if layer_type == FULL_ATTENTION:
            self.self_attn = GatedAttention(args)
        else:
            self.linear_attn = GatedDeltaNet(args)
        self.post_attention_layernorm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = SharedExpertMoeBlock(args)

    def forward(self, x_BTD: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor,
                doc_ids_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, RouterStats]:
        h_BTD = self.input_layernorm(x_BTD)
        if self.layer_type == FULL_ATTENTION:
            x_BTD = x_BTD + self.self_attn(h_BTD, cos_BTr, sin_BTr, doc_ids_BT)
        else:
            x_BTD = x_BTD + self.linear_attn(h_BTD, doc_ids_BT)  # position comes from the recurrence, not from RoPE
        moe_BTD, stats = self.mlp(self.post_attention_layernorm(x_BTD))
        return x_BTD + moe_BTD, stats


class Qwen3_5MoeModel(nn.Module):
    sequence_ops: ClassVar[Mapping[str, str]] = {"find_documents": "documents"}

    def __init__(self, args: Qwen3_5MoeArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, kind) for kind in args.resolved_layer_types())
        self.norm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, input_ids_BT: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, list[RouterStats]]:
        h_BTD = self.embed_tokens(input_ids_BT)
        cos_BTr, sin_BTr = mrope_cos_sin(position_ids, self.args, h_BTD.dtype)
        doc_ids_BT = self.find_documents(position_ids)
        stats = []
        for layer in self.layers:
            h_BTD, layer_stats = layer(h_BTD, cos_BTr, sin_BTr, doc_ids_BT)
            stats.append(layer_stats)
        return self.norm(h_BTD), stats

    def find_documents(self, position_ids: torch.Tensor) -> torch.Tensor | None:
        """Document ids of the whole sequence (a sequence op: under CP, of every cp rank's position ids)."""
        return document_ids(position_ids)


class Qwen3_5MoeForCausalLM(MoeCausalLM):
    decoder_cls = Qwen3_5MoeModel

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """transformers' init: N(0, initializer_range) for matrices, convolutions and embeddings; (1 + w) norms 0,
        the gated norm 1; DeltaNet's dt_bias 1 and A_log = log U(0.01, 16) (kept away from 0 so that A_log stays
        finite). The values depend on the seed and parameter names only, not on the parallel layout."""
        init, std = ShardedInit(self, seed), normal(self.args.initializer_range)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, TopKRouter)):
                init(module.weight, std)
            elif isinstance(module, RMSNorm):
                init(module.weight, constant(module.init_value))
            elif isinstance(module, GatedDeltaNet):
                init(module.dt_bias, constant(1.0))
                init(module.A_log, lambda t, g: t.uniform_(0.01, 16, generator=g).log_())
            elif isinstance(module, GroupedExperts):
                init(module.gate_up_proj, std)
                init(module.down_proj, std)
