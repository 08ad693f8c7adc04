"""The measured FP8 table: per GPU model, the forward + backward time of each GEMM shape in bf16 and in FP8 (the
FP8 time including its quantisation passes), eager and ``torch.compile``'d. ``parallelisms.float8`` converts a GEMM
to FP8 only where this table says FP8 is faster on the running GPU. ``python scripts/check_float8.py --write-table``
measures the table's shapes on the GPU it runs on and writes that GPU's entry.

Format (``kernels/float8/table.json``)::

    {"gpus": {"NVIDIA H200": {                          # torch.cuda.get_device_name()
        "measured": {"torch": "2.11.0", "torchao": "0.18.0", "date": "...", "command": "..."},
        "linears": [{"in": 2048, "out": 4096, "tokens": 16384,
                     "bf16_ms": 1.0, "fp8_ms": 1.2, "bf16_compiled_ms": 1.0, "fp8_compiled_ms": 0.9}, ...],
        "experts": [{"in": 2048, "out": 1536, "groups": 128, "rows": 131072, "gathered": true,
                     "bf16_ms": 2.0, "fp8_ms": 5.0}, ...]}}}

A linear is ``nn.Linear(in, out)`` on ``tokens`` rows (bf16: ``F.linear``; FP8: torchao's rowwise
``Float8Linear``); an experts entry is one grouped GEMM of ``groups`` local experts, ``[rows, in] x [in, out]`` per
group, on an uneven load (bf16: ``kernels.moe.grouped_mm``'s ``torch._grouped_mm``; FP8:
``kernels.float8.grouped_mm.float8_grouped_mm``, padding and quantisers included); ``gathered`` (the experts'
first GEMM, whose rows come from the dispatch gather): the gather of the rows from rows / top-k tokens included
(bf16: ``permute_tokens``, then the GEMM; FP8: ``kernels.float8.permute``'s GEMM fused with it). Experts entries
have eager times only: ``train.compile`` leaves the experts eager. Times are means in ms of one forward +
backward; ``null`` (or absent) where that variant was not run. A lookup matches ``in``, ``out`` (and ``groups``)
exactly and takes the entry measured at the nearest ``tokens`` (``rows``) on a log scale.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TABLE_PATH = Path(__file__).with_name("table.json")
WRITE_COMMAND = "python scripts/check_float8.py --write-table"
TIMES = ("bf16_ms", "fp8_ms", "bf16_compiled_ms", "fp8_compiled_ms")


@dataclass(frozen=True)
class Timing:
    """One measured shape: bf16 and FP8 forward + backward ms (None: not measured) and the size measured at."""

    bf16_ms: float | None
    fp8_ms: float | None
    measured_at: int  # tokens (a linear) or routed rows (a grouped GEMM)

    @property
    def speedup(self) -> float | None:
        """bf16 time / FP8 time (> 1: FP8 is faster); None where either is missing."""
        if not self.bf16_ms or not self.fp8_ms:
            return None
        return self.bf16_ms / self.fp8_ms


def load_table(path: Path = TABLE_PATH) -> dict[str, dict[str, Any]]:
    """GPU name -> its entry (``{}`` if the file is absent)."""
    if not path.exists():
        return {}
    return json.loads(path.read_text())["gpus"]


def write_gpu_rows(gpu: str, measured: dict[str, Any], linears: list[dict[str, Any]],
                   experts: list[dict[str, Any]], path: Path = TABLE_PATH) -> None:
    """Put these rows into ``gpu``'s entry of the table file, replacing rows of the same shape and size and
    keeping the others (other shapes, sizes, GPUs); ``measured`` replaces the entry's provenance."""
    gpus = load_table(path)
    old = gpus.get(gpu, {})

    def merged(kind: str, rows: list[dict[str, Any]], key: tuple[str, ...]) -> list[dict[str, Any]]:
        new = {tuple(r[k] for k in key): r for r in rows}
        kept = [r for r in old.get(kind, []) if tuple(r[k] for k in key) not in new]
        return sorted(kept + list(new.values()), key=lambda r: tuple(r[k] for k in key))

    gpus[gpu] = {"measured": measured, "linears": merged("linears", linears, ("in", "out", "tokens")),
                 "experts": merged("experts", experts, ("in", "out", "groups", "rows"))}
    path.write_text(_dumps(gpus))


def _dumps(gpus: dict[str, dict[str, Any]]) -> str:
    """The table as JSON with one row per line (diffs of a re-measured table stay readable)."""
    entries = []
    for gpu, entry in sorted(gpus.items()):
        lists = [f'  "{kind}": [\n' + ",\n".join("   " + json.dumps(r) for r in entry.get(kind, [])) + "]"
                 for kind in ("linears", "experts")]
        entries.append(f' {json.dumps(gpu)}: {{\n  "measured": {json.dumps(entry.get("measured", {}))},\n'
                       + ",\n".join(lists) + "}")
    return '{"gpus": {\n' + ",\n".join(entries) + "}}\n"


def _nearest(rows: list[dict[str, Any]], size_key: str, size: int) -> dict[str, Any] | None:
    return min(rows, key=lambda r: abs(math.log2(r[size_key]) - math.log2(max(size, 1))), default=None)


def _timing(row: dict[str, Any] | None, size_key: str, compiled: bool) -> Timing | None:
    if row is None:
        return None
    suffix = "_compiled_ms" if compiled else "_ms"
    return Timing(row.get("bf16" + suffix), row.get("fp8" + suffix), row[size_key])


def linear_timing(entry: dict[str, Any], d_in: int, d_out: int, tokens: int, compiled: bool) -> Timing | None:
    """The measured linear (in, out) nearest ``tokens``; None if the table has no such shape."""
    rows = [r for r in entry.get("linears", []) if (r["in"], r["out"]) == (d_in, d_out)]
    return _timing(_nearest(rows, "tokens", tokens), "tokens", compiled)


def grouped_timing(entry: dict[str, Any], d_in: int, d_out: int, groups: int, rows: int,
                   compiled: bool) -> Timing | None:
    """The measured grouped GEMM (in, out, groups) nearest ``rows``; None if the table has no such shape."""
    found = [r for r in entry.get("experts", []) if (r["in"], r["out"], r["groups"]) == (d_in, d_out, groups)]
    return _timing(_nearest(found, "rows", rows), "rows", compiled)
