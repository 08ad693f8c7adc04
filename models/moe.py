"""Mixture-of-experts pieces shared by the families: softmax top-k router, fused expert weights, the expert
computation and the local (single-rank) token dispatcher.

The experts delegate token movement to ``self.dispatcher``: the model only ever sees the local one,
and ``parallelisms/`` swaps in an expert-parallel dispatcher (all-to-all; the interface is
``parallelisms.dispatchers.base.Dispatcher``) without the model knowing. Every dispatcher runs the experts
through ``compute_experts``, with the weights it holds passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.moe.grouped_mm import grouped_mm
from kernels.moe.permute import (RoutedRows, moe_token_permute, moe_token_routed_rows, moe_token_unpermute,
                             moe_token_unpermute_torch)
from kernels.tokenwise.swiglu import packed_swiglu
from models.footprint import LayerActivations


@dataclass
class RouterStats:
    """Per-layer routing statistics: what the Switch aux loss and the MoE metrics are made of."""

    counts_E: torch.Tensor  # routed slots per expert (fp32, no grad)
    prob_sum_E: torch.Tensor  # sum over tokens of the router probability of each expert (fp32, with grad)
    num_tokens: int
    entropy_sum: torch.Tensor  # sum over tokens of the routing distribution's entropy (fp32, no grad)
    z_sum: torch.Tensor  # sum over tokens of logsumexp(router logits)^2 (fp32, with grad): the router z-loss's


class TopKRouter(nn.Module):
    """``p = softmax(x W^T)`` in fp32, top-k, optional renormalisation; weights back in x's dtype.

    With ``expert_bias`` (aux-loss-free load balancing, DeepSeek-V3): a per-expert bias is added to p for the top-k
    choice only, the weights stay p's; ``update_expert_bias`` moves it between steps. It is a buffer (saved in
    checkpoints, not trained by the optimizer) that no Hugging Face checkpoint holds: zero at initialisation and
    after loading one (``reset_expert_bias``), and dropped by the export (transformers' router has none).
    ``z_loss``: the z sum of the stats carries a gradient (else it is computed for the metrics only, keeping
    nothing for backward). ``force_balance`` (benchmarks only): the choice is ``round_robin_experts`` over each row
    of ``row_len`` tokens, whatever p says; the weights stay p's."""

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool, expert_bias: bool = False,
                 z_loss: bool = False, force_balance: bool = False) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.z_loss = z_loss
        self.force_balance = force_balance
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("expert_bias", torch.zeros(num_experts) if expert_bias else None)

    def forward(self, x_ND: torch.Tensor, row_len: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, RouterStats]:
        logits_NE = F.linear(x_ND, self.weight)
        probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float32)
        if self.force_balance:
            experts_NK = round_robin_experts(*probs_NE.shape, self.top_k, row_len or x_ND.shape[0], x_ND.device)
            weights_NK = probs_NE.gather(-1, experts_NK)
        elif self.expert_bias is None:
            weights_NK, experts_NK = torch.topk(probs_NE, self.top_k, dim=-1)
        else:
            experts_NK = torch.topk(probs_NE + self.expert_bias, self.top_k, dim=-1).indices
            weights_NK = probs_NE.gather(-1, experts_NK)
        if self.norm_topk_prob:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        num_experts = probs_NE.shape[-1]
        with torch.no_grad():
            entropy_sum = -(probs_NE * probs_NE.clamp_min(1e-20).log()).sum()
        with torch.set_grad_enabled(self.z_loss and torch.is_grad_enabled()):
            z_sum = torch.logsumexp(logits_NE.float(), dim=-1).square().sum()
        stats = RouterStats(
            counts_E=expert_counts(experts_NK, num_experts).float(),
            prob_sum_E=probs_NE.sum(dim=0),
            num_tokens=x_ND.shape[0],
            entropy_sum=entropy_sum,
            z_sum=z_sum,
        )
        return weights_NK.to(logits_NE.dtype), experts_NK, stats

    @torch.no_grad()
    def update_expert_bias(self, counts_E: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's update from the global batch's routed slots per expert: ``rate`` up for the experts below
        the mean load, down for those above (its sign), centred so the biases keep a zero mean (torchtitan's)."""
        delta_E = rate * torch.sign(counts_E.mean() - counts_E)
        self.expert_bias.add_(delta_E - delta_E.mean())

    @torch.no_grad()
    def reset_expert_bias(self) -> None:
        if self.expert_bias is not None:
            self.expert_bias.zero_()


def round_robin_experts(num_tokens: int, num_experts: int, top_k: int, row_len: int,
                        device: torch.device) -> torch.Tensor:
    """experts_NK of equal loads whatever the tokens: slot k of the token at position t of its row of ``row_len``
    goes to expert (t K + k) mod E. A token's K experts are distinct (K <= E); each row gives every expert T K / E
    slots, give or take one. By position, not by the rank's token count, so every layout routes every token as one
    process does (under context parallelism, whose ranks hold 1/cp of each row, when T / cp x K is a multiple of E).
    """
    t_N = torch.arange(num_tokens, device=device) % row_len
    return (t_N[:, None] * top_k + torch.arange(top_k, device=device)) % num_experts


class ExpertWeights(NamedTuple):
    """What the expert computation runs on: the experts' fused SwiGLU projections and the activation kernel
    between them. E is whatever experts the holder runs: all of them, or under EP one rank's local ones."""

    gate_up_proj: torch.Tensor  # [E, 2I, D], rows [gate; up]
    down_proj: torch.Tensor  # [E, D, I]
    act_fn: Callable[[torch.Tensor], torch.Tensor]  # [M, 2I] -> [M, I]: the packed_swiglu kernel slot
    mm: Callable[..., torch.Tensor] = grouped_mm  # the grouped GEMM, as GroupedExperts.grouped_mm says


def compute_experts(w: ExpertWeights, x_MD: torch.Tensor | RoutedRows, counts_E: torch.Tensor,
                    counts_host: list[int] | None = None) -> torch.Tensor:
    """Rows of x_MD sorted by expert (``counts_E`` rows for each of w's E experts, in order) -> the expert
    outputs [M, D], same order. The weights are plain tensors (a rank's local blocks under EP). ``counts_host``:
    the same counts as Python ints where the caller has them (a grouped GEMM kernel may need them on the host).
    ``RoutedRows``: the rows not yet gathered; a grouped GEMM with a ``gathered`` form (FP8) fuses the gather."""
    w_gate_up = w.gate_up_proj.transpose(-2, -1)
    if isinstance(x_MD, RoutedRows):
        gathered = getattr(w.mm, "gathered", None)
        gate_up_M2I = (gathered(x_MD, w_gate_up, counts_E, counts_host) if gathered is not None
                       else w.mm(x_MD.gather(), w_gate_up, counts_E, counts_host))
    else:
        gate_up_M2I = w.mm(x_MD, w_gate_up, counts_E, counts_host)
    return w.mm(w.act_fn(gate_up_M2I), w.down_proj.transpose(-2, -1), counts_E, counts_host)


# A GroupedExperts.dispatcher: (weights as the module holds them, x_ND, experts_NK, weights_NK) -> y_ND.
DispatchFn = Callable[[ExpertWeights, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LocalDispatcher:
    """All experts live on this rank: permute the routed rows into expert order, run them, unpermute with the
    router weights. The reference every expert-parallel dispatcher reproduces (same call,
    ``parallelisms.dispatchers.base.Dispatcher``).

    The token moves are ``kernels.moe.permute``'s, the kernels the registry installs (on CUDA the Triton K-to-one
    gathers and sums the fused dispatcher uses): gathers whose backward is a gather, no ``index_add_`` or
    ``index_put_`` with atomics, and nothing read back to the host (the grouped GEMM's offsets are a device
    cumsum of ``counts_E``)."""

    def __call__(self, experts: ExpertWeights, x_ND: torch.Tensor, experts_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> torch.Tensor:
        counts_E = expert_counts(experts_NK, experts.gate_up_proj.shape[0])
        if getattr(experts.mm, "gathered", None) is not None:
            # A grouped GEMM that fuses the gather (FP8, CUDA only): the torch permute's rows, ungathered, and
            # its own unpermute (the installed one may be another device's, with another state).
            rows, state = moe_token_routed_rows(x_ND, experts_NK)
            return moe_token_unpermute_torch(compute_experts(experts, rows, counts_E), weights_NK, state)
        x_MD, state = moe_token_permute(x_ND, experts_NK)
        return moe_token_unpermute(compute_experts(experts, x_MD, counts_E), weights_NK, state)


def sort_by_expert(experts_NK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable order of the flattened (token, k) slots by expert id, and the slot count per expert."""
    flat_M = experts_NK.flatten()
    return torch.argsort(flat_M, stable=True), expert_counts(experts_NK, num_experts)


def expert_counts(experts_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed rows per expert [E]. Not ``torch.bincount``: on CUDA it reads the input's min and max back to
    the host (two syncs per call); integer index_add is exact and stays on the device."""
    flat_M = experts_NK.flatten()
    return flat_M.new_zeros(num_experts).index_add_(0, flat_M, torch.ones_like(flat_M))


def combine(out_MD: torch.Tensor, weights_M: torch.Tensor, token_M: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Weight each routed row by its router score and sum the K rows of every token."""
    out_MD = out_MD * weights_M[:, None].to(out_MD.dtype)
    y_ND = out_MD.new_zeros(num_tokens, out_MD.shape[1])
    return y_ND.index_add_(0, token_M, out_MD)


class GroupedExperts(nn.Module):
    """SwiGLU experts stored fused as in transformers 5: gate_up_proj [E, 2I, D] (rows [gate; up]) and
    down_proj [E, D, I]. Under expert parallelism E is the local expert count."""

    kernel_slots: ClassVar[Mapping[str, str]] = {"act_fn": "packed_swiglu"}

    def __init__(self, num_experts: int, dim: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, intermediate))
        self.dispatcher: DispatchFn = LocalDispatcher()
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = packed_swiglu
        # The grouped GEMM (kernels.moe.grouped_mm's call): the registry's kernel, unless parallelisms.float8 sets
        # another product (FP8) for these experts.
        self.grouped_mm: Callable[..., torch.Tensor] = grouped_mm

    def forward(self, x_ND: torch.Tensor, experts_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        return self.dispatcher(self.expert_weights(), x_ND, experts_NK, weights_NK)

    def expert_weights(self) -> ExpertWeights:
        """The weights as this module holds them now (under EP: DTensors of global shape [E, ...], which the
        dispatcher turns into its local blocks), the activation kernel the registry put in the slot and the grouped
        GEMM."""
        return ExpertWeights(self.gate_up_proj, self.down_proj, self.act_fn, self.grouped_mm)


class SparseMoeBlock(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, intermediate: int, norm_topk_prob: bool,
                 expert_bias: bool = False, z_loss: bool = False, force_balance: bool = False) -> None:
        super().__init__()
        self.gate = TopKRouter(dim, num_experts, top_k, norm_topk_prob, expert_bias, z_loss, force_balance)
        self.experts = GroupedExperts(num_experts, dim, intermediate)

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        weights_NK, experts_NK, stats = self.gate(x_ND, row_len=x_BTD.shape[1])
        y_ND = self.experts(x_ND, experts_NK, weights_NK)
        return y_ND.view_as(x_BTD), stats

    def saved_activations(self) -> LayerActivations:
        """Per token, with the pre-norm before it, without the routed experts' rows (the dispatcher's: see
        ``training.planner``). Without checkpointing: the norm's input and output; fp32: its rstd, the router's
        probabilities, the top-k ids (int64: two fp32 each) and weights. Selective: the router logits."""
        D, E, K = self.gate.weight.shape[1], self.gate.weight.shape[0], self.gate.top_k
        return LayerActivations(none=2 * D, none_fp32=1 + E + 3 * K, selective=E, selective_fp32=0)

