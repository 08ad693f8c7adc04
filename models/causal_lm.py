"""The part every family shares: a decoder (embeddings, blocks, final norm) under an LM head, the block's
residual structure, and the weight-init loop. A family supplies its blocks' token mixers, its rotary tables and
any parameter the init loop does not know."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, NamedTuple

import torch
import torch.nn as nn

from core.constants import IGNORE_INDEX
from core.device import queued_copy
from kernels.loss.linear_cross_entropy import SoftmaxCrossEntropy, linear_cross_entropy_sum, softmax_cross_entropy_
from models.init import ShardedInit, constant, normal
from models.layers import DenseMaskAttention, Documents, KnownDocuments, RMSNorm, document_ids, text_positions
from models.moe import GroupedExperts, RouterStats, TopKRouter
from models.sequence_ops import Passed, SequenceOp, WholeSequence

# Documents need the whole sequence's position ids (under CP every rank's: gathered); whether it is packed is known
# for the whole sequence already.
FIND_DOCUMENTS = SequenceOp(args=(WholeSequence(dim=-1), Passed()), out=None)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # [B, T, V]; None when the loss was asked for instead
    router_stats: list[RouterStats]  # one per MoE layer (the MTP head's last, where it ran)
    loss_sum: torch.Tensor | None = None  # fp32 summed token cross-entropy over labels != -100
    # The MTP head's, where it ran (``mtp`` given): its logits at t (for token t+2) or its summed cross-entropy.
    mtp_logits: torch.Tensor | None = None
    mtp_loss_sum: torch.Tensor | None = None


class MtpBatch(NamedTuple):
    """What a multi-token-prediction head reads and predicts at each position t of a batch (``mtp_batch``)."""

    input_ids_BT: torch.Tensor  # token t+1 (the last position: any id, its label is ignored)
    labels_BT: torch.Tensor  # token t+2, -100 where not trained
    trained_rows: torch.Tensor | None = None  # as ``trained_rows`` of labels_BT


def mtp_batch(input_ids_BT: torch.Tensor, labels_BT: torch.Tensor, position_ids: torch.Tensor
              ) -> dict[str, torch.Tensor]:
    """The MTP head's ``mtp_input_ids`` and ``mtp_labels`` [B, T] of a whole window (before a context-parallel split,
    so that the shift by one crosses the cp shards as it does one process's rows). At t: token t+1 (input_ids at
    t+1) and its label, token t+2 (labels at t+1). Ignored (-100): the last position (no token t+2 in the window),
    labels ignored for the main loss at t+1, and pairs that cross a document end of packed rows (token t+1 or t+2
    starts a document, from position ids [B, T] or the text row of multimodal [4, B, T] ones, as ``document_ids``
    reads them; [3, B, T] ones: one document)."""
    mtp_labels_BT = labels_BT.roll(-1, dims=1)
    mtp_labels_BT[:, -1] = IGNORE_INDEX
    position_ids = text_positions(position_ids)
    if position_ids.dim() == 2:
        starts_BT = torch.zeros_like(labels_BT, dtype=torch.bool)  # t > 0 starts a document
        starts_BT[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
        # t+1 or t+2 starts one; the wrap-around reaches only the last position, ignored already.
        mtp_labels_BT[starts_BT.roll(-1, dims=1) | starts_BT.roll(-2, dims=1)] = IGNORE_INDEX
    return {"mtp_input_ids": input_ids_BT.roll(-1, dims=1), "mtp_labels": mtp_labels_BT}


class LMHead(nn.Linear):
    """``nn.Linear`` to the vocabulary that can also return the summed cross-entropy without materialising
    the logits (``kernels.loss.linear_cross_entropy``). It stays one module called through ``__call__`` so that
    FSDP's hooks gather the weight either way. The per-chunk softmax + gradient is a kernel slot."""

    kernel_slots: ClassVar[Mapping[str, str]] = {"ce_fn": "softmax_cross_entropy"}

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.ce_fn: SoftmaxCrossEntropy = softmax_cross_entropy_

    def forward(self, h_BTD: torch.Tensor, labels_BT: torch.Tensor | None = None,
                rows_N: torch.Tensor | None = None, mtp: tuple[torch.Tensor, MtpBatch] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The logits, or with ``labels_BT`` the summed cross-entropy; ``rows_N`` (``trained_rows``): only these
        flat rows' logits are computed (the others' labels are ignored: no loss, zero gradient). ``mtp``: the MTP
        head's output and batch; its summed cross-entropy is returned second, from the same call, so that FSDP's
        hooks gather the shared weight once and reduce its gradient once."""
        if labels_BT is None:
            return super().forward(h_BTD)
        loss = self.loss_sum(h_BTD, labels_BT, rows_N)
        return loss if mtp is None else (loss, self.loss_sum(mtp[0], mtp[1].labels_BT, mtp[1].trained_rows))

    def loss_sum(self, h_BTD: torch.Tensor, labels_BT: torch.Tensor, rows_N: torch.Tensor | None) -> torch.Tensor:
        h_ND, labels_N = h_BTD.flatten(0, 1), labels_BT.flatten()
        if rows_N is not None:
            h_ND, labels_N = h_ND.index_select(0, rows_N), labels_N.index_select(0, rows_N)
        return linear_cross_entropy_sum(h_ND, self.weight, labels_N, ce_fn=self.ce_fn)


def trained_rows(labels_BT: torch.Tensor, dev: torch.device) -> torch.Tensor | None:
    """The ``trained_rows`` a forward on ``dev`` takes, from the host copy of a batch's labels: None when every label
    is trained, else the flat indices [N] (into ``labels_BT.flatten()``) of the labels != IGNORE_INDEX, queued to
    ``dev`` (no wait), so the LM head computes no logits for ignored rows and the device is asked nothing."""
    trained_N = labels_BT.flatten() != IGNORE_INDEX
    if trained_N.all():
        return None
    return queued_copy(trained_N.nonzero().squeeze(1), dev)


class MoeDecoderLayer(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + moe(norm(x)). A family builds ``input_layernorm``,
    its token mixer, ``post_attention_layernorm`` and ``mlp`` (a MoE block returning (out, RouterStats)), and says
    in ``mix`` how the mixer is called."""

    def mix(self, h_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            docs: Documents | None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Documents | None = None) -> tuple[torch.Tensor, RouterStats]:
        x_BTD = x_BTD + self.mix(self.input_layernorm(x_BTD), cos, sin, docs)
        moe_BTD, stats = self.mlp(self.post_attention_layernorm(x_BTD))
        return x_BTD + moe_BTD, stats


class DecoderOutput(NamedTuple):
    h_BTD: torch.Tensor  # the last block's output, final-normed (what the LM head reads)
    router_stats: list[RouterStats]
    mtp_embeds_BTD: torch.Tensor | None  # the embeddings of the MTP head's ids, where asked for
    cos: torch.Tensor  # the rotary tables and documents the blocks used, for an MTP head's block
    sin: torch.Tensor
    docs: Documents | None


class MoeDecoder(nn.Module):
    """Embeddings, the blocks and the final norm (transformers' names). A family passes its blocks and norm and
    says in ``rotary_tables`` how position ids become the (cos, sin) its attention takes. Its ``attention`` slot
    holds the same document-attention kernel as every attention layer's: it builds what that kernel needs about the
    batch's documents once, before the layers (``kernels/attention/attention.py``)."""

    kernel_slots: ClassVar[Mapping[str, str]] = {"attention": "document_attention"}
    sequence_ops: ClassVar[Mapping[str, SequenceOp]] = {"find_documents": FIND_DOCUMENTS}

    def __init__(self, args: Any, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.attention = DenseMaskAttention()

    def rotary_tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(self, input_ids_BT: torch.Tensor, position_ids: torch.Tensor,
                packed: bool | KnownDocuments | None = None, mtp_ids_BT: torch.Tensor | None = None,
                insert: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DecoderOutput:
        """``mtp_ids_BT``: ids an MTP head embeds too, in the same call of the embedding (FSDP's hooks run once).
        ``insert``: applied to the token embeddings before the blocks (a family's image tokens put in place of their
        pad tokens), those of ``mtp_ids_BT`` too (after the model's: [2B, T, D]), so that an MTP head reads an image
        token's embedding where its next token is one."""
        ids_BT = input_ids_BT if mtp_ids_BT is None else torch.cat((input_ids_BT, mtp_ids_BT))
        embeds_BTD = self.embed_tokens(ids_BT)
        if insert is not None:
            embeds_BTD = insert(embeds_BTD)
        h_BTD = embeds_BTD[:len(input_ids_BT)]
        cos, sin = self.rotary_tables(position_ids, h_BTD.dtype)
        docs = self.find_documents(position_ids, packed)
        stats = []
        for layer in self.layers:
            h_BTD, layer_stats = layer(h_BTD, cos, sin, docs)
            stats.append(layer_stats)
        mtp_embeds_BTD = None if mtp_ids_BT is None else embeds_BTD[len(input_ids_BT):]
        return DecoderOutput(self.norm(h_BTD), stats, mtp_embeds_BTD, cos, sin, docs)

    def find_documents(self, position_ids: torch.Tensor, packed: bool | KnownDocuments | None = None
                       ) -> Documents | None:
        """The whole sequence's packed documents (a sequence op: under CP, of every cp rank's position ids), or
        None when every row is one document (``packed``: see ``document_ids``; its offsets where known)."""
        ids_BT = document_ids(position_ids, packed)
        known = packed if isinstance(packed, KnownDocuments) else None
        return None if ids_BT is None else self.attention.documents(ids_BT, known)


class MoeCausalLM(nn.Module):
    """``model`` (the family's ``decoder_cls``, built from ``args``) and ``lm_head``, with transformers' names.
    A family subclass sets ``decoder_cls`` (and ``init_module`` for parameters the init loop does not know)."""

    decoder_cls: ClassVar[type[nn.Module]]

    def __init__(self, args: Any) -> None:
        super().__init__()
        self.args = args
        self.mtp: nn.Module | None = None  # a family's multi-token-prediction head, where the model trains one
        self.visual: nn.Module | None = None  # a family's vision tower, where the model has one
        self.model = self.decoder_cls(args)
        self.lm_head = LMHead(args.hidden_size, args.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """``args.tie_word_embeddings``: the LM head's weight is the embedding's parameter (one tensor, one
        gradient, one optimizer state)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> MoeCausalLM:
        """``nn.Module.to_empty``, tie kept: it gives each module's parameter a new tensor of its own, so the head and
        the embedding would train apart (and the tied export and final weights would drop the head's)."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def forward(self, input_ids_BT: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels_BT: torch.Tensor | None = None, packed: bool | KnownDocuments | None = None,
                trained_rows: torch.Tensor | None = None, mtp: MtpBatch | None = None,
                insert: Callable[[torch.Tensor], torch.Tensor] | None = None) -> CausalLMOutput:
        """``position_ids`` [B, T] (or a family's multimodal [3, B, T]); default 0..T-1 for every row.
        With ``labels_BT`` (already shifted, -100 = ignore) the output has ``loss_sum`` and no logits. ``packed``:
        whether the rows hold several documents, where the caller knows (``models.layers.known_documents``).
        ``trained_rows``: the flat indices of the labels != -100 (``models.causal_lm.trained_rows``; None: every
        row), the only rows the LM head computes logits for; the loss is the same either way. ``mtp``: run the MTP
        head too (the model must have one) on this batch (``mtp_batch``; its labels are read where ``labels_BT``
        is given): its logits or summed cross-entropy come as ``mtp_logits`` / ``mtp_loss_sum``. ``insert``: see
        ``MoeDecoder.forward``."""
        if position_ids is None:
            position_ids = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device).expand_as(input_ids_BT)
            packed = False
        if mtp is not None and self.mtp is None:
            raise ValueError("an MTP batch for a model without an MTP head (model.arch.mtp_loss_weight=0)")
        out = self.model(input_ids_BT, position_ids, packed, None if mtp is None else mtp.input_ids_BT, insert)
        stats, h_mtp_BTD = out.router_stats, None
        if mtp is not None:
            h_mtp_BTD, mtp_stats = self.mtp(out.mtp_embeds_BTD, out.h_BTD, out.cos, out.sin, out.docs)
            stats = stats + mtp_stats
        if labels_BT is None:
            if mtp is None:
                return CausalLMOutput(logits=self.lm_head(out.h_BTD), router_stats=stats)
            logits = self.lm_head(torch.cat((out.h_BTD, h_mtp_BTD)))  # one call of the shared head
            return CausalLMOutput(logits=logits[:len(input_ids_BT)], router_stats=stats,
                                  mtp_logits=logits[len(input_ids_BT):])
        if mtp is None:
            return CausalLMOutput(logits=None, router_stats=stats,
                                  loss_sum=self.lm_head(out.h_BTD, labels_BT, trained_rows))
        loss_sum, mtp_loss_sum = self.lm_head(out.h_BTD, labels_BT, trained_rows, (h_mtp_BTD, mtp))
        return CausalLMOutput(logits=None, router_stats=stats, loss_sum=loss_sum, mtp_loss_sum=mtp_loss_sum)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """transformers' init: N(0, initializer_range) for matrices, convolutions, embeddings, routers and experts,
        norms at their ``init_value``, the rest by the family's ``init_module``. The values depend on the seed and
        parameter names only, not on the parallel layout."""
        init, std = ShardedInit(self, seed), normal(self.args.initializer_range)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, TopKRouter)):
                init(module.weight, std)
                if isinstance(module, TopKRouter):
                    module.reset_expert_bias()
            elif isinstance(module, RMSNorm):
                init(module.weight, constant(module.init_value))
            elif isinstance(module, GroupedExperts):
                init(module.gate_up_proj, std)
                init(module.down_proj, std)
            else:
                self.init_module(module, init)

    def routers(self) -> list[TopKRouter]:
        """The MoE layers' routers, in layer order (the order of ``CausalLMOutput.router_stats``)."""
        return [module for module in self.modules() if isinstance(module, TopKRouter)]

    def init_module(self, module: nn.Module, init: ShardedInit) -> None:
        """Initialise a family-specific module's own parameters (none by default)."""
