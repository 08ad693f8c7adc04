"""Gated DeltaNet, Qwen3.5's linear-attention token mixer (transformers' ``Qwen3_5MoeGatedDeltaNet`` without the
decoding cache).

Letters as in DEVELOPERS.md: H value heads, h query/key heads, F the conv channels [q | k | v], W the conv window.
"""

from __future__ import annotations

import functools
from typing import Callable, ClassVar, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.torch_compat import view_base
from kernels.linear_attention.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from kernels.linear_attention.short_conv import causal_conv1d_silu
from models.footprint import LayerActivations, SequenceExchange
from models.layers import Documents
from models.qwen3_5_moe.args import Qwen3_5MoeArgs
from models.qwen3_5_moe.layers import GatedRMSNorm
from models.sequence_ops import Heads, HeadWeights, Passed, SequenceOp

DeltaRule = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # chunk_gated_delta_rule's signature
ShortConv = Callable[[torch.Tensor, torch.Tensor, Documents | None], torch.Tensor]  # causal_conv1d_silu's


def tiled_base(parts: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The contiguous [B, T, F] tensor whose last dim ``parts`` ([B, T, ...] each) tile in order, when they are its
    views: ``in_proj_qkv``'s output, which forward splits into q | k | v for the sequence op's sake. Taking it whole
    saves concatenating the parts again (a copy) and, in backward, the split's concatenation of their gradients.
    None otherwise: CP's all-to-all hands the op tensors of their own. (Under torch.compile too, which fuses the
    concatenation instead.)"""
    if torch.compiler.is_compiling():
        return None
    base = view_base(parts[0])
    if base is None or not base.is_contiguous() or base.dim() != 3:
        return None
    offset = base.storage_offset()
    for part in parts:
        if view_base(part) is not base or part.storage_offset() != offset or part.stride()[:2] != base.stride()[:2] \
                or not part[0, 0].is_contiguous():
            return None
        offset += part[0, 0].numel()
    return base if offset - base.storage_offset() == base.shape[-1] else None


class GatedDeltaNet(nn.Module):
    """in_proj_qkv -> depthwise causal conv (silu) -> q, k, v; beta = sigmoid(in_proj_b x);
    g = -exp(A_log) * softplus(in_proj_a x + dt_bias); o = delta_rule(l2norm q, l2norm k, v, g, beta);
    out = out_proj(norm(o, z = in_proj_z x)).

    ``self.delta_rule`` has ``chunk_gated_delta_rule``'s signature: the torch reference by default; a kernel
    registry may set a device kernel (e.g. flash-linear-attention's) or another chunk size per module; likewise
    ``self.short_conv`` (``kernels.linear_attention.short_conv.causal_conv1d_silu``).
    ``self.recurrent_delta_rule`` (the token-by-token form) serves short sequences evaluated without autograd.
    """

    kernel_slots: ClassVar[Mapping[str, str]] = {"delta_rule": "chunk_gated_delta_rule",
                                                 "recurrent_delta_rule": "fused_recurrent_gated_delta_rule",
                                                 "short_conv": "causal_conv1d_silu"}
    # q, k [B, t, h, k] (h heads shared by the value heads), v [B, t, H, v], g and beta [B, t, H], the conv taps of
    # q, k and v [heads, ., W] (whole), the documents whole; the output [B, t, H, v].
    sequence_ops: ClassVar[Mapping[str, SequenceOp]] = {"core_delta_rule": SequenceOp(
        args=(Heads(1, 2, shared=True), Heads(1, 2, shared=True), Heads(1, 2), Heads(1, 2), Heads(1, 2),
              (HeadWeights(0, shared=True), HeadWeights(0, shared=True), HeadWeights(0)), Passed()),
        out=Heads(1, 2))}
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
        # Depthwise and causal (kernels/linear_attention/short_conv.py); the module holds the weight under
        # transformers' name.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel_size=args.linear_conv_kernel_dim, groups=conv_dim,
                                padding=args.linear_conv_kernel_dim - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, D, bias=False)
        self.delta_rule: DeltaRule = functools.partial(chunk_gated_delta_rule, chunk_size=64)
        self.recurrent_delta_rule: DeltaRule = recurrent_gated_delta_rule
        self.short_conv: ShortConv = causal_conv1d_silu

    def forward(self, x_BTD: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        h, H, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        split_F = [self.key_dim, self.key_dim, self.value_dim]  # F = conv channels [q | k | v]
        q_BTF, k_BTF, v_BTF = self.in_proj_qkv(x_BTD).split(split_F, dim=-1)
        conv_q_FW, conv_k_FW, conv_v_FW = self.conv1d.weight[:, 0].split(split_F)
        beta_BTH = torch.sigmoid(self.in_proj_b(x_BTD))
        # fp32: in bf16/fp16, exp(A_log) times softplus could overflow or lose the decay's precision.
        g_BTH = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x_BTD).float() + self.dt_bias)
        o_BTHv = self.core_delta_rule(
            q_BTF.view(B, T, h, dk), k_BTF.view(B, T, h, dk), v_BTF.view(B, T, H, dv), g_BTH, beta_BTH,
            (conv_q_FW.view(h, dk, -1), conv_k_FW.view(h, dk, -1), conv_v_FW.view(H, dv, -1)), docs)
        z_BTHv = self.in_proj_z(x_BTD).view(B, T, H, dv)
        return self.out_proj(self.norm(o_BTHv, z_BTHv).reshape(B, T, -1))

    def core_delta_rule(self, q_BThk: torch.Tensor, k_BThk: torch.Tensor, v_BTHv: torch.Tensor, g_BTH: torch.Tensor,
                        beta_BTH: torch.Tensor, conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                        docs: Documents | None) -> torch.Tensor:
        """Causal conv (silu) and the delta rule over the whole sequence on the heads given: h q/k heads with their
        conv taps [h, k, W] (q and k) and H value heads with theirs [H, v, W]. A sequence op: CP passes a head shard.
        Packed documents reach the delta rule as ``cu_seqlens`` over the flattened rows (the recurrence, FLA's
        variable-length sequences in a batch of one)."""
        B, T, h, dk = q_BThk.shape
        H, dv = v_BTHv.shape[2:]
        qkv_BTF = tiled_base((q_BThk, k_BThk, v_BTHv))
        if qkv_BTF is None:
            qkv_BTF = torch.cat([x.flatten(2) for x in (q_BThk, k_BThk, v_BTHv)], dim=-1)
        w_FW = torch.cat([w.flatten(0, 1) for w in conv_weights])
        q_BTF, k_BTF, v_BTF = self.short_conv(qkv_BTF, w_FW, docs).split([h * dk, h * dk, H * dv], dim=-1)
        q_BThk, k_BThk, v_BTHv = q_BTF.reshape(B, T, h, dk), k_BTF.reshape(B, T, h, dk), v_BTF.reshape(B, T, H, dv)
        recurrent = T <= self.max_recurrent_len and not self.training and not torch.is_grad_enabled()
        rule = self.recurrent_delta_rule if recurrent else self.delta_rule
        if docs is None:
            o_BTHv, _ = rule(q_BThk, k_BThk, v_BTHv, g=g_BTH, beta=beta_BTH, use_qk_l2norm_in_kernel=True)
            return o_BTHv
        if not recurrent:  # the chunked rule takes the rows, and the offsets as the host knows them: no read back
            o_BTHv, _ = rule(q_BThk, k_BThk, v_BTHv, g=g_BTH, beta=beta_BTH, use_qk_l2norm_in_kernel=True,
                             cu_seqlens=docs.cu_seqlens_n1, cu_seqlens_cpu=docs.host_cu_seqlens_n1)
            return o_BTHv
        o_1NHv, _ = rule(*(x.flatten(0, 1)[None] for x in (q_BThk, k_BThk, v_BTHv)), g=g_BTH.flatten(0, 1)[None],
                         beta=beta_BTH.flatten(0, 1)[None], use_qk_l2norm_in_kernel=True, cu_seqlens=docs.cu_seqlens_n1)
        return o_1NHv.view(B, T, H, dv)

    def saved_activations(self) -> LayerActivations:
        """Per token, with the pre-norm before it, for FLA's chunked kernel. Without checkpointing: the norm's input
        and output, in_proj_qkv's output, the conv's output and its silu (F each), sigmoid(b), z, the delta rule's
        output and the gated norm's output (value dim each); fp32: a, g, the rstds. Selective: the projections'
        outputs and out_proj's."""
        D, H = self.out_proj.out_features, self.num_v_heads
        conv = 2 * self.key_dim + self.value_dim
        return LayerActivations(none=2 * D + 3 * conv + 3 * self.value_dim + H, none_fp32=3 * H + 1,
                                selective=conv + self.value_dim + 2 * H + D, selective_fp32=0)

    def cp_exchange(self, cp: int) -> SequenceExchange:
        """Per token: q and k (key heads repeated to cp when fewer), v and beta in the compute dtype, g in fp32;
        back, the output like v."""
        h = self.num_k_heads if self.num_k_heads % cp == 0 else cp
        return SequenceExchange(into=2 * h * self.head_k_dim + self.value_dim + self.num_v_heads,
                                into_fp32=self.num_v_heads, out=self.value_dim)
