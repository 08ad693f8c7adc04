"""Document-causal attention (the ``document_attention`` op): the torch reference and the two device kernels that
skip cross-document blocks without ever building a T x T tensor.

The op is a kernel slot of the attention modules and of the decoder (``models/causal_lm.py``), and what it holds is
an object with two methods, chosen once by ``kernels/registry.py`` and shared by every slot:

- ``documents(ids_BT, known)`` -> ``Documents``: what the kernel needs about a batch's packed documents (``known``:
  the offsets the host read, ``KnownDocuments``, else found on the device), built ONCE per
  forward in the decoder before the layers (from the whole sequence's document ids, also under context
  parallelism), passed to every layer and seen unchanged by activation-checkpoint recomputation (the checkpointed
  block is re-run with the same arguments); nothing is built inside a layer, so compiled layers see plain inputs.
- ``__call__(q_BHTd, k_BhTd, v_BhTd, docs, scale)`` -> o_BHTd: causal attention, within documents when ``docs`` is
  given; GQA (h key/value heads shared by H query heads) without repeating the kv heads in the kernels. ``docs``
  None (every row one document) takes SDPA's causal flash path in every implementation.

Implementations: ``DenseMaskAttention`` (the reference: a dense document mask and repeated kv heads; what CPU runs
and what the tests compare with), ``FlexAttention`` (a document ``BlockMask``: only the blocks on a document's
causal band are computed) and ``VarlenAttention`` (flash attention over the documents as variable-length
sequences, ``cu_seqlens`` as FLA's DeltaNet gets them); cuDNN's ragged SDPA, ``CudnnAttention``, is in
``kernels/attention/cudnn_attention.py`` (its own package, imported where used).

Letters as in DEVELOPERS.md, plus: n the documents of a batch (``cu_seqlens`` has n + 1 entries), Q the 128-token
blocks of a row.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
BLOCK = 128  # FlexAttention's sparse block: the granularity at which cross-document work is skipped


@dataclass(frozen=True)
class Documents:
    """A batch's packed documents, with what the chosen attention kernel needs (built by its ``documents``)."""

    ids_BT: Tensor  # each token's document within its row: 0, 1, ... (models.layers.document_ids)
    cu_seqlens_n1: Tensor  # start of every document in the flattened B*T tokens, then B*T (document_cu_seqlens)
    max_len: int = 0  # the longest document (varlen attention's launch bound); 0 where not needed
    block_mask: Any = None  # FlexAttention's BlockMask; None where not needed
    # cuDNN's padded offsets and graph bound (kernels/attention/cudnn_attention.Ragged); None where not needed
    ragged: Any = None
    # cu_seqlens_n1 on the host where the trainer knew it (KnownDocuments): FLA's varlen kernels then read nothing back
    host_cu_seqlens_n1: Tensor | None = None


@dataclass(frozen=True)
class KnownDocuments:
    """A batch's document offsets as the host knows them (the trainer reads them from its copy of the position ids
    before the batch goes to the device): ``documents`` then reads nothing back from the device."""

    cu_seqlens_n1: Tensor  # document_cu_seqlens of the batch, on the batch's device
    host_cu_seqlens_n1: Tensor  # the same, on the host

    @property
    def lengths_n(self) -> Tensor:
        """Every document's length, on the host."""
        return self.host_cu_seqlens_n1.diff()

    @property
    def max_len(self) -> int:
        """The longest document (varlen attention's launch bound), from the host copy: no device read."""
        return int(self.lengths_n.max())


def document_cu_seqlens(ids_BT: Tensor) -> Tensor:
    """Start offsets of every document in the flattened [B*T] tokens, then B*T: FLA's (and flash-attention's varlen)
    ``cu_seqlens``. Every row starts a document too."""
    starts_BT = F.pad(ids_BT.diff(dim=1) != 0, (1, 0), value=True)
    starts_n = starts_BT.flatten().nonzero().squeeze(1)
    return torch.cat([starts_n, starts_n.new_tensor([ids_BT.numel()])])


def causal_sdpa(q_BHTd: Tensor, k_BhTd: Tensor, v_BhTd: Tensor, scale: float) -> Tensor:
    """One causal sequence per row: SDPA's flash path, GQA without a repeat."""
    return F.scaled_dot_product_attention(q_BHTd, k_BhTd, v_BhTd, is_causal=True, scale=scale,
                                          enable_gqa=k_BhTd.shape[1] != q_BHTd.shape[1])


def _cu_seqlens(ids_BT: Tensor, known: KnownDocuments | None) -> dict[str, Tensor | None]:
    """The documents' offsets on the device, and on the host where known (else found: nonzero, a host read)."""
    if known is None:
        return {"cu_seqlens_n1": document_cu_seqlens(ids_BT), "host_cu_seqlens_n1": None}
    return {"cu_seqlens_n1": known.cu_seqlens_n1, "host_cu_seqlens_n1": known.host_cu_seqlens_n1}


def documents_with_longest(ids_BT: Tensor, known: KnownDocuments | None) -> Documents:
    """The documents and the longest one's length (the launch bound of the variable-length kernels): from the host's
    copy where known, else found on the device (host reads)."""
    if known is not None:
        return Documents(ids_BT, **_cu_seqlens(ids_BT, known), max_len=known.max_len)
    cu_seqlens_n1 = document_cu_seqlens(ids_BT)
    return Documents(ids_BT, cu_seqlens_n1, max_len=int(cu_seqlens_n1.diff().max()))


class DenseMaskAttention:
    """The torch reference: SDPA with a dense [B, 1, T, T] document mask and the kv heads repeated (the CUDA kernels
    that take a mask do not take GQA; transformers does the same). O(T^2) memory: the CPU default and the
    tests' yardstick, never the CUDA default."""

    def documents(self, ids_BT: Tensor, known: KnownDocuments | None = None) -> Documents:
        return Documents(ids_BT, **_cu_seqlens(ids_BT, known))

    def __call__(self, q_BHTd: Tensor, k_BhTd: Tensor, v_BhTd: Tensor, docs: Documents | None,
                 scale: float) -> Tensor:
        if docs is None:
            return causal_sdpa(q_BHTd, k_BhTd, v_BhTd, scale)
        T, group = q_BHTd.shape[2], q_BHTd.shape[1] // k_BhTd.shape[1]
        ids_BT = docs.ids_BT
        causal_TT = torch.ones(T, T, dtype=torch.bool, device=q_BHTd.device).tril()
        mask_B1TT = ((ids_BT[:, :, None] == ids_BT[:, None, :]) & causal_TT)[:, None]
        k_BHTd, v_BHTd = (x.repeat_interleave(group, dim=1) for x in (k_BhTd, v_BhTd))
        return F.scaled_dot_product_attention(q_BHTd, k_BHTd, v_BHTd, attn_mask=mask_B1TT, scale=scale)


def document_block_mask(ids_BT: Tensor, block: int = BLOCK) -> Any:
    """FlexAttention's document-causal ``BlockMask``, built from per-block document ranges in O(B (T / block)^2):
    never evaluating the mask on T x T (``create_block_mask`` would, 16 G entries at 128k). Document ids are
    non-decreasing along a row, so kv block j is needed by q block i iff j <= i and j's last document reaches i's
    first; it is full (no mask_mod) iff j < i and both blocks lie in one document. Equals ``create_block_mask`` of
    the same mask_mod exactly (tests/test_attention.py)."""
    from torch.nn.attention.flex_attention import BlockMask

    B, T = ids_BT.shape
    Q = -(-T // block)
    # A row's padding to whole blocks is a document of its own after the last: the ids stay non-decreasing, padded
    # queries (discarded) see only padding, and mask_mod never indexes past the tensor.
    ids_BP = torch.cat([ids_BT, (ids_BT[:, -1:] + 1).expand(B, Q * block - T)], dim=1)
    first_BQ, last_BQ = ids_BP[:, ::block], ids_BP[:, block - 1::block]
    i_Q = torch.arange(Q, device=ids_BT.device)
    needed_BQQ = (last_BQ[:, None, :] >= first_BQ[:, :, None]) & (i_Q[:, None] >= i_Q[None, :])
    full_BQQ = (first_BQ[:, None, :] == last_BQ[:, :, None]) & (i_Q[:, None] > i_Q[None, :])

    def ordered(blocks_BQQ: Tensor) -> tuple[Tensor, Tensor]:
        """(count, indices) per q block, the needed kv blocks first, as BlockMask stores them."""
        blocks_B1QQ = blocks_BQQ[:, None].to(torch.int32)
        return (blocks_B1QQ.sum(-1, dtype=torch.int32),
                torch.argsort(blocks_B1QQ, dim=-1, descending=True, stable=True).to(torch.int32))

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (ids_BP[b, q_idx] == ids_BP[b, kv_idx]) & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(*ordered(needed_BQQ & ~full_BQQ), *ordered(full_BQQ), BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(T, T))


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    """flex_attention compiled once per process (lazily: the first call compiles, per shape); eager
    flex_attention computes every block of T x T."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class FlexAttention(DenseMaskAttention):
    """torch's FlexAttention with a document ``BlockMask``: cross-document blocks are skipped, GQA native.
    ``compiled=False`` runs it eagerly (CPU tests: forward only there, torch has no CPU flex backward)."""

    def __init__(self, compiled: bool = True) -> None:
        self.compiled = compiled

    def documents(self, ids_BT: Tensor, known: KnownDocuments | None = None) -> Documents:
        return Documents(ids_BT, **_cu_seqlens(ids_BT, known), block_mask=document_block_mask(ids_BT))

    def __call__(self, q_BHTd: Tensor, k_BhTd: Tensor, v_BhTd: Tensor, docs: Documents | None,
                 scale: float) -> Tensor:
        if docs is None:
            return causal_sdpa(q_BHTd, k_BhTd, v_BhTd, scale)
        from torch.nn.attention.flex_attention import flex_attention

        # Inside a compiled block (train.compile) the block's own compilation takes the flex call in.
        flex = _compiled_flex() if self.compiled and not torch.compiler.is_compiling() else flex_attention
        return flex(q_BHTd, k_BhTd, v_BhTd, block_mask=docs.block_mask, scale=scale,
                    enable_gqa=k_BhTd.shape[1] != q_BHTd.shape[1])


def varlen_signature_problem() -> str | None:
    """Why torch's varlen_attn cannot serve here, or None: it exists from torch 2.10 (CUDA), takes the causal window
    as ``window_size=(-1, 0)`` from 2.11 (2.10 had ``is_causal``)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if "window_size" not in inspect.signature(varlen_attn).parameters:
        return f"torch {torch.__version__}'s varlen_attn takes no window_size (torch >= 2.11 does)"
    return None


class VarlenAttention(DenseMaskAttention):
    """Flash attention over the documents as variable-length sequences of the flattened batch: no masked block is
    computed at all. ``varlen`` has ``torch.nn.attention.varlen.varlen_attn``'s signature (the tests pass a
    per-document SDPA with it); GQA is the flash kernel's own (torch 2.13 asks for ``enable_gqa``, 2.11 has no such
    argument and takes fewer kv heads as they are)."""

    def __init__(self, varlen: Callable[..., Tensor] | None = None) -> None:
        if varlen is None:
            from torch.nn.attention.varlen import varlen_attn as varlen
        self.varlen = varlen
        self.gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen).parameters else {}

    def documents(self, ids_BT: Tensor, known: KnownDocuments | None = None) -> Documents:
        return documents_with_longest(ids_BT, known)

    def __call__(self, q_BHTd: Tensor, k_BhTd: Tensor, v_BhTd: Tensor, docs: Documents | None,
                 scale: float) -> Tensor:
        if docs is None:
            return causal_sdpa(q_BHTd, k_BhTd, v_BhTd, scale)
        B, H, T, d = q_BHTd.shape
        q_NHd, k_Nhd, v_Nhd = (x.transpose(1, 2).flatten(0, 1) for x in (q_BHTd, k_BhTd, v_BhTd))
        cu_n1 = docs.cu_seqlens_n1.to(torch.int32)
        o_NHd = self.varlen(q_NHd, k_Nhd, v_Nhd, cu_n1, cu_n1, docs.max_len, docs.max_len, scale=scale,
                            window_size=(-1, 0), **self.gqa)
        return o_NHd.view(B, T, H, d).transpose(1, 2)
