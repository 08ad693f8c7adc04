"""``capacity``: EP with no host synchronisation on the token path. Every all-to-all has equal, static splits, so
no split size ever goes to the host.

Letters as in DEVELOPERS.md; here C is the capacity, the rows each rank sends every peer (a chunk of the
buffer), ``C = min(ceil(capacity_factor * N * K / P), N * K)``, and S = P * C the rows sent, which equal the
rows received.

Per layer:
source       the routed rows in expert order (rank-major); row j of those for peer p goes to slot p * C + j
             of a zero-filled [S, D] buffer if j < C. One all-to-all of the buffer, and one of the counts per
             (peer, local expert) with each rank's largest row count for a peer (ints, [P, G + 1]).
destination  the arrivals of peer p are its first min(rows, C) slots, by local expert; the rest is padding.
             The rows are regrouped by local expert with the padding last (in the last expert's group), the
             grouped GEMM runs, the rows go back to arrival order and are all-to-all'ed back (equal splits).
source       each token's K slots read back and weighted by the router scores (``kernels.moe.permute.unpermute``).
Every size on the way is C or a device tensor: no ``.tolist()``, ``.item()``, nonzero, boolean-mask indexing
or bincount. Padding rows are zero, so the experts map them to zero and they add nothing to any weight
gradient; no token slot reads them, so they add nothing to any output or input gradient.

Costs: the buffer moves S rows however few are real, and the grouped GEMM runs on all S (its padding included);
``fused`` moves and multiplies M. All ranks of the ep group must have the same N (train.py's micro-batches do):
C is computed from it on each rank, and the all-to-alls of ranks with different C do not match.

Overflow (more than C rows for one peer) drops the rows past C in that step (their slots add 0, as
capacity-limited MoE training does) and is not silent: the count exchange carries every rank's largest row
count for a peer, so each rank of the group knows the group's worst on the device; a copy to the host is
queued without waiting, and the next ``dispatch`` of the layer (the next step's forward, after the trainer's
own sync) raises with the numbers. ``raise_if_overflowed`` checks at once, for a caller that has just synced.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from core import device
from core.torch_compat import all_to_all_single, all_to_all_single_autograd
from kernels.moe.permute import gather_sum, inverse_permutation, unpermute
from models.moe import ExpertWeights, expert_counts
from parallelisms.dispatchers import local_ops
from parallelisms.dispatchers.base import INT64, Dispatcher, LayerShape, Traffic, register
from parallelisms.dispatchers.config import DispatcherConfig


class _ToSlots(torch.autograd.Function):
    """x_ND -> x_SD, the send buffer: slot s holds token token_S[s] where valid_S[s], zeros elsewhere (padding).
    Backward: each token sums the gradients of its kept slots (``gather_sum`` with 0/1 weights; a dropped slot
    reads slot 0 with weight 0), no atomics."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, token_S: torch.Tensor, valid_S: torch.Tensor, slot_NK: torch.Tensor,
                kept_NK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slot_NK, kept_NK)
        return torch.where(valid_S[:, None], x_ND.index_select(0, token_S), 0)

    @staticmethod
    def backward(ctx, grad_SD: torch.Tensor):
        slot_NK, kept_NK = ctx.saved_tensors
        N, K = slot_NK.shape
        grad_ND = gather_sum(grad_SD.contiguous(), slot_NK.flatten(), N, K, kept_NK.to(grad_SD.dtype))
        return grad_ND, None, None, None, None


@register("capacity")
class CapacityDispatcher(Dispatcher):
    config_keys = ("capacity_factor",)
    drops_rows = True

    @classmethod
    def traffic(cls, shape: LayerShape) -> list[Traffic]:
        """Its static buffer, whatever the routing: S = P x C rows each way with the padding (C =
        min(ceil(capacity_factor x N x K / P), N x K)), and one count exchange of P x (G + 1) counts."""
        P, N, K = shape.ep, shape.tokens, shape.top_k
        S = P * min(math.ceil(shape.cfg.capacity_factor * N * K / P), N * K)
        rows = S * shape.hidden * shape.element_bytes
        return [Traffic("expert counts", 1, (shape.num_experts + P) * INT64),
                Traffic("routed rows", 2, 2 * rows, 2, 2 * rows)]

    def __init__(self, group: dist.ProcessGroup, num_experts: int, device_type: str | None = None) -> None:
        super().__init__(group, num_experts, device_type)
        self.capacity_factor = DispatcherConfig.capacity_factor
        self._worst = None  # device int64 [1]: the group's largest rows-for-one-peer minus C, over the calls so far
        self._capacity = 0  # the C of the last call, for the message
        self._host = None  # its host copy, queued without waiting
        self._landed = None  # the event after that copy (None on the CPU, where the copy is done at once)

    @classmethod
    def validate_config(cls, cfg: DispatcherConfig) -> None:
        if not cfg.capacity_factor > 0:
            raise ValueError(f"dispatcher.capacity_factor={cfg.capacity_factor} must be > 0 (rows per peer = "
                             "ceil(capacity_factor * tokens * top_k / ep))")

    def configure(self, cfg: DispatcherConfig) -> None:
        """Take ``dispatcher.capacity_factor`` from the config group."""
        self.capacity_factor = cfg.capacity_factor

    def capacity(self, N: int, K: int) -> int:
        """C, the rows sent to each peer: a host int from host ints, the same on every rank of equal N."""
        return min(math.ceil(self.capacity_factor * N * K / self.ep), N * K)

    def dispatch(self, experts: ExpertWeights, x_ND: torch.Tensor, experts_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> torch.Tensor:
        self.raise_if_overflowed()  # an earlier call's overflow, once its host copy has landed
        x_SD, arrival_counts_PG, counts_G, combine = self.send(x_ND, experts_NK, weights_NK)
        return combine(local_ops.run_in_arrival_order(experts, x_SD, arrival_counts_PG, counts_G))

    def send(self, x_ND: torch.Tensor, experts_NK: torch.Tensor, weights_NK: torch.Tensor):
        """The dispatch half: -> (the rows received [S, D] as they arrived, the arrival counts per (source, local
        expert | padding) [P, G + 1], rows per local expert [G] with the padding in the last, and ``combine``:
        the experts' outputs in arrival order [S, D] -> y_ND). Separate from the experts so a test can check
        that the two halves never read a device value on the host."""
        N, K = experts_NK.shape
        P, G, E = self.ep, self.num_local, self.num_experts
        C = self.capacity(N, K)
        S, dev = P * C, x_ND.device

        # Source: slot of each routed row, rows in expert order (rank-major); past C a row is dropped and its
        # scatters below land on a dump slot S, cut off after.
        order_M = torch.argsort(experts_NK.flatten(), stable=True)
        counts_PG = expert_counts(experts_NK, E).view(P, G)
        rows_P = counts_PG.sum(1)
        rank_M = experts_NK.flatten().index_select(0, order_M).div(G, rounding_mode="floor")
        j_M = torch.arange(N * K, device=dev) - (rows_P.cumsum(0) - rows_P).index_select(0, rank_M)
        kept_M = j_M < C
        dest_M = torch.where(kept_M, rank_M * C + j_M, S)
        flat_S = torch.zeros(S + 1, dtype=order_M.dtype, device=dev).scatter_(0, dest_M, order_M)[:S]
        valid_S = torch.zeros(S + 1, dtype=torch.bool, device=dev).scatter_(0, dest_M, kept_M)[:S]
        inv_M = inverse_permutation(order_M)
        slot_NK = torch.where(kept_M, dest_M, 0).index_select(0, inv_M).view(N, K)
        kept_NK = kept_M.index_select(0, inv_M).view(N, K)

        # Counts: per (peer, local expert), and this rank's largest row count for a peer in column G, so every
        # rank learns the group's worst (the max over what it receives) without another collective.
        send_PG = torch.cat([counts_PG, rows_P.amax().expand(P, 1)], 1)
        recv_PG = all_to_all_single(send_PG.flatten(), None, None, self.group).view(P, G + 1)
        self._note(recv_PG[:, G].amax() - C, C)
        # Each source's arrivals: its rows per local expert, cut at C (what it kept), then its padding.
        ends_PG = recv_PG[:, :G].cumsum(1).clamp(max=C)
        kept_PG = ends_PG - F.pad(ends_PG[:, :-1], (1, 0))
        arrival_counts_PG = torch.cat([kept_PG, C - ends_PG[:, -1:]], 1)
        counts_G = kept_PG.sum(0) + F.pad(arrival_counts_PG[:, G:].sum(0), (G - 1, 0))

        x_SD = all_to_all_single_autograd(_ToSlots.apply(x_ND, flat_S.div(K, rounding_mode="floor"), valid_S,
                                                         slot_NK, kept_NK), None, None, self.group)
        # A dropped slot reads slot 0 with weight 0; the torch.where keeps its router weight's gradient at 0.
        w_NK = torch.where(kept_NK, weights_NK, 0)

        def combine(y_SD: torch.Tensor) -> torch.Tensor:
            y_SD = all_to_all_single_autograd(y_SD, None, None, self.group)
            # Slots repeat no row, but rows (padding) may have no slot: permutation=False takes the torch
            # backward, which gives a padding row a finite gradient that meets its zero input in the experts.
            return unpermute(y_SD, w_NK, flat_S, slot_NK.flatten(), permutation=False)

        return x_SD, arrival_counts_PG, counts_G, combine

    def _note(self, excess: torch.Tensor, capacity: int) -> None:
        """Keep the group's worst excess on the device and queue its copy to the host (no wait)."""
        self._worst = excess.view(1) if self._worst is None else torch.maximum(self._worst, excess.view(1))
        self._capacity = capacity
        accelerator = self.device_type != "cpu"
        if self._host is None:
            self._host = torch.empty(1, dtype=self._worst.dtype, pin_memory=accelerator)
        self._host.copy_(self._worst, non_blocking=accelerator)
        if accelerator:
            self._landed = device.module(self.device_type).Event()
            self._landed.record()

    def raise_if_overflowed(self) -> None:
        """Raise if a call so far sent more rows to a peer than C, as far as the host copy shows now (it never
        waits; a copy still in flight is read by a later call)."""
        if self._host is None or (self._landed is not None and not self._landed.query()):
            return
        excess = int(self._host.numpy()[0])  # a host tensor: numpy, so no Tensor.item even here
        if excess > 0:
            raise RuntimeError(
                f"dispatcher=capacity overflowed: an ep rank had {self._capacity + excess} rows for one peer, over "
                f"its capacity of {self._capacity} (dispatcher.capacity_factor={self.capacity_factor}); the rows "
                f"past it were dropped in that step. Raise dispatcher.capacity_factor (>= {self.ep}, the ep size, "
                "never overflows) or use dispatcher=fused")
