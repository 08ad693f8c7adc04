"""The ``dispatcher`` config group (conf/dispatcher/<name>.yaml): which registered EP dispatcher moves tokens to
their experts. It has an effect only under expert parallelism (parallel.ep_size > 1)."""

from __future__ import annotations

from dataclasses import dataclass

from parallelisms.dispatchers.base import dispatcher_class


@dataclass
class DispatcherConfig:
    name: str = "eager"  # a registered dispatcher (parallelisms/dispatchers, docs/dispatchers.md)
    # dispatcher=capacity only: rows each ep rank sends every peer, ceil(capacity_factor * N * K / ep) (at most
    # N * K, reached from capacity_factor >= ep, which never overflows); more rows for one peer stop the run.
    capacity_factor: float = 2.0


def validate_dispatcher_config(cfg: DispatcherConfig) -> None:
    """An unknown name fails before any process group, listing the registered dispatchers."""
    dispatcher_class(cfg.name)
    if not cfg.capacity_factor > 0:
        raise ValueError(f"dispatcher.capacity_factor={cfg.capacity_factor} must be > 0 (rows per peer = "
                         "ceil(capacity_factor * tokens * top_k / ep))")
    if cfg.name != "capacity" and cfg.capacity_factor != DispatcherConfig.capacity_factor:
        raise ValueError(f"dispatcher.capacity_factor applies to dispatcher=capacity only, not {cfg.name}")
