"""``domino``: the tokens split in two halves, one half's all-to-all in flight while the other half's experts run.

Forward, in issue order (comm = the collective's own stream, where NCCL/HCCL run every collective):
    permute both halves; one count exchange for both (still one host sync per layer)
    comm:    [dispatch 0][dispatch 1]            [combine 0]            [combine 1]
    compute:             [wait 0][experts 0    ][wait 1][experts 1    ][wait c0][unpermute 0][wait c1][unpermute 1]
so dispatch 1 overlaps experts 0 and combine 0 overlaps experts 1. The waits are ``wait_tensor`` on the
functional collectives: on CUDA/NPU the compute stream waits on the collective's event and the host runs on,
so no stream of our own is needed; on gloo (CPU) the same code runs, the collectives on gloo's threads.

Backward mirrors it. Each all-to-all is a pair of autograd nodes, start (issues) and wait: the wait's backward
issues the reverse all-to-all, the start's backward waits for it. The engine runs ready nodes latest-created
first, so the creation order above gives: send back combine-1's and combine-0's gradients, wait for the first,
run experts-1 backward while the second is in flight, send back its dispatch gradient, then experts-0 backward
while that one is in flight. Results equal eager's up to summation order (the same local ops as ``fused``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.torch_compat import C10D_FUNCTIONAL
from models.moe import ExpertWeights
from parallelisms.dispatchers import local_ops
from parallelisms.dispatchers.base import Dispatcher, register
from parallelisms.dispatchers.common import exchange_counts
from parallelisms.dispatchers.config import DispatcherConfig
from parallelisms.dispatchers.fp8 import Fp8InFlight, fp8_configured

_all_to_all = C10D_FUNCTIONAL.all_to_all_single
_wait = C10D_FUNCTIONAL.wait_tensor


@dataclass
class _Backward:
    """Shared by one all-to-all's start and wait nodes: the reverse all-to-all in flight in backward."""

    grad: torch.Tensor | None = None


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str,
                box: _Backward) -> torch.Tensor:
        ctx.box = box
        return _all_to_all(x.contiguous(), out_splits, in_splits, group_name)

    @staticmethod
    def backward(ctx, _identity: torch.Tensor):
        # The gradient was sent back by _Wait.backward; what arrives here is the untouched pre-send gradient.
        grad, ctx.box.grad = _wait(ctx.box.grad), None
        return grad, None, None, None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str,
                box: _Backward) -> torch.Tensor:
        ctx.meta = out_splits, in_splits, group_name
        ctx.box = box
        return _wait(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits, group_name = ctx.meta
        ctx.box.grad = _all_to_all(grad.contiguous(), in_splits, out_splits, group_name)
        return grad, None, None, None, None


class _InFlight:
    """An all-to-all issued now and waited for at ``wait()``, both directions."""

    def __init__(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup):
        self.args = (out_splits, in_splits, group.group_name, _Backward())
        self.tensor = _Start.apply(x, *self.args)

    def wait(self) -> torch.Tensor:
        return _Wait.apply(self.tensor, *self.args)


@register("domino")
class DominoDispatcher(Dispatcher):
    chunks = 2
    config_keys = ("fp8_dispatch",)
    fp8 = False  # dispatcher.fp8_dispatch (configure): each half's dispatch in e4m3

    def configure(self, cfg: DispatcherConfig) -> None:
        self.fp8 = fp8_configured(cfg, self.device_type)

    def dispatch(self, experts: ExpertWeights, x_ND: torch.Tensor, experts_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> torch.Tensor:
        N = x_ND.shape[0]
        halves = [(N + 1) // 2, N // 2]  # by tokens; either may be empty, and splits stay collective-safe
        permuted = [local_ops.permute(x, e, self.num_experts) for x, e in zip(x_ND.split(halves),
                                                                              experts_NK.split(halves))]
        splits = exchange_counts(torch.stack([counts_E for _, counts_E, _ in permuted]), self.group, self.num_local)

        in_flight = Fp8InFlight if self.fp8 else _InFlight
        dispatched = [in_flight(x_MD, s.recv, s.send, self.group) for (x_MD, _, _), s in zip(permuted, splits)]
        combined = []
        for flight, s in zip(dispatched, splits):
            y_RD = local_ops.run_local_experts(experts, flight.wait(), s)  # overlaps the other half's dispatch
            combined.append(_InFlight(y_RD, s.send, s.recv, self.group))
        return torch.cat([local_ops.unpermute(flight.wait(), w_NK, state) for flight, w_NK, (_, _, state)
                          in zip(combined, weights_NK.split(halves), permuted)])
