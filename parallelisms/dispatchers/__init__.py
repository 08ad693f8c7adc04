"""Expert-parallel token dispatchers, chosen by ``parallel.backend.ep_dispatcher``.

A dispatcher is the ``GroupedExperts.dispatcher`` strategy under EP: it moves every routed row to the
rank that holds its expert, runs the local experts, and brings the outputs back.
"""

from __future__ import annotations

from parallelisms.dispatchers.eager import EagerDispatcher

IMPLEMENTED: dict[str, type] = {"eager": EagerDispatcher}
# Named by the design, each arriving with its own issue.
PLANNED = ("fused", "domino", "mc2")


def dispatcher_class(name: str) -> type:
    if name in IMPLEMENTED:
        return IMPLEMENTED[name]
    if name in PLANNED:
        raise NotImplementedError(f"parallel.backend.ep_dispatcher={name!r} is planned but not implemented yet; "
                                  f"implemented: {', '.join(IMPLEMENTED)}")
    raise ValueError(f"parallel.backend.ep_dispatcher={name!r} is unknown; implemented: {', '.join(IMPLEMENTED)} "
                     f"(planned: {', '.join(PLANNED)})")


__all__ = ["EagerDispatcher", "IMPLEMENTED", "PLANNED", "dispatcher_class"]
