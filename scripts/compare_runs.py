"""Compare training runs: throughput, MFU, memory, final loss, and how closely their loss curves agree.

    python scripts/compare_runs.py RUN_DIR [RUN_DIR ...] --out OUT_DIR [--warmup 3]

Reads each run directory's ``metrics.jsonl`` and ``config.yaml`` and writes ``OUT_DIR/summary.md`` (also
printed) and ``OUT_DIR/loss.png``. The summary has one row per run and, for every pair of runs, the Pearson
correlation of the per-step loss over the steps both logged (e.g. eager vs fused dispatchers on one layout
should agree to ~0.99+). The plot has four panels: loss, each run's loss minus the first run's, tokens/s per
device and grad norm.

Each run is labelled by what sets it apart: the config keys whose values differ between the compared runs
(``dispatcher.name=fused, parallel.ep_size=2``), leaving out keys that do not change what is trained or how fast
(``IGNORED_KEYS``: where the run writes, resuming, checkpoints, logging), and the model's architecture keys
when ``model.name`` or ``model.init_from`` differs (the architecture follows from them). A run is labelled by
its directory when nothing differs, when more than ``MAX_LABEL_KEYS`` keys differ (the summary lists them), or
when it has no config.yaml.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as `python scripts/compare_runs.py`

from training.config import flat_config  # noqa: E402


IGNORED_KEYS = ("train.output_dir", "train.resume", "train.allow_changes", "train.save_final", "data.cache_dir",
                "parallel.dist_timeout", "checkpoint", "logging")  # a key, or a prefix of dotted keys
MAX_LABEL_KEYS = 4  # more differing keys than this: runs are labelled by their directory
MAX_VALUE_CHARS = 24  # a longer value keeps its end (a path's file name): "...ong/path/corpus.npy"
UNSET = "unset"  # a key one run's config does not have
PANELS = ("loss", "loss difference from the first run", "tokens/s/device", "grad norm")


class CompareError(ValueError):
    """A run that cannot be compared; the message names the run and what is wrong."""


@dataclass
class Run:
    label: str
    dir: Path
    metrics: dict[int, dict[str, Any]]  # step -> that step's metrics (the last line wins: a resumed run)
    config: dict[str, Any] | None = None  # the flat config.yaml (dotted key -> value); None: no config.yaml

    def losses(self, steps: list[int]) -> list[float]:
        return [float(self.metrics[s]["loss"]) for s in steps]

    def loss_steps(self) -> set[int]:
        """The steps with a finite loss (a step skipped under train.nonfinite=skip logs null)."""
        return set(self.series("loss")[0])

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """The steps that logged a finite ``key``, and its values."""
        points = [(s, float(m[key])) for s, m in self.metrics.items()
                  if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
        return [s for s, _ in points], [v for _, v in points]


@dataclass
class Row:
    label: str
    dir: str
    last_step: int
    tokens_per_s_per_device: float
    mfu: float | None  # None: not measured (CPU)
    peak_mem_gib: float | None
    final_loss: float  # the last finite loss
    all_steps_timed: bool  # too few steps to leave the warm-up out
    presets: str | None  # dispatcher/parallel/model, None without config.yaml


@dataclass
class Pair:
    a: str
    b: str
    common_steps: int
    pearson: float  # nan when a curve is constant
    max_abs_diff: float


def read_config(run_dir: Path) -> dict[str, Any] | None:
    """The run's config.yaml (the resolved config the trainer writes) as dotted key -> value, or None."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise CompareError(f"{path}: not YAML ({' '.join(str(e).split())})") from e  # one line
    return flat_config(tree) if isinstance(tree, dict) else None


def preset_label(config: dict[str, Any] | None) -> str | None:
    """``dispatcher/parallel/model``: the presets the run was composed from."""
    names = [config.get(f"{group}.name") for group in ("dispatcher", "parallel", "model")] if config else [None]
    return None if None in names else "/".join(map(str, names))


def _ignored(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in IGNORED_KEYS)


def _comparable(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def differing_keys(configs: list[dict[str, Any]]) -> list[str]:
    """The keys whose values are not the same in every config, sorted (a key only some have differs), less
    ``IGNORED_KEYS`` and, when the model itself differs, the architecture that follows from it."""
    keys = sorted({key for config in configs for key in config})
    differ = [key for key in keys if not _ignored(key)
              and len({_comparable(config.get(key, UNSET)) for config in configs}) > 1]
    if "model.name" in differ or "model.init_from" in differ:
        differ = [key for key in differ if key != "model.model_type" and not key.startswith("model.arch.")]
    return differ


def short_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= MAX_VALUE_CHARS else "..." + text[-(MAX_VALUE_CHARS - 3):]


def short_dir_names(run_dirs: list[Path]) -> list[str]:
    """The fewest trailing path parts that tell the directories apart (``12-00-00``, else ``2026-11-30/12-00-00``)."""
    parts = [d.absolute().parts for d in run_dirs]
    for depth in range(1, max(map(len, parts)) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(d) for d in run_dirs]


def run_labels(run_dirs: list[Path], configs: list[dict[str, Any] | None]) -> list[str]:
    """Each run's differing ``key=value`` pairs, or its directory name (see the module docstring)."""
    names = short_dir_names(run_dirs)
    keys = differing_keys([c for c in configs if c is not None])
    if not keys or len(keys) > MAX_LABEL_KEYS:
        return names
    labels = [name if config is None else ", ".join(f"{key}={short_value(config.get(key, UNSET))}" for key in keys)
              for name, config in zip(names, configs)]
    # Runs of one configuration (e.g. two seeds out of three runs) share a label: tell them apart by directory.
    return [f"{label} ({name})" if labels.count(label) > 1 and label != name else label
            for label, name in zip(labels, names)]


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
    metrics = [read_metrics(d) for d in run_dirs]
    configs = [read_config(d) for d in run_dirs]
    return [Run(label, d, m, c) for label, d, m, c in zip(run_labels(run_dirs, configs), run_dirs, metrics, configs)]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize(run: Run, warmup: int) -> Row:
    """Throughput and MFU: means over the steps after the first ``warmup`` (compilation, allocator, caches);
    a run with no more steps than that is averaged over all of them."""
    records = list(run.metrics.values())
    timed = records[warmup:] or records
    losses = run.series("loss")[1]
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    mems = [r["peak_mem_gib"] for r in records if r.get("peak_mem_gib") is not None]
    return Row(label=run.label, dir=str(run.dir), last_step=records[-1]["step"],
               tokens_per_s_per_device=mean([r["tokens_per_s_per_device"] for r in timed]),
               mfu=mean(mfus) if mfus else None, peak_mem_gib=max(mems) if mems else None,
               final_loss=losses[-1] if losses else math.nan, all_steps_timed=not records[warmup:],
               presets=preset_label(run.config))


def pearson(xs: list[float], ys: list[float]) -> float:
    """Pearson's r; nan when either series is constant (r is undefined)."""
    mx, my = mean(xs), mean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def compare_pair(a: Run, b: Run) -> Pair:
    steps = sorted(a.loss_steps() & b.loss_steps())
    if len(steps) < 2:
        raise CompareError(f"{a.dir} (steps {min(a.metrics)}..{max(a.metrics)}) and {b.dir} (steps "
                           f"{min(b.metrics)}..{max(b.metrics)}) share {len(steps)} logged step(s); a loss "
                           "correlation needs at least 2 (same logging.log_every and overlapping steps)")
    la, lb = a.losses(steps), b.losses(steps)
    return Pair(a.label, b.label, len(steps), pearson(la, lb), max(abs(x - y) for x, y in zip(la, lb)))


def fmt(value: float | None, spec: str, none: str = "n/a") -> str:
    return none if value is None or math.isnan(value) else format(value, spec)


def render_summary(rows: list[Row], pairs: list[Pair], warmup: int, differing: list[str] | None = None) -> str:
    lines = ["# Run comparison", "",
             "| run | dir | steps | tokens/s/device | MFU | peak mem (GiB) | final loss | dispatcher/parallel/model |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.label} | {r.dir} | {r.last_step} | {r.tokens_per_s_per_device:,.1f} | "
                     f"{fmt(None if r.mfu is None else 100 * r.mfu, '.2f')}{'' if r.mfu is None else '%'} | "
                     f"{fmt(r.peak_mem_gib, '.2f')} | {r.final_loss:.4f} | {r.presets or 'n/a'} |")
    lines += ["", f"tokens/s/device and MFU: means over the steps after the first {warmup} (warm-up); "
              "MFU n/a: not measured (CPU). Peak memory: the largest over all steps."]
    short = [r.label for r in rows if r.all_steps_timed and warmup > 0]
    if short:
        lines.append(f"Averaged over every step (no more than {warmup} logged): {', '.join(short)}.")
    if differing:
        named = "" if len(differing) <= MAX_LABEL_KEYS else " (too many for labels: runs are named by directory)"
        lines.append(f"Config keys that differ between the runs{named}: {', '.join(differing)}.")
    if pairs:
        lines += ["", "## Loss agreement (per-step loss over common steps)", "",
                  "| run A | run B | common steps | Pearson r | max abs loss diff |", "|---|---|---:|---:|---:|"]
        lines += [f"| {p.a} | {p.b} | {p.common_steps} | {fmt(p.pearson, '.4f', 'n/a (constant loss)')} | "
                  f"{p.max_abs_diff:.4g} |" for p in pairs]
    lines += ["", "![loss, loss difference, throughput and grad norm](loss.png)", ""]
    return "\n".join(lines)


def make_figure(runs: list[Run]) -> Any:
    """The figure of ``PANELS`` (the loss difference only with more than one run): run i in color C<i> in every
    panel, one legend above them all."""
    try:
        import matplotlib
    except ImportError as e:
        raise CompareError("plots need matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    titles = [t for t in PANELS if len(runs) > 1 or t != PANELS[1]]
    rows = (len(titles) + 1) // 2
    fig = plt.figure(figsize=(12, 3.6 * rows + 0.25 * len(runs)), layout="constrained")
    axes = fig.subplots(rows, 2, sharex=True, squeeze=False).flatten()
    for ax in axes[len(titles):]:
        fig.delaxes(ax)
    panels = dict(zip(titles, axes))
    for i, run in enumerate(runs):
        style = {"color": f"C{i}", "linewidth": 1.2}
        panels["loss"].plot(*run.series("loss"), label=run.label, **style)
        panels["tokens/s/device"].plot(*run.series("tokens_per_s_per_device"), **style)
        panels["grad norm"].plot(*run.series("grad_norm"), **style)
    if len(runs) > 1:
        ref, ax = runs[0], panels[PANELS[1]]
        for i, run in enumerate(runs[1:], start=1):
            steps = sorted(ref.loss_steps() & run.loss_steps())
            ax.plot(steps, [y - x for x, y in zip(ref.losses(steps), run.losses(steps))], color=f"C{i}",
                    linewidth=1.2)
        ax.axhline(0.0, color="black", linewidth=0.6)
    grad_norms = [v for run in runs for v in run.series("grad_norm")[1]]
    if grad_norms and min(grad_norms) > 0 and max(grad_norms) > 20 * min(grad_norms):
        panels["grad norm"].set_yscale("log")  # early spikes would flatten the rest of the curve
    for title, ax in panels.items():
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_xlabel("step")
        ax.xaxis.set_tick_params(labelbottom=True)  # sharex hides them above a removed panel
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.legend(loc="outside upper center", ncols=1 if max(len(r.label) for r in runs) > 50 else 2, fontsize=8)
    return fig


def plot_runs(runs: list[Run], path: Path) -> None:
    fig = make_figure(runs)  # first: it names the install when matplotlib is missing
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(run_dirs: list[Path], out_dir: Path, warmup: int = 3) -> str:
    """Write OUT_DIR/summary.md and OUT_DIR/loss.png; returns the summary."""
    if warmup < 0:
        raise CompareError(f"--warmup={warmup} must be >= 0")
    runs = load_runs(run_dirs)
    pairs = [compare_pair(a, b) for a, b in itertools.combinations(runs, 2)]
    differing = differing_keys([r.config for r in runs if r.config is not None])
    summary = render_summary([summarize(r, warmup) for r in runs], pairs, warmup, differing)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_runs(runs, out_dir / "loss.png")
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
