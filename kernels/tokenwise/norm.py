"""RMSNorm torch references: the plain norm (Qwen3), the (1 + w) offset norm and the gated norm (Qwen3.5).

What the models' norm kernel slots hold by default and what the device kernels beside them must reproduce:
``kernels/tokenwise/triton_norm.py`` (CUDA) and ``kernels/tokenwise/npu.py`` (torch_npu), chosen by
``kernels/registry.py``. Letters as in DEVELOPERS.md: x [..., D] normalised over its last dim D (the hidden size, or a
head dim for the per-head norms); weight [D].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / rms(x)``, normalised in fp32 and cast back before the weight, as transformers' Qwen3 RMSNorm."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(1 + w) * x / rms(x)``, all in fp32 before the one cast back."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).type_as(x)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x) * silu(z)``, the gate applied in fp32."""
    return (rms_norm(x, weight, eps) * F.silu(z.float())).to(x.dtype)
