"""Expert-parallel token dispatchers, chosen by ``parallel.backend.ep_dispatcher`` (see docs/dispatchers.md).

A dispatcher is the ``GroupedExperts.dispatcher`` strategy under EP: it moves every routed row to the
rank that holds its expert, runs the local experts, and brings the outputs back.
"""

from __future__ import annotations

from parallelisms.dispatchers.dedup import DedupDispatcher
from parallelisms.dispatchers.domino import DominoDispatcher
from parallelisms.dispatchers.eager import EagerDispatcher
from parallelisms.dispatchers.fused import FusedDispatcher
from parallelisms.dispatchers.mc2 import Mc2Dispatcher

IMPLEMENTED: dict[str, type] = {"eager": EagerDispatcher, "fused": FusedDispatcher, "domino": DominoDispatcher,
                                "mc2": Mc2Dispatcher, "dedup": DedupDispatcher}
# Named by the design but not built yet, each arriving with its own issue.
PLANNED: tuple[str, ...] = ()


def dispatcher_class(name: str) -> type:
    if name in IMPLEMENTED:
        return IMPLEMENTED[name]
    if name in PLANNED:
        raise NotImplementedError(f"parallel.backend.ep_dispatcher={name!r} is planned but not implemented yet; "
                                  f"implemented: {', '.join(IMPLEMENTED)}")
    planned = f" (planned: {', '.join(PLANNED)})" if PLANNED else ""
    raise ValueError(f"parallel.backend.ep_dispatcher={name!r} is unknown; implemented: {', '.join(IMPLEMENTED)}"
                     f"{planned}")


__all__ = ["DedupDispatcher", "DominoDispatcher", "EagerDispatcher", "FusedDispatcher", "IMPLEMENTED", "Mc2Dispatcher",
           "PLANNED", "dispatcher_class"]
