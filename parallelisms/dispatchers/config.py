"""The ``dispatcher`` config group (conf/dispatcher/<name>.yaml): which registered EP dispatcher moves tokens to
their experts. It has an effect only under expert parallelism (parallel.ep_size > 1). Its validation needs the
registry and lives beside it (``base.validate_dispatcher_config``); this module imports nothing of the package."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DispatcherConfig:
    # A registered dispatcher (parallelisms/dispatchers, docs/dispatchers.md); eager is the readable reference
    name: str = "fused"
    # dispatcher=capacity only: rows each ep rank sends every peer, ceil(capacity_factor * N * K / ep) (at most
    # N * K, reached from capacity_factor >= ep, which never overflows); more rows for one peer stop the run.
    capacity_factor: float = 2.0
    # dispatcher=fused, domino, dedup: the dispatch all-to-all sends e4m3 rows with a power-of-two fp32 scale each
    # (D + 4 bytes a row instead of 2 D), dequantised on arrival; the combine and every backward all-to-all stay in
    # the compute dtype (the gradient passes the quantisation straight through, as FP8 training's)
    fp8_dispatch: bool = False
