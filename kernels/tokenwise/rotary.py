"""Rotary position embedding torch reference (rotate-half convention, full or partial).

What the attention modules' rotary kernel slot holds by default and what the device kernels beside it must
reproduce: ``kernels/tokenwise/triton_rotary.py`` (CUDA) and ``kernels/tokenwise/npu.py`` (torch_npu), chosen by
``kernels/registry.py``. The cos/sin tables come from the model (``models.layers.rotary_cos_sin``).
Letters as in DEVELOPERS.md: x [B, H, T, d] (H the heads of whichever tensor: q's H or k's h), the cos / sin
tables [B, T, r] (r <= d rotated channels).
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_BHTd: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of every head (all of them for full rotary)."""
    rot = cos_BTr.shape[-1]
    cos, sin = cos_BTr.unsqueeze(1), sin_BTr.unsqueeze(1)
    x_rot, x_pass = x_BHTd[..., :rot], x_BHTd[..., rot:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1) if x_pass.shape[-1] else x_rot
