"""The ``dispatcher`` config group (conf/dispatcher/<name>.yaml): which registered EP dispatcher moves tokens to
their experts. It has an effect only under expert parallelism (parallel.ep_size > 1)."""

from __future__ import annotations

from dataclasses import dataclass

from parallelisms.dispatchers.base import dispatcher_class


@dataclass
class DispatcherConfig:
    name: str = "eager"  # a registered dispatcher (parallelisms/dispatchers, docs/dispatchers.md)


def validate_dispatcher_config(cfg: DispatcherConfig) -> None:
    """An unknown name fails before any process group, listing the registered dispatchers."""
    dispatcher_class(cfg.name)
