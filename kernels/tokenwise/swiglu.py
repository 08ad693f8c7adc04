"""SwiGLU torch references: ``silu(gate) * up`` from two projections (the shared expert) or from one packed
[gate | up] projection (the routed experts' fused gate_up_proj).

What the models' activation kernel slots hold by default and what the device kernels beside them must reproduce:
``kernels/tokenwise/triton_swiglu.py`` (CUDA) and ``kernels/tokenwise/npu.py`` (torch_npu), chosen by
``kernels/registry.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def packed_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a packed [..., 2I] projection whose halves are [gate | up] (fused experts)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
