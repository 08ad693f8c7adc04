"""Ascend NPU kernels: torch_npu's fused ops behind the models' kernel-slot signatures.

torch_npu's ops want every input in one dtype; where the torch reference mixes dtypes (an fp32 weight under
autocast), inputs are cast to the activation dtype and the result to the reference's dtype.
Imported only when the registry chooses these kernels, so torch_npu is needed only on NPU machines.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch_npu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = torch_npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]
    return y.to(torch.promote_types(x.dtype, weight.dtype))


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # gamma must have x's dtype: (1 + w) is rounded to it, where the reference keeps it in fp32 (<= 1 ulp more error).
    return torch_npu.npu_rms_norm(x, (1.0 + weight.float()).to(x.dtype), epsilon=eps)[0]


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = torch_npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]
    return (normed.float() * F.silu(z.float())).to(x.dtype)


def packed_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    return torch_npu.npu_swiglu(gate_up, dim=-1)  # silu(first half) * second half


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # npu_swiglu splits its input in halves along ``dim``: silu(first) * second.
    return torch_npu.npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)


def apply_rotary(x_BHTd: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor) -> torch.Tensor:
    """As ``kernels.tokenwise.rotary.apply_rotary``: the first ``cos.shape[-1]`` channels of every head rotated."""
    rot = cos_BTr.shape[-1]
    dtype = torch.promote_types(x_BHTd.dtype, cos_BTr.dtype)
    cos_B1Tr, sin_B1Tr = (t.unsqueeze(1).to(dtype) for t in (cos_BTr, sin_BTr))
    x_rot = torch_npu.npu_rotary_mul(x_BHTd[..., :rot].to(dtype).contiguous(), cos_B1Tr, sin_B1Tr)
    if rot == x_BHTd.shape[-1]:
        return x_rot
    return torch.cat((x_rot, x_BHTd[..., rot:].to(dtype)), dim=-1)
