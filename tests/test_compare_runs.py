"""scripts/compare_runs.py: the summary table from metrics.jsonl, the loss correlation against numpy's, the
plot, and clear errors for runs that cannot be compared; then on two real (tiny) training runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train
from scripts import compare_runs

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, steps: range, loss, tps: float = 100.0, mfu: float | None = None,
              dispatcher: str | None = "eager") -> Path:
    """A run directory as the trainer writes it: metrics.jsonl (+ config.yaml unless dispatcher is None)."""
    run_dir.mkdir(parents=True)
    lines = [{"step": s, "loss": loss(s), "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 2 * (tps + s),
              "tokens_per_s_per_device": tps + s, "mfu": None if mfu is None else mfu * s,
              "peak_mem_gib": 1.0 + 0.01 * s} for s in steps]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if dispatcher is not None:
        (run_dir / "config.yaml").write_text(
            f"model:\n  name: qwen3_moe_debug\nparallel:\n  name: ep2\ndispatcher:\n  name: {dispatcher}\n")
    return run_dir


def table_rows(summary: str, header: str) -> list[list[str]]:
    """The cells of the markdown table whose header row starts with ``header``."""
    lines = summary.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def loss_a(step: int) -> float:
    return 10.0 / step + 0.05 * np.sin(step)


def loss_b(step: int) -> float:
    return 10.0 / step + 0.05 * np.cos(step)


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    a = write_run(tmp_path / "a", range(1, 11), loss_a, tps=100.0, mfu=0.01)
    b = write_run(tmp_path / "b", range(3, 13), loss_b, tps=200.0, dispatcher="fused")
    return a, b


def test_summary_table_holds_each_runs_numbers(two_runs, tmp_path):
    summary = compare_runs.compare(list(two_runs), tmp_path / "out", warmup=3)
    rows = {row[0]: row for row in table_rows(summary, "| run |")}
    assert set(rows) == {"eager/ep2/qwen3_moe_debug", "fused/ep2/qwen3_moe_debug"}
    # run | dir | steps | tokens/s/device | MFU | peak mem | final loss; means over the steps after the first 3.
    a = rows["eager/ep2/qwen3_moe_debug"]
    assert a[1:] == [str(two_runs[0]), "10", f"{np.mean([100.0 + s for s in range(4, 11)]):,.1f}",
                     f"{100 * np.mean([0.01 * s for s in range(4, 11)]):.2f}%", "1.10", f"{loss_a(10):.4f}"]
    b = rows["fused/ep2/qwen3_moe_debug"]
    assert b[2:] == ["12", f"{np.mean([200.0 + s for s in range(6, 13)]):,.1f}", "n/a", "1.12", f"{loss_b(12):.4f}"]


def test_loss_correlation_matches_numpy_over_common_steps(two_runs, tmp_path):
    summary = compare_runs.compare(list(two_runs), tmp_path / "out")
    [pair] = table_rows(summary, "| run A |")
    common = range(3, 11)
    expected = np.corrcoef([loss_a(s) for s in common], [loss_b(s) for s in common])[0, 1]
    assert pair[:3] == ["eager/ep2/qwen3_moe_debug", "fused/ep2/qwen3_moe_debug", str(len(common))]
    assert float(pair[3]) == pytest.approx(expected, abs=5e-5)  # printed to 4 decimals
    assert float(pair[4]) == pytest.approx(max(abs(loss_a(s) - loss_b(s)) for s in common), rel=1e-3)
    runs = compare_runs.load_runs(list(two_runs))
    assert compare_runs.compare_pair(*runs).pearson == pytest.approx(expected, rel=1e-12)


def test_cli_writes_summary_and_png_and_prints_the_summary(two_runs, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "scripts/compare_runs.py", *map(str, two_runs), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (out / "summary.md").read_text().strip() == done.stdout.strip()
    assert (out / "loss.png").read_bytes()[:8] == PNG_MAGIC


def test_labels_fall_back_to_the_directory_and_stay_distinct(tmp_path):
    plain = write_run(tmp_path / "plain", range(1, 5), loss_a, dispatcher=None)
    x = write_run(tmp_path / "x", range(1, 5), loss_a)
    y = write_run(tmp_path / "y", range(1, 5), loss_b)
    labels = [run.label for run in compare_runs.load_runs([plain, x, y])]
    assert labels == ["plain", "eager/ep2/qwen3_moe_debug (x)", "eager/ep2/qwen3_moe_debug (y)"]


def test_a_run_with_no_more_steps_than_the_warmup_is_averaged_over_all(tmp_path):
    short = write_run(tmp_path / "short", range(1, 3), loss_a, tps=50.0)
    summary = compare_runs.compare([short], tmp_path / "out", warmup=3)
    [row] = table_rows(summary, "| run |")
    assert row[3] == f"{np.mean([51.0, 52.0]):,.1f}"
    assert "Averaged over every step (no more than 3 logged): eager/ep2/qwen3_moe_debug." in summary


@pytest.mark.parametrize("case, message", [
    ("missing", "metrics.jsonl not found"),
    ("empty", "has no metrics"),
    ("disjoint", "share 0 logged step(s)"),
])
def test_runs_that_cannot_be_compared_fail_with_a_clear_error(tmp_path, capsys, case, message):
    a = write_run(tmp_path / "a", range(1, 5), loss_a)
    b = tmp_path / "b"
    if case == "missing":
        b.mkdir()
    elif case == "empty":
        write_run(b, range(0), loss_a)
    else:
        write_run(b, range(10, 15), loss_b)
    assert compare_runs.main([str(a), str(b), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("compare_runs: error: ") and message in err and str(b) in err


def test_missing_matplotlib_names_the_install(two_runs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(compare_runs.CompareError, match="pip install matplotlib"):
        compare_runs.compare(list(two_runs), tmp_path / "out")


def test_real_runs_same_seed_agree_and_another_seed_does_not(tiny_run_config, tmp_path):
    dirs = []
    for name, seed in [("first", 0), ("again", 0), ("seed1", 1)]:
        cfg = tiny_run_config("train.steps=8", f"train.seed={seed}", f"train.output_dir={tmp_path / name}",
                              "train.save_final=false")
        train.run(cfg)
        dirs.append(tmp_path / name)
    summary = compare_runs.compare(dirs, tmp_path / "out", warmup=2)
    rows = table_rows(summary, "| run |")
    assert [row[0] for row in rows] == [f"eager/single/qwen3_moe_debug ({d.name})" for d in dirs]
    assert all(row[2] == "8" and row[4] == "n/a" for row in rows)  # 8 steps; MFU not measured on CPU
    pairs = {(p[0].split("(")[1][:-1], p[1].split("(")[1][:-1]): p for p in table_rows(summary, "| run A |")}
    # Same seed, same process: the same curve (deterministic CPU kernels), so r = 1 and no difference.
    assert pairs[("first", "again")][3:] == ["1.0000", "0"]
    assert float(pairs[("first", "seed1")][4]) > 0
    assert (tmp_path / "out" / "loss.png").read_bytes()[:8] == PNG_MAGIC
