"""The EP dispatcher interface and its registry.

A dispatcher is ``GroupedExperts.dispatcher`` under expert parallelism (``models.moe.LocalDispatcher`` is the
single-rank one it must reproduce). Adding one takes two files: a module in this package with a ``Dispatcher``
subclass decorated ``@register("<name>")`` (the package imports every module, so nothing else names it), and
``conf/dispatcher/<name>.yaml`` (``name: <name>`` under a one-line comment) so ``dispatcher=<name>`` composes.
The tests check that the two sets agree.

Letters as in DEVELOPERS.md: N tokens on this rank, E experts in all, P ep ranks, G = E / P local experts (ep rank
p holds experts [p*G, (p+1)*G)).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar, TypeVar

import torch
import torch.distributed as dist

from models.moe import ExpertWeights
from parallelisms.dispatchers.common import group_device_type, local_weights
from parallelisms.dispatchers.config import DispatcherConfig


class Dispatcher(ABC):
    """Moves every routed row (token, k) to the ep rank that holds its expert, runs that rank's experts on what
    arrives, and brings the outputs back, weighted by the router scores and summed over k.

    Built once per MoE layer by ``parallelisms.expert_parallel.apply_expert_parallel`` and called in that
    layer's forward. The call is collective over the ep group: every rank makes it, also with no tokens.
    """

    name: ClassVar[str]  # the registered name, dispatcher.name (set by @register)
    # May drop rows (a static capacity): the host learns of it after the step's read, so the trainer must not
    # queue the optimizer's update before that read.
    drops_rows: ClassVar[bool] = False

    def __init__(self, group: dist.ProcessGroup, num_experts: int, device_type: str | None = None) -> None:
        """``group``: the ep process group (P ranks). ``num_experts``: E, all experts of the layer.
        ``device_type``: where the collectives run (cuda, npu, cpu); None reads it from the group's backend (nccl,
        hccl, gloo). The local kernels are the registry's (``kernels/registry.py``), not chosen here. Tests pass
        ``npu`` on gloo to reach NPU-only dispatchers. A dispatcher that cannot run there raises now, at
        parallelize time, naming what to use instead."""
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep
        self.device_type = device_type or group_device_type(group)

    def configure(self, cfg: DispatcherConfig) -> None:
        """Take this dispatcher's own keys of the ``dispatcher`` group (none by default; dispatcher=capacity's
        capacity_factor). Called once, right after construction."""

    def raise_if_overflowed(self) -> None:
        """Raise if a step dropped rows (a static-capacity dispatcher's overflow); never by default. The trainer
        calls it after the step's host sync, before the optimizer applies that step."""

    @classmethod
    def check_layout(cls, ep: int, num_experts: int, top_k: int) -> None:
        """Raise ``ValueError`` naming the config key and the fix where this dispatcher cannot run ``ep`` ranks,
        ``num_experts`` experts in all or ``top_k`` experts per token. Called by parallelize, before any
        dispatcher is built (the model's top-k is known there, not here). Any layout by default."""

    def __call__(self, experts: ExpertWeights, x_ND: torch.Tensor, experts_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> torch.Tensor:
        """What ``GroupedExperts.forward`` calls, with the weights as the module holds them: DTensors of global
        shape [E, ...], Shard(0) on the ep mesh (so checkpoints and loaders see whole tensors). ``dispatch``
        gets this rank's [G, ...] blocks; their gradients flow back into the DTensors."""
        return self.dispatch(local_weights(experts), x_ND, experts_NK, weights_NK)

    @abstractmethod
    def dispatch(self, experts: ExpertWeights, x_ND: torch.Tensor, experts_NK: torch.Tensor,
                 weights_NK: torch.Tensor) -> torch.Tensor:
        """One MoE layer's routed expert computation on this rank's tokens.

        experts     this rank's G experts as plain tensors: gate_up_proj [G, 2I, D], down_proj [G, D, I], and
                    act_fn, the activation kernel; ``models.moe.compute_experts(experts, x_RD, counts_G)`` runs
                    them on rows sorted by local expert (or the dispatcher's own kernels do the same maths)
        x_ND        this rank's tokens [N, D]; N may be 0, and differs between ranks
        experts_NK  the global expert id of each token's K routed slots [N, K] (int64, distinct within a token)
        weights_NK  the router weight of each slot [N, K], differentiable
        returns     y_ND [N, D]: y[n] = sum_k weights_NK[n, k] * expert_{experts_NK[n, k]}(x_ND[n]), what
                    ``LocalDispatcher`` gives with all E experts on one rank, up to summation order; gradients
                    reach x_ND, weights_NK and the expert weights (an expert's gradient sums the rows of every
                    ep rank routed to it)
        """


_Cls = TypeVar("_Cls", bound=type[Dispatcher])

# dispatcher.name -> class, filled by @register in each dispatcher's own module.
DISPATCHERS: dict[str, type[Dispatcher]] = {}


def register(name: str) -> Callable[[_Cls], _Cls]:
    """Class decorator: ``@register("fused")`` makes the class what ``dispatcher=fused`` builds."""

    def add(cls: _Cls) -> _Cls:
        if not issubclass(cls, Dispatcher):
            raise TypeError(f"@register({name!r}): {cls.__qualname__} must subclass parallelisms.dispatchers.base"
                            ".Dispatcher")
        if name in DISPATCHERS:
            raise ValueError(f"two dispatchers registered as {name!r}: {DISPATCHERS[name].__module__}."
                             f"{DISPATCHERS[name].__qualname__} and {cls.__module__}.{cls.__qualname__}")
        cls.name = name
        DISPATCHERS[name] = cls
        return cls

    return add


def dispatcher_class(name: str) -> type[Dispatcher]:
    """The registered dispatcher called ``name``; an unknown name is an error listing the registered ones."""
    if name not in DISPATCHERS:
        raise ValueError(f"dispatcher.name={name!r} is unknown; registered: {', '.join(sorted(DISPATCHERS))}")
    return DISPATCHERS[name]


def validate_dispatcher_config(cfg: DispatcherConfig) -> None:
    """An unknown name fails before any process group, listing the registered dispatchers."""
    dispatcher_class(cfg.name)
    if not cfg.capacity_factor > 0:
        raise ValueError(f"dispatcher.capacity_factor={cfg.capacity_factor} must be > 0 (rows per peer = "
                         "ceil(capacity_factor * tokens * top_k / ep))")
    if cfg.name != "capacity" and cfg.capacity_factor != DispatcherConfig.capacity_factor:
        raise ValueError(f"dispatcher.capacity_factor applies to dispatcher=capacity only, not {cfg.name}")
