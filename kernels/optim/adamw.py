"""AdamW's update of one parameter whose moments may be stored in a narrower dtype than the parameter (bf16
moments beside fp32 master weights: half the optimizer state, as torchtitan, Transformer Engine's FusedAdam and
Megatron's precision-aware optimizer keep it).

The update is computed in fp32 from the stored moments and written back rounded to nearest (no stochastic
rounding: see ``training.optim.AdamW``). With fp32 moments it is torch.optim.AdamW's update, op for op (its
single-tensor code), so the two agree to the bit.

``adamw_step_`` runs the kernel ``kernels/registry.py`` chose for the device (installed in ``kernels.installed``):
``kernels.optim.triton_adamw`` on CUDA, one pass over p, g, m and v; ``adamw_step_torch``, the reference, everywhere
else.
"""

from __future__ import annotations

import torch

from kernels.installed import kernel


def adamw_step_(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: float,
                beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
                grad_scale: float = 1.0, p_copy: torch.Tensor | None = None, gate: torch.Tensor | None = None
                ) -> None:
    """In place: ``p``, ``exp_avg`` and ``exp_avg_sq`` after AdamW's ``step``-th update (1-based) with ``grad`` times
    ``grad_scale`` (the clip coefficient, applied in the update: ``grad`` itself is left as it is), p and grad plain
    tensors of one dtype and shape; the moments of p's shape, in p's dtype or bf16. ``p_copy``: also the updated p
    rounded to nearest into this tensor of p's shape (its bf16 compute copy, ``parallelisms/compute_copy.py``).

    ``gate``: instead of ``grad_scale``, a (2,) fp32 tensor on p's device, [clip coefficient, 1 if the update
    applies else 0], read on the device: the update can be queued before the host knows whether the step's loss
    and gradient norm are finite (``training.optim.AdamW.step``). Where it says 0, nothing is written."""
    kernel("adamw_step", p, adamw_step_torch)(p, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                              weight_decay=weight_decay, step=step, grad_scale=grad_scale,
                                              p_copy=p_copy, gate=gate)


def adamw_step_torch(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                     lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
                     grad_scale: float = 1.0, p_copy: torch.Tensor | None = None,
                     gate: torch.Tensor | None = None) -> None:
    """The reference: torch.optim.AdamW's single-tensor update on fp32 copies of the moments (the moments
    themselves when they are fp32), then the copies rounded back; a ``grad_scale`` other than 1 scales a copy of
    the gradient first (what clipping the gradient in place, then torch's update, computes). Transient: two fp32
    tensors of p's size (three when scaled). A ``gate`` runs the update on copies of p and the moments and keeps
    them where it applies (``torch.where``: no host read)."""
    if gate is not None:
        targets = [t for t in (p, exp_avg, exp_avg_sq, p_copy) if t is not None]
        new = [t.clone() for t in targets]
        adamw_step_torch(new[0], grad * gate[0].to(grad.dtype), new[1], new[2], lr=lr, beta1=beta1, beta2=beta2,
                         eps=eps, weight_decay=weight_decay, step=step, p_copy=new[3] if p_copy is not None else None)
        applies = gate[1] != 0
        for target, value in zip(targets, new):
            target.copy_(torch.where(applies, value, target))
        return
    if grad_scale != 1.0:
        grad = grad * grad_scale
    m32, v32 = exp_avg.float(), exp_avg_sq.float()  # the same tensors when fp32
    p.mul_(1 - lr * weight_decay)
    m32.lerp_(grad, 1 - beta1)
    v32.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (v32.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(m32, denom, value=-(lr / bias_correction1))
    if m32 is not exp_avg:
        exp_avg.copy_(m32)
        exp_avg_sq.copy_(v32)
    if p_copy is not None:
        p_copy.copy_(p)
