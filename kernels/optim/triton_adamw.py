"""Triton (CUDA) kernel for ``kernels.optim.adamw.adamw_step_``: one pass that reads p, g and the moments (fp32 or bf16)
and writes p and the moments, the update in fp32 (same signature as the torch reference, ``adamw_step_torch``).

Memory traffic per parameter with fp32 p and g and bf16 moments: 20 bytes (p read and written, g read, 2 x 2 x 2 for
the moments), against 28 for torch's fused AdamW with fp32 moments and several passes for the reference; 28 with
fp32 moments. Writing the bf16 compute copy too adds 2, and spares the forward's cast its 6 (a read of p, a write).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.optim.adamw import adamw_step_torch

_BLOCK = 4096


@triton.jit
def _adamw_kernel(P, G, M, V, C, GATE, n, grad_scale, decay, beta1, beta2, eps, step_size, bias_correction2_sqrt,
                  BLOCK: tl.constexpr, HAS_COPY: tl.constexpr, HAS_GATE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_GATE:  # [clip coefficient, applies]: a step that does not apply reads and writes nothing
        grad_scale = tl.load(GATE)
        mask = mask & (tl.load(GATE + 1) != 0)
    p = tl.load(P + offs, mask=mask).to(tl.float32)
    g = tl.load(G + offs, mask=mask).to(tl.float32) * grad_scale  # the clip, without a pass over the gradients
    m = tl.load(M + offs, mask=mask).to(tl.float32)
    v = tl.load(V + offs, mask=mask).to(tl.float32)
    p = p * decay
    m = m + (1.0 - beta1) * (g - m)  # torch's lerp for a weight below 0.5
    v = v * beta2 + (1.0 - beta2) * g * g
    denom = tl.sqrt_rn(v) / bias_correction2_sqrt + eps
    p = p - step_size * (m / denom)
    tl.store(P + offs, p.to(P.dtype.element_ty), mask=mask)
    tl.store(M + offs, m.to(M.dtype.element_ty), mask=mask)  # round to nearest even
    tl.store(V + offs, v.to(V.dtype.element_ty), mask=mask)
    if HAS_COPY:  # the compute copy, rounded from the stored p (nearest even, as torch's copy_)
        tl.store(C + offs, p.to(P.dtype.element_ty).to(C.dtype.element_ty), mask=mask)


def adamw_step(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: float,
               beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
               grad_scale: float = 1.0, p_copy: torch.Tensor | None = None, gate: torch.Tensor | None = None
               ) -> None:
    tensors = (p, grad, exp_avg, exp_avg_sq, *([p_copy] if p_copy is not None else []))
    if not all(t.is_contiguous() for t in tensors):  # in place, so no contiguous copy: the same maths in torch
        adamw_step_torch(p, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                         weight_decay=weight_decay, step=step, grad_scale=grad_scale, p_copy=p_copy, gate=gate)
        return
    n = p.numel()
    if n:
        _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
            p, grad, exp_avg, exp_avg_sq, p if p_copy is None else p_copy, p if gate is None else gate, n,
            grad_scale, 1 - lr * weight_decay, beta1, beta2, eps, lr / (1 - beta1**step), (1 - beta2**step) ** 0.5,
            BLOCK=_BLOCK, HAS_COPY=p_copy is not None, HAS_GATE=gate is not None, num_warps=8)
