"""The EP dispatcher interface and its registry.

A dispatcher is ``GroupedExperts.dispatcher`` under expert parallelism (``models.moe.LocalDispatcher`` is the
single-rank one it must reproduce). Adding one takes two files: a module in this package with a ``Dispatcher``
subclass decorated ``@register("<name>")`` (the package imports every module, so nothing else names it), and
``conf/dispatcher/<name>.yaml`` (``name: <name>`` under a one-line comment) so ``dispatcher=<name>`` composes.
The tests check that the two sets agree.

What the other layers need of a dispatcher it declares on its class, so that nothing outside this package names
one: its traits (``chunks``, ``extra_saved_rows`` and ``uncounted_traffic`` for the planner, training/planner.py;
``unsimulated`` for the loopback simulation's checks, training.launch.simulation_errors; ``drops_rows`` for the
trainer; ``traffic``, what one layer sends, for the planner), whose defaults describe fused (the M routed rows each way in one exchange, nothing kept beyond what
every dispatcher keeps, any simulation), the keys of the ``dispatcher`` config group it reads (``config_keys``,
their values checked by its ``validate_config``; ``validate_dispatcher_config`` refuses any other key set away
from its default) and the layouts it can run (``check_layout``, called by parallelize).

Letters as in DEVELOPERS.md: N tokens on this rank, E experts in all, P ep ranks, G = E / P local experts (ep rank
p holds experts [p*G, (p+1)*G)), K experts per token, M = N * K routed rows, D hidden size.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, TypeVar

import torch
import torch.distributed as dist

from models.moe import ExpertWeights
from parallelisms.dispatchers.common import group_device_type, local_weights
from parallelisms.dispatchers.config import DispatcherConfig


INT64 = 8
FP8_ROW_EXTRA = 4  # an e4m3 row's fp32 scale, sent with it (dispatcher.fp8_dispatch)


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer on one rank for one micro-batch, as the planner counts a dispatcher's traffic."""

    tokens: int  # N
    top_k: int  # K
    num_experts: int  # E
    ep: int  # P
    hidden: int  # D
    element_bytes: int  # of a routed row's element and of a router weight: the compute dtype's (2 bf16, 4 fp32)
    row_len: int  # positions of a sequence (round-robin routing goes by position)
    round_robin: bool  # model.arch.router_force_balance (the simulation's routing); else learned, uniform on average
    cfg: DispatcherConfig

    @property
    def routed_row_bytes(self) -> int:
        """The M = N x K routed rows of the compute dtype."""
        return self.tokens * self.top_k * self.hidden * self.element_bytes

    def dispatched_row_bytes(self, rows: int) -> int:
        """``rows`` rows as the forward's dispatch sends them: e4m3 with their scales under dispatcher.fp8_dispatch,
        else the compute dtype."""
        if self.cfg.fp8_dispatch:
            return rows * (self.hidden + FP8_ROW_EXTRA)
        return rows * self.hidden * self.element_bytes


@dataclass(frozen=True)
class Traffic:
    """One kind of a layer's all-to-alls on one rank: the calls and the bytes sent (each call's input, what the
    rank keeps included) in each forward of the layer (full checkpointing runs two) and in its backward."""

    what: str
    forward_calls: int
    forward_bytes: int
    backward_calls: int = 0
    backward_bytes: int = 0


def token_ranks(shape: LayerShape) -> float:
    """The mean number of ep ranks a token's K experts sit on (a rank holds experts [p G, (p + 1) G)): for
    round-robin routing (``models.moe.round_robin_experts``: slot k of the token at position t goes to expert
    (t K + k) mod E) exactly, over the positions of a sequence; for learned routing the expectation under uniform
    top-K (K distinct experts of E, any K equally likely): P (1 - C(E - G, K) / C(E, K))."""
    E, K, P, T = shape.num_experts, shape.top_k, shape.ep, shape.row_len
    G = E // P
    if not shape.round_robin:
        return P * (1 - math.comb(E - G, K) / math.comb(E, K))
    period = E // math.gcd(K, E)  # t K mod E repeats with this period in t

    def ranks(t: int) -> int:
        return len({(t * K + k) % E // G for k in range(K)})

    full, rest = divmod(T, period)
    return (full * sum(ranks(t) for t in range(period)) + sum(ranks(t) for t in range(rest))) / T


class Dispatcher(ABC):
    """Moves every routed row (token, k) to the ep rank that holds its expert, runs that rank's experts on what
    arrives, and brings the outputs back, weighted by the router scores and summed over k.

    Built once per MoE layer by ``parallelisms.expert_parallel.apply_expert_parallel`` and called in that
    layer's forward. The call is collective over the ep group: every rank makes it, also with no tokens.
    """

    name: ClassVar[str]  # the registered name, dispatcher.name (set by @register)
    # The keys of the dispatcher config group (DispatcherConfig's fields) it reads in ``configure``; any other key
    # set away from its default is refused by validate_dispatcher_config.
    config_keys: ClassVar[tuple[str, ...]] = ()
    # May drop rows (a static capacity): the host learns of it after the step's read, so the trainer must not
    # queue the optimizer's update before that read.
    drops_rows: ClassVar[bool] = False
    # The parts each exchange is issued in (domino: its two token halves): per dispatch and per combine, ``chunks``
    # all-to-alls of the M routed rows between them, and one count exchange of chunks x E counts. The planner
    # counts the calls and bytes from it.
    chunks: ClassVar[int] = 1
    # [D] rows per routed row it keeps for backward without checkpointing, beyond what every dispatcher keeps (the
    # rows in expert order, the experts' outputs the weighted sum reads; training/planner.py): the planner's
    # memory adds K * D * extra_saved_rows per token under EP. Eager: 1, the rows in arrival order too.
    extra_saved_rows: ClassVar[int] = 0
    # Why the planner cannot count its traffic, completing "<name>'s ...", or "" where it can: it counts one
    # count exchange and the M routed rows each way per exchange, in ``chunks`` parts.
    uncounted_traffic: ClassVar[str] = ""
    # Why the loopback simulation (launch.simulate_world, parallelisms/loopback.py) cannot stand in for its
    # exchange, completing "dispatcher=<name> ...", or "" where it can; such a simulation is refused.
    unsimulated: ClassVar[str] = ""

    @classmethod
    def traffic(cls, shape: LayerShape) -> list[Traffic]:
        """What one rank sends in one MoE layer (``Traffic``), for the planner: by default fused's, in ``chunks``
        parts. Forward: one count exchange of chunks x E counts, the M routed rows out (``dispatch``: in e4m3 under
        dispatcher.fp8_dispatch) and back (the combine); backward: the combine's gradient out, the dispatch's
        gradient back, in the compute dtype. Called only where ``uncounted_traffic`` is empty."""
        M, rows = shape.tokens * shape.top_k, shape.routed_row_bytes
        return [Traffic("expert counts", 1, cls.chunks * shape.num_experts * INT64),
                Traffic("routed rows", 2 * cls.chunks, shape.dispatched_row_bytes(M) + rows, 2 * cls.chunks, 2 * rows)]

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

    @classmethod
    def validate_config(cls, cfg: DispatcherConfig) -> None:
        """Raise ``ValueError`` naming the key where one of ``config_keys`` has a value this dispatcher cannot
        take. Called by ``validate_dispatcher_config``, before any process group. Nothing by default."""

    def configure(self, cfg: DispatcherConfig) -> None:
        """Take this dispatcher's own keys of the ``dispatcher`` group, its ``config_keys`` (none by default;
        dispatcher=capacity's capacity_factor). Called once, right after construction."""

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
        unknown = set(cls.config_keys) - {field.name for field in dataclasses.fields(DispatcherConfig)}
        if unknown:
            raise TypeError(f"@register({name!r}): config_keys {sorted(unknown)} are not keys of the dispatcher group "
                            "(parallelisms/dispatchers/config.py: DispatcherConfig)")
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
    """An unknown name fails before any process group, listing the registered dispatchers; so does a key of the
    group set away from its default for a dispatcher that does not read it (``config_keys``), naming those that do,
    and a value the dispatcher's own ``validate_config`` refuses."""
    cls = dispatcher_class(cfg.name)
    for field in dataclasses.fields(DispatcherConfig):
        if field.name != "name" and field.name not in cls.config_keys and getattr(cfg, field.name) != field.default:
            takers = [name for name, other in sorted(DISPATCHERS.items()) if field.name in other.config_keys]
            raise ValueError(f"dispatcher.{field.name} applies to dispatcher={', '.join(takers)} only, not {cfg.name}")
    cls.validate_config(cfg)
