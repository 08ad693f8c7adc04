"""Gated DeltaNet, Qwen3.5's linear-attention token mixer (transformers' ``Qwen3_5MoeGatedDeltaNet`` without the
decoding cache)."""

from __future__ import annotations

import functools
from typing import Callable, ClassVar, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.qwen3_5_moe.args import Qwen3_5MoeArgs
from models.qwen3_5_moe.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from models.qwen3_5_moe.layers import GatedRMSNorm

DeltaRule = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # chunk_gated_delta_rule's signature


class GatedDeltaNet(nn.Module):
    """in_proj_qkv -> depthwise causal conv (silu) -> q, k, v; beta = sigmoid(in_proj_b x);
    g = -exp(A_log) * softplus(in_proj_a x + dt_bias); o = delta_rule(l2norm q, l2norm k, v, g, beta);
    out = out_proj(norm(o, z = in_proj_z x)).

    ``self.delta_rule`` has ``chunk_gated_delta_rule``'s signature: the torch reference by default; a kernel
    registry may set a device kernel (e.g. flash-linear-attention's) or another chunk size per module.
    ``self.recurrent_delta_rule`` (the token-by-token form) serves short sequences evaluated without autograd.
    """

    kernel_slots: ClassVar[Mapping[str, str]] = {"delta_rule": "chunk_gated_delta_rule",
                                                 "recurrent_delta_rule": "fused_recurrent_gated_delta_rule"}
    # FLA's layers switch to the recurrent kernel (which has no backward) at this length and below.
    max_recurrent_len: ClassVar[int] = 64

    def __init__(self, args: Qwen3_5MoeArgs) -> None:
        super().__init__()
        D = args.hidden_size
        self.num_k_heads, self.num_v_heads = args.linear_num_key_heads, args.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim  # channels of [q | k | v]
        self.in_proj_qkv = nn.Linear(D, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(D, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(D, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(D, self.num_v_heads, bias=False)
        # Depthwise; padded on both sides by kernel - 1 and cut to the first T outputs, which makes it causal.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel_size=args.linear_conv_kernel_dim, groups=conv_dim,
                                padding=args.linear_conv_kernel_dim - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, D, bias=False)
        self.delta_rule: DeltaRule = functools.partial(chunk_gated_delta_rule, chunk_size=64)
        self.recurrent_delta_rule: DeltaRule = recurrent_gated_delta_rule

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        qkv_BFT = self.conv1d(self.in_proj_qkv(x_BTD).transpose(1, 2))[..., :T]  # F = conv channels
        qkv_BTF = F.silu(qkv_BFT).transpose(1, 2)
        q_BTF, k_BTF, v_BTF = qkv_BTF.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta_BTH = torch.sigmoid(self.in_proj_b(x_BTD))
        # fp32: in bf16/fp16, exp(A_log) times softplus could overflow or lose the decay's precision.
        g_BTH = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x_BTD).float() + self.dt_bias)
        recurrent = T <= self.max_recurrent_len and not self.training and not torch.is_grad_enabled()
        o_BTHv, _ = (self.recurrent_delta_rule if recurrent else self.delta_rule)(
            q_BTF.reshape(B, T, self.num_k_heads, self.head_k_dim),
            k_BTF.reshape(B, T, self.num_k_heads, self.head_k_dim),
            v_BTF.reshape(B, T, self.num_v_heads, self.head_v_dim),
            g=g_BTH, beta=beta_BTH, use_qk_l2norm_in_kernel=True,
        )
        z_BTHv = self.in_proj_z(x_BTD).view(B, T, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(o_BTHv, z_BTHv).reshape(B, T, -1))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """transformers' init of the decay parameters: dt_bias = 1, A = U(0.01, 16) (kept away from 0 so that
        A_log stays finite). The linear and conv layers are initialised by the model."""
        nn.init.ones_(self.dt_bias)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log_())
