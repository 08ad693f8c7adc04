"""LM head + cross-entropy, chunk by chunk: the [N, V] logits are never all alive at once.

At the Qwen3 vocabulary (V = 151,936) and 16k tokens per GPU, the plain ``lm_head`` + ``F.cross_entropy``
holds bf16 logits (5 GiB), their fp32 copy (10 GiB) and the fp32 gradient (10 GiB): the largest tensors of
the step. Here each chunk of rows computes its logits, then its loss and, in place, its logit gradient
(softmax - one-hot is the whole backward of cross-entropy), then the hidden-state and weight gradient
products, and frees it; only those two gradients are kept for backward, which just scales them by the
incoming scalar. Numerics as the unfused path: logits in the compute dtype, softmax in fp32, the logit
gradient rounded to the compute dtype before the matmuls. The weight gradient is accumulated over chunks
in its own dtype (``addmm_``: fp32 accumulation inside each product).

``softmax_cross_entropy_`` below is the torch reference of the per-chunk step; ``LMHead`` takes the device
kernel from the registry (Triton on CUDA: ``kernels/loss/triton_cross_entropy.py``).
"""

from __future__ import annotations

from typing import Callable

import torch

from core.constants import IGNORE_INDEX

CHUNK_ELEMENTS = 1 << 29  # logits per chunk: 1 GiB in bf16 (the reference adds fp32 copies of it)

# (logits [C, V], labels [C]) -> per-row loss [C] in fp32; overwrites the logits with their gradient.
SoftmaxCrossEntropy = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def default_chunk_rows(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)


def softmax_cross_entropy_(logits_CV: torch.Tensor, labels_C: torch.Tensor) -> torch.Tensor:
    """Per-row cross-entropy [C] in fp32 (0 where the label is IGNORE_INDEX, -100); ``logits_CV`` is overwritten with
    d(sum of the losses)/d logits = softmax - one_hot(label), zero on ignored rows."""
    logits32_CV = logits_CV.float()  # the same tensor when the logits are fp32: updated in place below
    valid_C = labels_C != IGNORE_INDEX
    target_C = torch.where(valid_C, labels_C, 0)
    lse_C = torch.logsumexp(logits32_CV, dim=-1)
    loss_C = (lse_C - logits32_CV.gather(1, target_C[:, None]).squeeze(1)) * valid_C
    grad_CV = logits32_CV.sub_(lse_C[:, None]).exp_()
    grad_CV.scatter_add_(1, target_C[:, None], -torch.ones_like(lse_C[:, None]))
    grad_CV.mul_(valid_C[:, None])
    if grad_CV.data_ptr() != logits_CV.data_ptr():
        logits_CV.copy_(grad_CV)
    return loss_C


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor, chunk_rows: int,
                ce_fn: SoftmaxCrossEntropy, grad_enabled: bool) -> torch.Tensor:
        # needs_input_grad ignores no_grad mode: the caller's grad mode decides whether gradients are built.
        want_h, want_w = (grad_enabled and needed for needed in ctx.needs_input_grad[:2])
        grad_h_ND = torch.empty_like(h_ND) if want_h else None
        grad_w_VD = torch.zeros_like(w_VD) if want_w else None
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        for start in range(0, h_ND.shape[0], chunk_rows):
            h_CD, labels_C = h_ND[start:start + chunk_rows], labels_N[start:start + chunk_rows]
            logits_CV = h_CD @ w_VD.t()
            loss += ce_fn(logits_CV, labels_C).sum()
            grad_CV = logits_CV  # overwritten by ce_fn
            if grad_h_ND is not None:
                torch.mm(grad_CV, w_VD, out=grad_h_ND[start:start + chunk_rows])
            if grad_w_VD is not None:
                grad_w_VD.addmm_(grad_CV.t(), h_CD)
        ctx.save_for_backward(grad_h_ND, grad_w_VD)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h_ND, grad_w_VD = ctx.saved_tensors
        scale = grad_loss.to(grad_h_ND.dtype if grad_h_ND is not None else grad_w_VD.dtype)
        return (grad_h_ND * scale if grad_h_ND is not None else None,
                grad_w_VD * scale if grad_w_VD is not None else None, None, None, None, None)


def linear_cross_entropy_sum(h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor,
                             chunk_rows: int | None = None,
                             ce_fn: SoftmaxCrossEntropy = softmax_cross_entropy_) -> torch.Tensor:
    """``F.cross_entropy(h @ w.T, labels, ignore_index=-100, reduction="sum")`` in fp32, chunked over rows.

    Under autocast the matmuls run in the autocast dtype, as ``nn.Linear`` would.
    """
    device_type = h_ND.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        h_ND, w_VD = h_ND.to(dtype), w_VD.to(dtype)
    elif h_ND.dtype != w_VD.dtype:
        raise TypeError(f"hidden states are {h_ND.dtype} but the LM head weight is {w_VD.dtype}")
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropySum.apply(h_ND.contiguous(), w_VD, labels_N,
                                            chunk_rows or default_chunk_rows(w_VD.shape[0]), ce_fn,
                                            torch.is_grad_enabled())
