"""Calibrate the emulated links against the 2 x H200 runs of docs/results.md, on the one GPU here.

    python scripts/calibrate_links.py [--fit] [--rate 130] [--baseline] [--rows all] [--steps 6] [--comm-sms N]
                                      [--ring-sms N] [--out DIR]

Each row of the table below is one run of docs/results.md on 2 x H200 (NVLink, NCCL; Qwen3-30B-A3B shapes cut to 8
or 4 layers, seq 4,096, local batch 4, learned routing, ``optim.lr=3e-4``). This script simulates rank 0 of each
(``scripts/simulate.py`` in this process: ``sim.world=2 sim.routing=learned``) with the links emulated at ONE
all-to-all rate (``sim.a2a_gb_s``) and prints each prediction beside its measured figure, and whether ``domino``
and ``fused`` come out in their measured order (fused ahead).

``--fit``: first simulate the 8-layer ``fused`` row at ``--rate`` and take the rate at which its exchange, fully
exposed in fused, would make its step the measured one: step(r) = step(rate) + a2a(rate) x (rate / r - 1), a2a being
the all-to-all time the emulation held per step; then every row at that rate (rounded to 5 GB/s). The fused 8-layer
row is then in-sample, the others out of sample. ``--baseline``: beside each row, today's prediction without the
emulation (``sim.links=off``: the all-to-all copies subtracted, the link time added on paper at 130 GB/s, main's
arithmetic), run in the same process on the same card. The card here need not be the H200 the rows were measured
on (the H100's compute alone is no faster): compare the emulated column with the baseline column of the same call.

Writes ``<out>/calibration.json`` (every report) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from simulate import output_dir, sim_args, simulate  # noqa: E402

from training.launch import one_line_errors  # noqa: E402

BASE = ["model=qwen3_moe_30b_a3b", "data.seq_len=4096", "train.local_batch_size=4", "optim.lr=3e-4", "sim.world=2",
        "sim.routing=learned"]
# (label, layers, overrides, tokens/s/GPU measured on 2 x H200, its docs/results.md row)
ROWS = [
    ("8 layers, ep2 fused", 8, ["parallel=ep2", "dispatcher=fused"], 53_727, "dispatchers: fused"),
    ("8 layers, ep2 domino", 8, ["parallel=ep2", "dispatcher=domino"], 51_878, "dispatchers: domino"),
    ("8 layers, ep2 dedup", 8, ["parallel=ep2", "dispatcher=dedup"], 49_694, "dispatchers: dedup"),
    ("8 layers, ep2 eager", 8, ["parallel=ep2", "dispatcher=eager"], 46_934, "dispatchers: eager"),
    ("4 layers, ep2 fused", 4, ["parallel=ep2", "dispatcher=fused"], 89_041, "two GPUs: layouts, row 18"),
    ("4 layers, ep2 eager", 4, ["parallel=ep2", "dispatcher=eager"], 80_386, "dispatchers: eager, 4 layers"),
    ("8 layers, fsdp2", 8, ["parallel=fsdp2"], 51_557, "two GPUs: layouts, row 19"),
]
FIT_ROW = ROWS[0]
BASELINE_RATE = 130.0  # main's sim.a2a_gb_s


def run_row(row: tuple, extra: list[str], out: Path, steps: int) -> dict:
    """One row simulated in this process; the process group and the GPU's memory freed after."""
    label, layers, overrides, _, _ = row
    argv = [*BASE, f"model.arch.num_hidden_layers={layers}", *overrides, f"sim.steps={steps}", *extra]
    sim, rest = sim_args([*argv, f"sim.out={out}"])
    began = time.perf_counter()
    try:
        with output_dir(str(out)) as where:
            report = simulate(sim, rest, where, advice=False)
    finally:
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    report["wall_s"] = time.perf_counter() - began
    report["label"] = label
    return report


def fitted_rate(report: dict, rate: float, measured: float) -> float:
    """The all-to-all rate at which the fully exposed exchange of ``report`` (simulated at ``rate``) gives the
    ``measured`` tokens/s/GPU, rounded to 5 GB/s; ``rate`` where no rate does."""
    step, a2a = report["step_s"], report["held_link_s"].get("all_to_all", 0.0)
    target = report["tokens_per_gpu"] / measured
    if a2a <= 0 or target - step + a2a <= 0:
        return rate
    return max(5.0, round(rate * a2a / (target - step + a2a) / 5) * 5)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=BASELINE_RATE, help="sim.a2a_gb_s (default %(default)s)")
    parser.add_argument("--fit", action="store_true", help="fit the rate on the 8-layer fused row first")
    parser.add_argument("--baseline", action="store_true", help="also each row with sim.links=off (main's)")
    parser.add_argument("--rows", default="all", help="comma-separated row numbers (1-based), or all")
    parser.add_argument("--steps", type=int, default=6, help="sim.steps of each run (default %(default)s)")
    parser.add_argument("--comm-sms", type=int, default=None, help="sim.comm_sms (default: simulate.py's)")
    parser.add_argument("--ring-sms", type=int, default=None, help="sim.ring_sms (default: simulate.py's)")
    parser.add_argument("--out", default="calibration", help="directory for the runs and calibration.json")
    args = parser.parse_args(argv)
    rows = ROWS if args.rows == "all" else [ROWS[int(i) - 1] for i in args.rows.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sms = [*([f"sim.comm_sms={args.comm_sms}"] if args.comm_sms else []),
           *([f"sim.ring_sms={args.ring_sms}"] if args.ring_sms else [])]
    result: dict = {"rate": args.rate, "rows": [], "fit": None}
    rate = args.rate
    if args.fit:
        fit = run_row(FIT_ROW, [f"sim.a2a_gb_s={rate}", *sms], out / "fit", args.steps)
        rate = fitted_rate(fit, args.rate, FIT_ROW[3])
        result["fit"] = {"at": args.rate, "report": fit, "rate": rate}
        print(f"\nfit on '{FIT_ROW[0]}': at {args.rate:g} GB/s the step is {fit['step_s']:.4f} s with "
              f"{fit['held_link_s'].get('all_to_all', 0.0):.4f} s of all-to-all held; measured "
              f"{FIT_ROW[3]:,} tokens/s/GPU -> sim.a2a_gb_s={rate:g}", flush=True)
    result["rate"] = rate
    for i, row in enumerate(rows):
        entry = {"label": row[0], "measured": row[3], "results_row": row[4]}
        entry["emulated"] = run_row(row, [f"sim.a2a_gb_s={rate}", *sms], out / f"row{i}-emulated", args.steps)
        if args.baseline:
            entry["baseline"] = run_row(row, [f"sim.a2a_gb_s={BASELINE_RATE}", "sim.links=off"],
                                        out / f"row{i}-baseline", args.steps)
        result["rows"].append(entry)
        (out / "calibration.json").write_text(json.dumps(result, indent=1, default=str))
    print_table(result)
    return result


def _error(predicted: float, measured: float) -> str:
    return f"{predicted:,.0f} ({(predicted - measured) / measured:+.1%})"


def print_table(result: dict) -> None:
    import torch

    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\nSimulated on {card} (torch {torch.__version__}), rank 0 of 2; measured on 2 x H200 "
          f"(docs/results.md). Emulated: links at sim.a2a_gb_s={result['rate']:g}; baseline: sim.links=off at "
          f"{BASELINE_RATE:g} (main's prediction, same card, same call).\n")
    print("| run (2 GPUs) | measured | emulated (error) | within 5% | baseline (error) | exchange held ms/step | "
          "compute busy ms/step |\n|---|---|---|---|---|---|---|")
    predicted = {}
    for entry in result["rows"]:
        e, m = entry["emulated"], entry["measured"]
        p = e["predicted_tokens_per_s_per_gpu"]
        predicted[entry["label"]] = p
        base = entry.get("baseline")
        base_cell = _error(base["predicted_tokens_per_s_per_gpu"], m) if base else "-"
        print(f"| {entry['label']} | {m:,} | {_error(p, m)} | {'yes' if abs(p - m) <= 0.05 * m else 'NO'} | "
              f"{base_cell} | {e['held_link_s'].get('all_to_all', 0.0) * 1e3:.1f} | {e['busy_s'] * 1e3:.1f} |")
    fused, domino = predicted.get("8 layers, ep2 fused"), predicted.get("8 layers, ep2 domino")
    if fused and domino:
        print(f"\norder: fused {fused:,.0f} {'>' if fused > domino else '<='} domino {domino:,.0f} "
              f"(measured: fused 53,727 > domino 51,878): {'as measured' if fused > domino else 'NOT as measured'}")
    errors = [abs(predicted[e["label"]] - e["measured"]) / e["measured"] for e in result["rows"]]
    print(f"mean absolute error {sum(errors) / len(errors):.1%}, largest {max(errors):.1%}")


if __name__ == "__main__":
    with one_line_errors():
        main(sys.argv[1:])
