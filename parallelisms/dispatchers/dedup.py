"""``dedup``: token-level dispatch. Each token crosses to each ep rank at most once, however many of its K
experts that rank holds; the rank runs them and sends back one row per token, already weighted and summed.

Letters as in DEVELOPERS.md: S rows sent, one per (destination rank, token) pair where the rank holds at least
one of the token's experts, rank-major, token order within a rank (s: one rank's block of them); R rows received;
here also U, the valid slots received (routed (token, k) slots whose expert is local), what ``fused`` receives
as rows.

Per layer:
source       routing per sent row: K local expert ids (sentinel G where slot k's expert sits elsewhere) and
             K router weights (0 there); one count exchange (rows per rank, slots per (rank, local expert)),
             the one host sync; all-to-all x [S, D] (in e4m3 under dispatcher.fp8_dispatch), weights [S, K]
             (autograd) and ids [S, K].
destination  the U valid slots gathered in local-expert order, grouped GEMM, then each row's K slots
             weighted and summed (``kernels.moe.permute.unpermute``; masked slots weigh 0); all-to-all back [R, D].
source       the <= P rows of each token summed.
sum_p sum_{k on p} w_k y_k = sum_k w_k y_k: eager's result up to summation order. Every map is a gather
whose backward is a gather-sum by a known inverse (or, for a token's rows, one index_add per rank block, no
two of whose rows share a token): no boolean-mask indexing, nonzero or bincount (each a host sync on CUDA),
no [R*K, D] tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.torch_compat import all_to_all_single, all_to_all_single_autograd
from kernels.moe.permute import gather_sum, inverse_permutation, unpermute
from models.moe import ExpertWeights, expert_counts
from parallelisms.dispatchers import local_ops
from parallelisms.dispatchers.base import INT64, Dispatcher, LayerShape, Traffic, register, token_ranks
from parallelisms.dispatchers.common import exchange_counts, group_device_type
from parallelisms.dispatchers.config import DispatcherConfig
from parallelisms.dispatchers.fp8 import fp8_all_to_all, fp8_configured

NOT_ON_NPU = "dispatcher=dedup runs on CUDA/CPU; on NPU use fused or mc2"


def _sum_token_rows(rows_SD: torch.Tensor, token_S: torch.Tensor, send: list[int], N: int) -> torch.Tensor:
    """out[n] = the sum of token n's rows. A rank's block holds each token at most once, so one index_add_
    per block never adds two rows into one token at once: deterministic on CUDA, unlike one index_add_ over
    all S rows (racing atomics)."""
    out_ND = rows_SD.new_zeros(N, rows_SD.shape[1])
    for token_s, rows_sD in zip(token_S.split(send), rows_SD.split(send)):
        out_ND.index_add_(0, token_s, rows_sD)
    return out_ND


class _TokenRows(torch.autograd.Function):
    """x_ND -> x_SD = x_ND[token_S], the rows to send; backward sums each token's row gradients."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, token_S: torch.Tensor, send: list[int]) -> torch.Tensor:
        ctx.save_for_backward(token_S)
        ctx.meta = send, x_ND.shape[0]
        return x_ND.index_select(0, token_S)

    @staticmethod
    def backward(ctx, grad_SD: torch.Tensor):
        (token_S,) = ctx.saved_tensors
        return _sum_token_rows(grad_SD.contiguous(), token_S, *ctx.meta), None, None


class _SumTokenRows(torch.autograd.Function):
    """y_SD (the rows back, in send order) -> y_ND, each token's rows summed; backward gathers."""

    @staticmethod
    def forward(ctx, y_SD: torch.Tensor, token_S: torch.Tensor, send: list[int], N: int) -> torch.Tensor:
        ctx.save_for_backward(token_S)
        return _sum_token_rows(y_SD, token_S, send, N)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        (token_S,) = ctx.saved_tensors
        return grad_ND.contiguous().index_select(0, token_S), None, None, None


class _SlotRows(torch.autograd.Function):
    """x_RD -> x_UD: each received row copied to its valid slots, in local-expert order (slot_U: flat (row, k)
    slot of each). Backward sums each row's slot gradients (``gather_sum`` with 0/1 weights, since a masked slot
    repeats a valid one): no atomics."""

    @staticmethod
    def forward(ctx, x_RD: torch.Tensor, slot_U: torch.Tensor, inv_RK: torch.Tensor,
                valid_RK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slot_U, inv_RK, valid_RK)
        return x_RD.index_select(0, slot_U.div(inv_RK.shape[1], rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad_UD: torch.Tensor):
        slot_U, inv_RK, valid_RK = ctx.saved_tensors
        R, K = inv_RK.shape
        return gather_sum(grad_UD, inv_RK.flatten(), R, K, valid_RK.to(grad_UD.dtype)), None, None, None


@register("dedup")
class DedupDispatcher(Dispatcher):
    config_keys = ("fp8_dispatch",)
    fp8 = False  # dispatcher.fp8_dispatch (configure)

    def configure(self, cfg: DispatcherConfig) -> None:
        self.fp8 = fp8_configured(cfg, self.device_type)

    @classmethod
    def traffic(cls, shape: LayerShape) -> list[Traffic]:
        """S rows a rank sends, one per (token, rank holding any of its experts): N x ``token_ranks`` (exact for
        round-robin routing, the expectation for learned). Forward: both counts in one exchange (2 E), the rows
        (e4m3 under dispatcher.fp8_dispatch), their K router weights and K local ids, the pre-reduced rows back;
        backward: the rows' gradient out, the rows' and the weights' gradients back."""
        S = round(shape.tokens * token_ranks(shape))
        D, K, b = shape.hidden, shape.top_k, shape.element_bytes
        return [Traffic("expert counts", 1, 2 * shape.num_experts * INT64),
                Traffic("token rows", 2, shape.dispatched_row_bytes(S) + S * D * b, 2, 2 * S * D * b),
                Traffic("router weights and ids", 2, S * K * (b + INT64), 1, S * K * b)]

    def __init__(self, group: dist.ProcessGroup, num_experts: int, device_type: str | None = None) -> None:
        # torch_npu's permute / unpermute take a fixed K rows per token; the rows here have 1..K valid slots.
        if (device_type or group_device_type(group)) == "npu":
            raise NotImplementedError(NOT_ON_NPU)
        super().__init__(group, num_experts, device_type)

    def dispatch(self, experts: ExpertWeights, x_ND: torch.Tensor, experts_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> torch.Tensor:
        N, K = experts_NK.shape
        P, G = self.ep, self.num_local

        # Source: one row per (rank, token) pair the token must reach. A stable sort of "not hit" puts the
        # pairs first, rank-major, tokens in order; how many there are is known after the count exchange.
        rank_NK = experts_NK.div(G, rounding_mode="floor")
        hit_PN = torch.zeros(P, N, dtype=torch.bool, device=x_ND.device).scatter_(0, rank_NK.T, True)
        order_PN = torch.argsort((~hit_PN).flatten().to(torch.int8), stable=True)  # flat p * N + n
        rows_P = hit_PN.sum(1)
        # Both counts in one exchange (one host sync): slots per (rank, local expert) as chunk 0, rows per
        # rank as chunk 1, carried in the count of the rank's first local expert.
        slots, rows = exchange_counts(torch.stack([expert_counts(experts_NK, self.num_experts),
                                                   F.pad(rows_P[:, None], (0, G - 1)).flatten()]),
                                      self.group, G)
        S, U = sum(rows.send), sum(slots.counts_G)
        rank_S = torch.repeat_interleave(torch.arange(P, device=x_ND.device), rows_P, output_size=S)
        token_S = order_PN[:S] - rank_S * N
        local_SK = experts_NK.index_select(0, token_S) - rank_S[:, None] * G
        here_SK = (local_SK >= 0) & (local_SK < G)
        ids_SK = torch.where(here_SK, local_SK, G)
        # The other ranks' slots add nothing. Backward: each (n, k) gets its one gradient plus zeros, exact in
        # any order, so index_select's index_add backward stays deterministic here.
        w_SK = torch.where(here_SK, weights_NK.index_select(0, token_S), 0)

        x_RD = (fp8_all_to_all if self.fp8 else all_to_all_single_autograd)(
            _TokenRows.apply(x_ND, token_S, rows.send), rows.recv, rows.send, self.group)
        w_RK = all_to_all_single_autograd(w_SK, rows.recv, rows.send, self.group)
        ids_RK = all_to_all_single(ids_SK, rows.recv, rows.send, self.group)

        # Destination: the valid slots by local expert (stable: source rank, token, k within an expert), the
        # sentinel G last; the first U of them are the valid ones.
        order_RK = torch.argsort(ids_RK.flatten(), stable=True)
        slot_U = order_RK[:U]
        pos_RK = inverse_permutation(order_RK).view(-1, K)
        valid_RK = pos_RK < U
        # A masked slot (weight 0) reads its own row's first valid slot, never another token's: a 0 * inf
        # can then only touch a token whose output is inf already.
        inv_RK = torch.where(valid_RK, pos_RK, pos_RK.amin(1, keepdim=True))
        x_UD = _SlotRows.apply(x_RD, slot_U, inv_RK, valid_RK)
        y_UD = local_ops.compute(experts, x_UD, slots)
        # Pre-reduce each row's K slots with the router weights. Slots repeat rows, so no permutation; a masked
        # slot's weight gradient is the dot of the slot it repeats, and the source's torch.where drops it.
        y_RD = unpermute(y_UD, w_RK, slot_U, inv_RK.flatten(), permutation=False)

        y_SD = all_to_all_single_autograd(y_RD, rows.send, rows.recv, self.group)
        return _SumTokenRows.apply(y_SD, token_S, rows.send, N)
