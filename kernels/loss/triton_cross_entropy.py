"""Softmax cross-entropy and its gradient in one Triton kernel (CUDA), in place on the logits.

One program per row: an online max / sum-exp pass, then a pass that overwrites the row with
``softmax - one_hot(label)`` (zero for ignored rows), both in fp32 from the stored logits. The torch reference
(``kernels.loss.linear_cross_entropy.softmax_cross_entropy_``) makes fp32 copies and runs ~8 elementwise passes over
the [rows, vocab] chunk; this reads it twice and writes it once, with no extra memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from core.constants import IGNORE_INDEX

_BLOCK = 4096


@triton.jit
def _ce_kernel(LOGITS, LABELS, LOSS, stride_row, ignore_index, V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_row
    label = tl.load(LABELS + row)
    m = -float("inf")
    s = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    valid = label != ignore_index
    target = tl.where(valid, label, 0)
    target_logit = tl.load(ptr + target).to(tl.float32)  # read before the row is overwritten
    tl.store(LOSS + row, tl.where(valid, lse - target_logit, 0.0))
    scale = tl.where(valid, 1.0, 0.0)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(offs == target, 1.0, 0.0)
        tl.store(ptr + offs, (grad * scale).to(LOGITS.dtype.element_ty), mask=mask)


def softmax_cross_entropy_(logits_CV: torch.Tensor, labels_C: torch.Tensor) -> torch.Tensor:
    """Per-row cross-entropy [C] in fp32; ``logits_CV`` is overwritten with d(sum of the losses)/d logits."""
    if logits_CV.stride(-1) != 1:
        raise ValueError("triton cross-entropy needs rows with unit stride")
    rows, vocab = logits_CV.shape
    loss_C = torch.empty(rows, dtype=torch.float32, device=logits_CV.device)
    if rows:
        _ce_kernel[(rows,)](logits_CV, labels_C.contiguous(), loss_C, logits_CV.stride(0), IGNORE_INDEX, V=vocab,
                            BLOCK=_BLOCK, num_warps=16)
    return loss_C
