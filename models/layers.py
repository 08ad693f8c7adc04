"""Building blocks shared by the model families: RMSNorm, rotary tables and finding packed documents.

Letters as in DEVELOPERS.md ("Shape suffixes"), in every file of models/.

Kernel slots: a module class may declare ``kernel_slots`` (attribute -> op name). It calls that op through the
attribute, which holds the op's torch reference by default (``kernels/tokenwise/norm.py``, ``swiglu.py``,
``rotary.py``, ``kernels/linear_attention/delta_rule.py``, each beside its device kernels in the layer below);
``kernels.registry.apply_kernels`` installs device kernels with the same signature from the outside, so the model
never imports a device package.

Sequence ops: the few ops that mix tokens across the sequence (attention's core, DeltaNet's conv and delta rule, and
finding documents from position ids) are methods a module declares in ``sequence_ops`` (method -> ``SequenceOp``,
``models/sequence_ops.py``: what each argument is in terms of sequence and heads). ``parallelisms/context_parallel.py``
wraps them on the instance for context parallelism (a head shard of the whole sequence inside, the local tokens
outside); everything else in the model is token-wise and never knows.

Packed documents: position ids restart at each document (``document_ids``); attention then stays within documents
and DeltaNet restarts its state and conv window, as if every document were its own row. The decoder turns the ids
into a ``Documents`` once per forward (``kernels/attention/attention.py``: what the chosen attention kernel needs, e.g.
a FlexAttention block mask, and FLA's ``cu_seqlens``) and passes it to every layer.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Mapping

import torch
import torch.nn as nn

from core.device import queued_copy
from kernels.attention.attention import DenseMaskAttention, Documents, KnownDocuments, document_cu_seqlens
from kernels.tokenwise.norm import rms_norm
from kernels.tokenwise.rotary import apply_rotary, rotate_half
from kernels.tokenwise.swiglu import packed_swiglu, swiglu

# The references too: the families' slot defaults.
__all__ = ["DenseMaskAttention", "Documents", "KnownDocuments", "RMSNorm", "apply_rotary", "document_cu_seqlens",
           "document_ids", "known_documents", "packed_swiglu", "rms_norm", "rotary_cos_sin", "rotate_half", "swiglu",
           "text_positions"]


class RMSNorm(nn.Module):
    """``w * x / rms(x)`` with the normalisation in fp32, as transformers' Qwen3 RMSNorm."""

    kernel_slots: ClassVar[Mapping[str, str]] = {"norm_fn": "rms_norm"}
    init_value: ClassVar[float] = 1.0

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.norm_fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, self.init_value)


def rotary_cos_sin(
    position_ids_BT: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, T, rotary_dim] for ``position_ids_BT``, computed in fp32.

    Computed per call rather than cached in a buffer: it is cheap, and a model built on the meta device
    then has no buffer that could be left uninitialised.
    """
    exponent = torch.arange(0, rotary_dim, 2, device=position_ids_BT.device, dtype=torch.float32) / rotary_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = position_ids_BT.float()[..., None] * inv_freq  # [B, T, r / 2]
    emb_BTr = torch.cat((freqs, freqs), dim=-1)
    return emb_BTr.cos().to(dtype), emb_BTr.sin().to(dtype)


def known_documents(position_ids_BT: torch.Tensor, dev: torch.device) -> KnownDocuments | bool:
    """The ``packed`` a forward on ``dev`` takes, from the host copy of a batch's position ids: False (one document
    per row) or the documents' offsets, queued to ``dev`` (no wait), and their lengths."""
    ids_BT = document_ids(position_ids_BT)
    if ids_BT is None:
        return False
    cu_seqlens_n1 = document_cu_seqlens(ids_BT)
    return KnownDocuments(queued_copy(cu_seqlens_n1, dev), cu_seqlens_n1)


def text_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """The text positions [B, T] of multimodal [4, B, T] position ids (row 0; rows 1..3 are the 3-D rotary's t, h,
    w: transformers' convention for packed Qwen-VL batches); other position ids as they are."""
    return position_ids[0] if position_ids.dim() == 3 and position_ids.shape[0] == 4 else position_ids


def document_ids(position_ids_BT: torch.Tensor, packed: bool | KnownDocuments | None = None) -> torch.Tensor | None:
    """Index of each token's document within its row (0, 1, ...) for packed rows, or None if every row is one
    document. A document starts wherever a position id is not its predecessor's + 1, as transformers detects packed
    sequences; multimodal [4, B, T] position ids by their text row (``text_positions``). Multimodal [3, B, T] position
    ids are taken as one document per row. ``packed``: whether any row holds more than one document, where the
    caller knows it (the trainer, from the host copy of the ids: ``known_documents``); None finds out, at the cost
    of a host sync for ids on an accelerator."""
    position_ids_BT = text_positions(position_ids_BT)
    if position_ids_BT.dim() != 2 or packed is False:
        return None
    starts_BT = position_ids_BT.diff(dim=1, prepend=position_ids_BT[:, :1] - 1) != 1
    doc_ids_BT = starts_BT.cumsum(dim=1)
    if packed is None:  # unpacked rows keep the plain causal kernels
        packed = bool(doc_ids_BT[:, -1].any())
    return doc_ids_BT if packed else None
