"""Qwen3.5-MoE in plain PyTorch, numerically the same model as transformers' ``Qwen3_5MoeForCausalLM`` (the text
model) and, with its vision tower (``vision.py``), as ``Qwen3_5MoeForConditionalGeneration``.

Parameter names equal transformers 5's in-memory names of the text model, so a transformers state dict loads as is;
the tower is ``visual.*`` here, ``model.visual.*`` there (``ModelSpec.hf_prefixes``). Layers mix Gated DeltaNet
(``linear_attn``) and gated full attention (``self_attn``); every layer has the MoE block.
No parallel plumbing here: ``parallelisms/`` shards this module from the outside.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from models.attention import Attention
from models.footprint import LayerActivations
from models.causal_lm import CausalLMOutput, MoeCausalLM, MoeDecoder, MoeDecoderLayer, MtpBatch
from models.layers import Documents, KnownDocuments
from models.moe import RouterStats
from models.init import ShardedInit, constant
from models.qwen3_5_moe.args import FULL_ATTENTION, Qwen3_5MoeArgs
from models.qwen3_5_moe.deltanet import GatedDeltaNet
from models.qwen3_5_moe.layers import OffsetRMSNorm, SharedExpertMoeBlock, mrope_cos_sin
from models.qwen3_5_moe.vision import VisionInputs, VisionModel, insert_images


class DecoderLayer(MoeDecoderLayer):
    """Gated full attention ((1 + w) q/k norms, partial RoPE, output gate) or Gated DeltaNet, then the MoE block
    with its shared expert."""

    def __init__(self, args: Qwen3_5MoeArgs, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)
        if layer_type == FULL_ATTENTION:
            self.self_attn = Attention(args.hidden_size, args.num_attention_heads, args.num_key_value_heads,
                                       args.head_dim, args.rms_norm_eps, norm=OffsetRMSNorm, gated=True)
        else:
            self.linear_attn = GatedDeltaNet(args)
        self.post_attention_layernorm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = SharedExpertMoeBlock(args)

    def mix(self, h_BTD: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor,
            docs: Documents | None) -> torch.Tensor:
        if self.layer_type == FULL_ATTENTION:
            return self.self_attn(h_BTD, cos_BTr, sin_BTr, docs)
        return self.linear_attn(h_BTD, docs)  # position comes from the recurrence, not from RoPE


class Qwen3_5MoeModel(MoeDecoder):
    def __init__(self, args: Qwen3_5MoeArgs) -> None:
        super().__init__(args, [DecoderLayer(args, kind) for kind in args.resolved_layer_types()],
                         OffsetRMSNorm(args.hidden_size, args.rms_norm_eps))

    def rotary_tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] or [3, B, T] position ids (``mrope_cos_sin``), or multimodal [4, B, T] ones: the text row 0 finds
        the documents, rows 1..3 are the 3-D rotary's (transformers' ``Qwen3_5MoeTextModel`` splits them so)."""
        if position_ids.dim() == 3 and position_ids.shape[0] == 4:
            position_ids = position_ids[1:]
        return mrope_cos_sin(position_ids, self.args, dtype)


class MultiTokenPredictor(nn.Module):
    """Qwen3.5's MTP head (checkpoint names ``mtp.*``): at position t, the embedding of token t+1 and the model's
    final-normed hidden state h_t, each through its own (1 + w) RMSNorm, concatenated in that order, projected back
    to the hidden size by ``fc``, then one full-attention block with the MoE block (same rotary tables and
    documents as the model's), and ``norm``; the model's LM head on that predicts token t+2.

    Read from the published inference implementations: vLLM ``vllm/model_executor/models/qwen3_5_mtp.py``
    (``Qwen3_5MultiTokenPredictor.forward``: ``torch.cat([pre_fc_norm_embedding(embeds), pre_fc_norm_hidden(
    hidden_states)])``, ``fc``, ``layers[0]`` with ``layer_type="full_attention"``, ``norm``; its loader maps
    ``mtp.`` to this module and shares the model's embedding and LM head) and SGLang
    ``python/sglang/srt/models/qwen3_5_mtp.py`` (``Qwen3_5ForCausalLMMTP.forward``, the same order). The hidden state
    they pass is the target model's output, after its final norm."""

    def __init__(self, args: Qwen3_5MoeArgs) -> None:
        super().__init__()
        D, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = OffsetRMSNorm(D, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(D, eps)
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(args, FULL_ATTENTION)])  # the published head has one
        self.norm = OffsetRMSNorm(D, eps)

    def saved_activations(self) -> LayerActivations:
        """Outside its block, kept whatever the checkpointing (only blocks are checkpointed): the embedding of
        t+1 and the block's output (the inputs of two norms), the concatenated fc input, three fp32 rstds. The
        hidden state it reads is the LM head's input, counted there."""
        D = self.fc.out_features
        return LayerActivations(none=4 * D, none_fp32=3, selective=4 * D, selective_fp32=3)

    def forward(self, embeds_BTD: torch.Tensor, h_BTD: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor,
                docs: Documents | None) -> tuple[torch.Tensor, list[RouterStats]]:
        x_BTD = self.fc(torch.cat((self.pre_fc_norm_embedding(embeds_BTD), self.pre_fc_norm_hidden(h_BTD)), dim=-1))
        stats = []
        for layer in self.layers:
            x_BTD, layer_stats = layer(x_BTD, cos_BTr, sin_BTr, docs)
            stats.append(layer_stats)
        return self.norm(x_BTD), stats


class Qwen3_5MoeForCausalLM(MoeCausalLM):
    """The text model, with the vision tower (``visual``, transformers' ``model.visual``) where
    ``args.vision_config`` is set: then ``images`` (``models.qwen3_5_moe.vision.vision_inputs``) puts the tower's
    tokens in place of the image pad tokens before the blocks. Without a tower the model is the text model alone."""

    decoder_cls = Qwen3_5MoeModel

    def __init__(self, args: Qwen3_5MoeArgs) -> None:
        super().__init__(args)
        if args.mtp_loss_weight > 0:
            self.mtp = MultiTokenPredictor(args)
        if args.vision_config is not None:
            args.validate_vision()
            self.visual = VisionModel(args.vision_config)

    def forward(self, input_ids_BT: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels_BT: torch.Tensor | None = None, packed: bool | KnownDocuments | None = None,
                trained_rows: torch.Tensor | None = None, mtp: MtpBatch | None = None,
                images: VisionInputs | None = None) -> CausalLMOutput:
        """``MoeCausalLM.forward``, and ``images``: this micro-batch's images (a dummy where it has none, in a run
        with images: every rank runs the tower), their tokens in place of the image pad tokens. Position ids are
        then the multimodal [4, B, T] (text row, then t, h, w)."""
        insert = None
        if images is not None:
            if self.visual is None:
                raise ValueError("images for a model without a vision tower: train with model.vision=true (and "
                                 "model.arch.vision_config set)")
            with torch.profiler.record_function("vision tower"):  # its forward, by name in a profile's trace
                tokens_UD = self.visual(images)
            insert = functools.partial(insert_images, tokens_UD=tokens_UD, images=images)
        return super().forward(input_ids_BT, position_ids, labels_BT, packed, trained_rows, mtp, insert)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """``MoeCausalLM.init_weights``, then the vision tower's own (``VisionModel.init_weights``)."""
        super().init_weights(seed)
        if self.visual is not None:
            self.visual.init_weights(ShardedInit(self, seed))

    def init_module(self, module: nn.Module, init: ShardedInit) -> None:
        """DeltaNet's dt_bias 1 and A_log = log U(0.01, 16) (kept away from 0 so that A_log stays finite), as
        transformers; the (1 + w) norms start at 0 and the gated norm at 1 through their ``init_value``."""
        if isinstance(module, GatedDeltaNet):
            init(module.dt_bias, constant(1.0))
            init(module.A_log, lambda t, g: t.uniform_(0.01, 16, generator=g).log_())
