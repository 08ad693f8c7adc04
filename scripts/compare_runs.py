"""Compare training runs: throughput, MFU, memory, final loss, and how closely their loss curves agree.

    python scripts/compare_runs.py RUN_DIR [RUN_DIR ...] --out OUT_DIR [--warmup 3]

Reads each run directory's ``metrics.jsonl`` (and ``config.yaml`` for a label ``dispatcher/parallel/model``)
and writes ``OUT_DIR/summary.md`` (also printed) and ``OUT_DIR/loss.png``. The summary has one row per run
and, for every pair of runs, the Pearson correlation of the per-step loss over the steps both logged
(e.g. eager vs fused dispatchers on one layout should agree to ~0.99+).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class CompareError(ValueError):
    """A run that cannot be compared; the message names the run and what is wrong."""


@dataclass
class Run:
    label: str
    dir: Path
    metrics: dict[int, dict[str, Any]]  # step -> that step's metrics (the last line wins: a resumed run)

    def losses(self, steps: list[int]) -> list[float]:
        return [float(self.metrics[s]["loss"]) for s in steps]


@dataclass
class Row:
    label: str
    dir: str
    last_step: int
    tokens_per_s_per_device: float
    mfu: float | None  # None: not measured (CPU)
    peak_mem_gib: float | None
    final_loss: float
    all_steps_timed: bool  # too few steps to leave the warm-up out


@dataclass
class Pair:
    a: str
    b: str
    common_steps: int
    pearson: float  # nan when a curve is constant
    max_abs_diff: float


def config_label(run_dir: Path) -> str | None:
    """``dispatcher/parallel/model`` from the resolved config.yaml the trainer writes, or None."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    cfg = yaml.safe_load(path.read_text()) or {}
    try:
        return "/".join(str(cfg[group]["name"]) for group in ("dispatcher", "parallel", "model"))
    except (KeyError, TypeError):
        return None


def read_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise CompareError(f"{path} not found: is {run_dir} a run directory (train.output_dir)?")
    metrics: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            metrics[int(record["step"])] = record
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise CompareError(f"{path}:{number}: not a metrics line with a step ({e})") from e
    if not metrics:
        raise CompareError(f"{path} has no metrics: did the run log a step?")
    return dict(sorted(metrics.items()))


def load_runs(run_dirs: list[Path]) -> list[Run]:
    runs = [Run(config_label(d) or d.name, d, read_metrics(d)) for d in run_dirs]
    # Two runs of one configuration would share a label: tell them apart by their directory.
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.label] = counts.get(run.label, 0) + 1
    for run in runs:
        if counts[run.label] > 1:
            run.label = f"{run.label} ({run.dir.name})"
    return runs


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize(run: Run, warmup: int) -> Row:
    """Throughput and MFU: means over the steps after the first ``warmup`` (compilation, allocator, caches);
    a run with no more steps than that is averaged over all of them."""
    records = list(run.metrics.values())
    timed = records[warmup:] or records
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    mems = [r["peak_mem_gib"] for r in records if r.get("peak_mem_gib") is not None]
    return Row(label=run.label, dir=str(run.dir), last_step=records[-1]["step"],
               tokens_per_s_per_device=mean([r["tokens_per_s_per_device"] for r in timed]),
               mfu=mean(mfus) if mfus else None, peak_mem_gib=max(mems) if mems else None,
               final_loss=float(records[-1]["loss"]), all_steps_timed=not records[warmup:])


def pearson(xs: list[float], ys: list[float]) -> float:
    """Pearson's r; nan when either series is constant (r is undefined)."""
    mx, my = mean(xs), mean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def compare_pair(a: Run, b: Run) -> Pair:
    steps = sorted(a.metrics.keys() & b.metrics.keys())
    if len(steps) < 2:
        raise CompareError(f"{a.dir} (steps {min(a.metrics)}..{max(a.metrics)}) and {b.dir} (steps "
                           f"{min(b.metrics)}..{max(b.metrics)}) share {len(steps)} logged step(s); a loss "
                           "correlation needs at least 2 (same logging.log_every and overlapping steps)")
    la, lb = a.losses(steps), b.losses(steps)
    return Pair(a.label, b.label, len(steps), pearson(la, lb), max(abs(x - y) for x, y in zip(la, lb)))


def fmt(value: float | None, spec: str, none: str = "n/a") -> str:
    return none if value is None or math.isnan(value) else format(value, spec)


def render_summary(rows: list[Row], pairs: list[Pair], warmup: int) -> str:
    lines = ["# Run comparison", "",
             "| run | dir | steps | tokens/s/device | MFU | peak mem (GiB) | final loss |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.label} | {r.dir} | {r.last_step} | {r.tokens_per_s_per_device:,.1f} | "
                     f"{fmt(None if r.mfu is None else 100 * r.mfu, '.2f')}{'' if r.mfu is None else '%'} | "
                     f"{fmt(r.peak_mem_gib, '.2f')} | {r.final_loss:.4f} |")
    lines += ["", f"tokens/s/device and MFU: means over the steps after the first {warmup} (warm-up); "
              "MFU n/a: not measured (CPU). Peak memory: the largest over all steps."]
    short = [r.label for r in rows if r.all_steps_timed and warmup > 0]
    if short:
        lines.append(f"Averaged over every step (no more than {warmup} logged): {', '.join(short)}.")
    if pairs:
        lines += ["", "## Loss agreement (per-step loss over common steps)", "",
                  "| run A | run B | common steps | Pearson r | max abs loss diff |", "|---|---|---:|---:|---:|"]
        lines += [f"| {p.a} | {p.b} | {p.common_steps} | {fmt(p.pearson, '.4f', 'n/a (constant loss)')} | "
                  f"{p.max_abs_diff:.4g} |" for p in pairs]
    lines += ["", "![loss curves](loss.png)", ""]
    return "\n".join(lines)


def plot_losses(runs: list[Run], path: Path) -> None:
    """Loss per step for every run; below, each run's difference from the first run over common steps."""
    try:
        import matplotlib
    except ImportError as e:
        raise CompareError("plots need matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = 2 if len(runs) > 1 else 1
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.5 * panels), sharex=True, squeeze=False)
    top = axes[0][0]
    for i, run in enumerate(runs):  # color C<i>: run i has one color in both panels
        steps = list(run.metrics)
        top.plot(steps, run.losses(steps), label=run.label, color=f"C{i}", linewidth=1.2)
    top.set_ylabel("loss")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    if panels == 2:
        ref, bottom = runs[0], axes[1][0]
        for i, run in enumerate(runs[1:], start=1):
            steps = sorted(ref.metrics.keys() & run.metrics.keys())
            diffs = [y - x for x, y in zip(ref.losses(steps), run.losses(steps))]
            bottom.plot(steps, diffs, label=f"{run.label} - {ref.label}", color=f"C{i}", linewidth=1.2)
        bottom.axhline(0.0, color="black", linewidth=0.6)
        bottom.set_ylabel("loss difference")
        bottom.legend(fontsize=8)
        bottom.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    axes[-1][0].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(run_dirs: list[Path], out_dir: Path, warmup: int = 3) -> str:
    """Write OUT_DIR/summary.md and OUT_DIR/loss.png; returns the summary."""
    if warmup < 0:
        raise CompareError(f"--warmup={warmup} must be >= 0")
    runs = load_runs(run_dirs)
    pairs = [compare_pair(a, b) for a, b in itertools.combinations(runs, 2)]
    summary = render_summary([summarize(r, warmup) for r in runs], pairs, warmup)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_losses(runs, out_dir / "loss.png")
    (out_dir / "summary.md").write_text(summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories to compare")
    parser.add_argument("--out", required=True, type=Path, metavar="OUT_DIR", help="where summary.md and loss.png go")
    parser.add_argument("--warmup", type=int, default=3, help="leading steps left out of throughput means")
    args = parser.parse_args(argv)
    try:
        print(compare(args.run_dirs, args.out, args.warmup))
    except CompareError as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
