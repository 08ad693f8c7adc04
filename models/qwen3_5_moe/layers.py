"""Qwen3.5-MoE pieces that differ from Qwen3-MoE's: (1 + w) and gated RMSNorms, interleaved MRoPE, gated full
attention with partial rotary, and the MoE block with a gated shared expert."""

from __future__ import annotations

from typing import ClassVar, Mapping

import torch
import torch.nn as nn

from kernels.tokenwise.norm import gated_rms_norm, offset_rms_norm
from kernels.tokenwise.swiglu import swiglu
from models.footprint import LayerActivations
from models.layers import RMSNorm, rotary_cos_sin
from models.moe import RouterStats, SparseMoeBlock
from models.qwen3_5_moe.args import Qwen3_5MoeArgs


class OffsetRMSNorm(RMSNorm):
    """``(1 + w) * x / rms(x)`` with the weight stored as an offset (init 0) and applied in fp32 before the cast back,
    as transformers' Qwen3_5MoeRMSNorm (layer, final, q and k norms)."""

    kernel_slots: ClassVar[Mapping[str, str]] = {"norm_fn": "offset_rms_norm"}
    init_value: ClassVar[float] = 0.0

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.norm_fn = offset_rms_norm
        self.reset_parameters()


class GatedRMSNorm(RMSNorm):
    """``w * x / rms(x) * silu(z)``, the gate applied in fp32: DeltaNet's output norm (plain weight, init 1)."""

    kernel_slots: ClassVar[Mapping[str, str]] = {"norm_fn": "gated_rms_norm"}

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.norm_fn = gated_rms_norm

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.norm_fn(x, z, self.weight, self.eps)


def mrope_streams(rotary_dim: int, mrope_section: list[int], device: torch.device | None = None) -> torch.Tensor:
    """Which position stream (0 t, 1 h, 2 w) drives each of the ``rotary_dim`` channels, built on ``device`` (no
    host tensor copied to it, no mask indexing: nothing in a training step's forward waits for the device).

    transformers' interleaved layout: frequency j belongs to h if j % 3 == 1 and j < 3 * section_h, to w if
    j % 3 == 2 and j < 3 * section_w, else to t; both halves of the rotary channels repeat that pattern.
    """
    j = torch.arange(rotary_dim // 2, device=device)
    stream = torch.where((j % 3 == 1) & (j < 3 * mrope_section[1]), 1,
                         torch.where((j % 3 == 2) & (j < 3 * mrope_section[2]), 2, 0))  # per frequency: [r / 2]
    return torch.cat((stream, stream))


def mrope_cos_sin(position_ids: torch.Tensor, args: Qwen3_5MoeArgs, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, T, rotary_dim] for position ids [B, T] (text: the three streams are equal, so plain 1-D RoPE)
    or [3, B, T] (t, h, w streams, mixed per channel as transformers does)."""
    if position_ids.dim() == 2:
        return rotary_cos_sin(position_ids, args.rotary_dim, args.rope_theta, dtype)
    if position_ids.dim() != 3 or position_ids.shape[0] != 3:
        raise ValueError(f"position_ids must be [B, T] or [3, B, T], got {tuple(position_ids.shape)}")
    cos_3BTr, sin_3BTr = rotary_cos_sin(position_ids, args.rotary_dim, args.rope_theta, dtype)
    stream_r = mrope_streams(args.rotary_dim, args.mrope_section, position_ids.device)
    pick_1BTr = stream_r.expand(1, *cos_3BTr.shape[1:])
    return cos_3BTr.gather(0, pick_1BTr)[0], sin_3BTr.gather(0, pick_1BTr)[0]


class SwiGLU(nn.Module):
    """``down(silu(gate x) * up x)``: the shared expert."""

    kernel_slots: ClassVar[Mapping[str, str]] = {"act_fn": "swiglu"}

    def __init__(self, dim: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, intermediate, bias=False)
        self.up_proj = nn.Linear(dim, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, dim, bias=False)
        self.act_fn = swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x), self.up_proj(x)))


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts (``gate``, ``experts``: the shared router and GroupedExperts, so expert parallelism applies
    unchanged) plus a dense shared expert scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, args: Qwen3_5MoeArgs) -> None:
        # Qwen3.5 always renormalises the top-k weights (its config has no norm_topk_prob).
        super().__init__(args.hidden_size, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
                         norm_topk_prob=True, expert_bias=args.router_bias_update_rate > 0,
                         z_loss=args.router_z_loss_coef > 0, force_balance=args.router_force_balance)
        self.shared_expert = SwiGLU(args.hidden_size, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        routed_BTD, stats = super().forward(x_BTD)
        shared_BTD = torch.sigmoid(self.shared_expert_gate(x_BTD)) * self.shared_expert(x_BTD)
        return routed_BTD + shared_BTD, stats

    def saved_activations(self) -> LayerActivations:
        """The routed block's, plus the shared expert's gate and up outputs, its SwiGLU output and its output, and
        the gate's sigmoid; selective: its three projections' outputs and the gate logit."""
        I, D = self.shared_expert.gate_proj.out_features, self.shared_expert.down_proj.out_features
        shared = LayerActivations(none=3 * I + D + 1, none_fp32=0, selective=2 * I + D + 1, selective_fp32=0)
        return super().saved_activations() + shared
