"""Plot how a run routed its tokens: each MoE layer's per-expert token shares over the steps, and load imbalance.

    python scripts/plot_routing.py RUN_DIR [--out PNG]

Reads ``RUN_DIR/routing.jsonl``, which training writes every ``logging.routing_every`` steps, and writes
``RUN_DIR/routing.png`` (or ``--out``): a heatmap per MoE layer (x: step, y: expert, colour: the expert's share of
the layer's routed tokens; one colour bar for all of them) above one panel with each layer's load imbalance, max /
mean tokens per expert (= E x the largest share; 1 is perfect balance), as ``moe/layer<i>/imbalance`` in
metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as `python scripts/plot_routing.py`

from training.metrics import ROUTING_FILE  # noqa: E402

DPI = 100
WIDTH_IN, LAYER_HEIGHT_IN, CURVE_HEIGHT_IN = 10.0, 1.6, 2.5  # a heatmap per layer, then the imbalance panel
LEGEND_ROWS = 16  # layers per legend column of the imbalance panel


class PlotError(ValueError):
    """A run directory that cannot be plotted; the message says why and what to do."""


def read_routing(run_dir: Path) -> tuple[list[int], np.ndarray]:
    """The recorded steps and their shares ``[steps, layers, experts]`` (the last line of a step wins)."""
    path = run_dir / ROUTING_FILE
    if not path.is_file():
        raise PlotError(f"{path} not found: train with logging.routing_every=N (N > 0) to record expert shares")
    records: dict[int, Any] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
            records[int(record["step"])] = record["expert_share"]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise PlotError(f"{path}:{number}: not a routing record ({e})") from e
    if not records:
        raise PlotError(f"{path} is empty: the run recorded no step (is logging.routing_every above train.steps?)")
    steps = sorted(records)
    try:
        share_SLE = np.array([records[s] for s in steps], dtype=float)
    except ValueError as e:  # ragged: layers or experts changed between records
        raise PlotError(f"{path}: the records do not all have the same layers and experts ({e})") from e
    if share_SLE.ndim != 3:
        raise PlotError(f"{path}: expert_share must be a list of per-layer lists of expert shares")
    return steps, share_SLE


def figure_size(num_layers: int) -> tuple[float, float]:
    """Inches (width, height): one heatmap row per layer and the imbalance panel."""
    return WIDTH_IN, LAYER_HEIGHT_IN * num_layers + CURVE_HEIGHT_IN


def step_edges(steps: list[int]) -> np.ndarray:
    """Cell edges half way between recorded steps, so uneven gaps (a resume, a changed interval) stay to scale."""
    s = np.asarray(steps, dtype=float)
    if len(s) == 1:
        return np.array([s[0] - 0.5, s[0] + 0.5])
    mid = (s[1:] + s[:-1]) / 2
    return np.concatenate([[2 * s[0] - mid[0]], mid, [2 * s[-1] - mid[-1]]])


def make_figure(steps: list[int], share_SLE: np.ndarray) -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise PlotError("plots need matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    _, num_layers, num_experts = share_SLE.shape
    fig = plt.figure(figsize=figure_size(num_layers), layout="constrained")
    axes = fig.subplots(num_layers + 1, 1, sharex=True, squeeze=False,
                        height_ratios=[LAYER_HEIGHT_IN] * num_layers + [CURVE_HEIGHT_IN])[:, 0]
    x, y = step_edges(steps), np.arange(num_experts + 1) - 0.5
    vmax = share_SLE.max()  # one colour scale, so layers compare
    for layer, ax in enumerate(axes[:-1]):
        mesh = ax.pcolormesh(x, y, share_SLE[:, layer].T, vmin=0.0, vmax=vmax, cmap="viridis")
        ax.set_ylabel(f"layer {layer}\nexpert", fontsize=8)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(mesh, ax=list(axes[:-1]), label="share of the layer's routed tokens")
    curve = axes[-1]
    for layer in range(num_layers):
        curve.plot(steps, num_experts * share_SLE[:, layer].max(axis=1), linewidth=1.0, label=f"layer {layer}")
    curve.axhline(1.0, color="black", linewidth=0.6)  # perfect balance
    curve.set_ylabel("imbalance\n(max / mean)", fontsize=8)
    curve.set_xlabel("step")
    curve.xaxis.set_major_locator(MaxNLocator(integer=True))  # shared: the heatmaps' steps too
    curve.grid(alpha=0.3)
    curve.legend(fontsize=7, ncols=math.ceil(num_layers / LEGEND_ROWS), loc="upper right")
    return fig


def plot_routing(run_dir: Path, out: Path | None = None) -> Path:
    """Write the plot (default ``RUN_DIR/routing.png``); returns its path."""
    steps, share_SLE = read_routing(run_dir)
    fig = make_figure(steps, share_SLE)
    import matplotlib.pyplot as plt

    out = out or run_dir / "routing.png"
    fig.savefig(out, dpi=DPI)  # no bbox_inches="tight": the file is exactly figure_size x DPI pixels
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory with routing.jsonl")
    parser.add_argument("--out", type=Path, metavar="PNG", help="where the plot goes (default RUN_DIR/routing.png)")
    args = parser.parse_args(argv)
    try:
        print(plot_routing(args.run_dir, args.out))
    except PlotError as e:
        print(f"plot_routing: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
