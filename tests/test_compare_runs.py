"""scripts/compare_runs.py: the summary table from metrics.jsonl, the loss correlation against numpy's, labels
from the config keys that differ, the plot's panels, and clear errors for runs that cannot be compared; then on
real (tiny) training runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import train
from scripts import compare_runs

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, steps: range, loss, tps: float = 100.0, mfu: float | None = None,
              dispatcher: str | None = "eager", **keys) -> Path:
    """A run directory as the trainer writes it: metrics.jsonl, and config.yaml unless dispatcher is None, with
    its own train.output_dir and any dotted ``keys`` (``parallel__ep_size=2`` sets parallel.ep_size)."""
    run_dir.mkdir(parents=True)
    lines = [{"step": s, "loss": loss(s), "grad_norm": 1.0 + 0.1 * s, "lr": 1e-3, "tokens_per_s": 2 * (tps + s),
              "tokens_per_s_per_device": tps + s, "mfu": None if mfu is None else mfu * s,
              "peak_mem_gib": 1.0 + 0.01 * s} for s in steps]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if dispatcher is not None:
        config = {"model": {"name": "qwen3_moe_debug", "model_type": "qwen3_moe", "arch": {"num_hidden_layers": 2}},
                  "parallel": {"name": "ep2", "ep_size": 2}, "dispatcher": {"name": dispatcher},
                  "optim": {"lr": 1e-3, "betas": [0.9, 0.95]}, "train": {"output_dir": str(run_dir), "seed": 0}}
        for dotted, value in keys.items():
            *groups, leaf = dotted.split("__")
            node = config
            for group in groups:
                node = node.setdefault(group, {})
            node[leaf] = value
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
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
    assert set(rows) == {"dispatcher.name=eager", "dispatcher.name=fused"}
    # run | dir | steps | tokens/s/device | MFU | peak mem | final loss | presets; means after the first 3 steps.
    a = rows["dispatcher.name=eager"]
    assert a[1:] == [str(two_runs[0]), "10", f"{np.mean([100.0 + s for s in range(4, 11)]):,.1f}",
                     f"{100 * np.mean([0.01 * s for s in range(4, 11)]):.2f}%", "1.10", f"{loss_a(10):.4f}",
                     "eager/ep2/qwen3_moe_debug"]
    b = rows["dispatcher.name=fused"]
    assert b[2:] == ["12", f"{np.mean([200.0 + s for s in range(6, 13)]):,.1f}", "n/a", "1.12", f"{loss_b(12):.4f}",
                     "fused/ep2/qwen3_moe_debug"]
    assert "Config keys that differ between the runs: dispatcher.name." in summary


def test_loss_correlation_matches_numpy_over_common_steps(two_runs, tmp_path):
    summary = compare_runs.compare(list(two_runs), tmp_path / "out")
    [pair] = table_rows(summary, "| run A |")
    common = range(3, 11)
    expected = np.corrcoef([loss_a(s) for s in common], [loss_b(s) for s in common])[0, 1]
    assert pair[:3] == ["dispatcher.name=eager", "dispatcher.name=fused", str(len(common))]
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


def legend(runs: list) -> list[str]:
    fig = compare_runs.make_figure(runs)
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    import matplotlib.pyplot as plt

    plt.close(fig)
    return texts


def test_the_legend_names_exactly_the_keys_that_differ(tmp_path):
    # Keys that differ but do not matter (output dir, resume, logging, checkpoints) are left out.
    common = range(1, 6)
    a = write_run(tmp_path / "a", common, loss_a, train__resume="none", logging__wandb=False, checkpoint__interval=0)
    b = write_run(tmp_path / "b", common, loss_a, dispatcher="fused", train__resume="auto", logging__wandb=True)
    c = write_run(tmp_path / "c", common, loss_b, dispatcher="fused", parallel__ep_size=4, checkpoint__interval=5)
    assert legend(compare_runs.load_runs([a, b])) == ["dispatcher.name=eager", "dispatcher.name=fused"]
    assert legend(compare_runs.load_runs([a, b, c])) == [
        "dispatcher.name=eager, parallel.ep_size=2", "dispatcher.name=fused, parallel.ep_size=2",
        "dispatcher.name=fused, parallel.ep_size=4"]
    assert legend(compare_runs.load_runs([b, c])) == ["parallel.ep_size=2", "parallel.ep_size=4"]
    # A list value, a key only one run has, a long value kept by its end.
    d = write_run(tmp_path / "d", common, loss_a, optim__betas=[0.9, 0.99], data__path="/data/" + "x" * 40 + "/c.npy")
    tail = "x" * (compare_runs.MAX_VALUE_CHARS - len(".../c.npy")) + "/c.npy"
    assert legend(compare_runs.load_runs([a, d])) == [
        "data.path=unset, optim.betas=[0.9, 0.95]", f"data.path=...{tail}, optim.betas=[0.9, 0.99]"]


def test_a_different_model_hides_its_architecture_keys(tmp_path):
    a = write_run(tmp_path / "a", range(1, 5), loss_a)
    b = write_run(tmp_path / "b", range(1, 5), loss_b, model__name="qwen35_moe_debug", model__model_type="qwen3_5_moe",
                  model__arch={"num_hidden_layers": 4})
    c = write_run(tmp_path / "c", range(1, 5), loss_b, model__arch={"num_hidden_layers": 4})
    assert [r.label for r in compare_runs.load_runs([a, b])] == ["model.name=qwen3_moe_debug",
                                                                  "model.name=qwen35_moe_debug"]
    assert [r.label for r in compare_runs.load_runs([a, c])] == ["model.arch.num_hidden_layers=2",
                                                                  "model.arch.num_hidden_layers=4"]


def test_labels_fall_back_to_the_directory_and_stay_distinct(tmp_path):
    plain = write_run(tmp_path / "plain", range(1, 5), loss_a, dispatcher=None)
    x = write_run(tmp_path / "x", range(1, 5), loss_a)
    y = write_run(tmp_path / "y", range(1, 5), loss_b)
    assert [run.label for run in compare_runs.load_runs([plain, x, y])] == ["plain", "x", "y"]  # nothing differs
    # The same directory name under two parents: the parent tells them apart.
    first = write_run(tmp_path / "2026-11-30" / "12-00-00", range(1, 5), loss_a)
    second = write_run(tmp_path / "2026-12-01" / "12-00-00", range(1, 5), loss_a, train__seed=1)
    third = write_run(tmp_path / "2026-12-02" / "12-00-00", range(1, 5), loss_a)
    assert [run.label for run in compare_runs.load_runs([first, second, third])] == [
        "train.seed=0 (2026-11-30/12-00-00)", "train.seed=1", "train.seed=0 (2026-12-02/12-00-00)"]


def test_too_many_differing_keys_label_by_directory_and_the_summary_lists_them(tmp_path):
    keys = {"optim__lr": 3e-3, "optim__eps": 1e-6, "train__seed": 3, "parallel__ep_size": 4, "dispatcher": "fused"}
    a = write_run(tmp_path / "a", range(1, 5), loss_a)
    b = write_run(tmp_path / "b", range(1, 5), loss_b, **keys)
    summary = compare_runs.compare([a, b], tmp_path / "out")
    assert [row[0] for row in table_rows(summary, "| run |")] == ["a", "b"]
    assert ("Config keys that differ between the runs (too many for labels: runs are named by directory): "
            "dispatcher.name, optim.eps, optim.lr, parallel.ep_size, train.seed.") in summary


def test_the_plot_has_loss_difference_throughput_and_grad_norm_panels(two_runs, tmp_path):
    runs = compare_runs.load_runs(list(two_runs))
    import matplotlib.pyplot as plt

    fig = compare_runs.make_figure(runs)
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert list(panels) == ["loss", "loss difference from the first run", "tokens/s/device", "grad norm"]
    [_, line_b] = panels["tokens/s/device"].get_lines()
    assert list(line_b.get_xdata()) == list(range(3, 13))
    assert list(line_b.get_ydata()) == [200.0 + s for s in range(3, 13)]
    assert list(panels["grad norm"].get_lines()[0].get_ydata()) == pytest.approx([1.0 + 0.1 * s for s in range(1, 11)])
    [diff] = panels["loss difference from the first run"].get_lines()[:1]
    assert list(diff.get_xdata()) == list(range(3, 11))
    assert list(diff.get_ydata()) == pytest.approx([loss_b(s) - loss_a(s) for s in range(3, 11)])
    plt.close(fig)
    # One run: no difference panel.
    fig = compare_runs.make_figure(runs[:1])
    assert [ax.get_title() for ax in fig.axes] == ["loss", "tokens/s/device", "grad norm"]
    plt.close(fig)


def test_a_run_with_no_more_steps_than_the_warmup_is_averaged_over_all(tmp_path):
    short = write_run(tmp_path / "short", range(1, 3), loss_a, tps=50.0)
    summary = compare_runs.compare([short], tmp_path / "out", warmup=3)
    [row] = table_rows(summary, "| run |")
    assert row[3] == f"{np.mean([51.0, 52.0]):,.1f}"
    assert "Averaged over every step (no more than 3 logged): short." in summary


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
    # Only the seed tells them apart (output_dir is ignored); two runs of seed 0: their directories too.
    labels = ["train.seed=0 (first)", "train.seed=0 (again)", "train.seed=1"]
    assert [row[0] for row in rows] == labels
    assert all(row[2] == "8" and row[4] == "n/a" and row[7] == "fused/single/qwen3_moe_debug" for row in rows)
    pairs = {(p[0], p[1]): p for p in table_rows(summary, "| run A |")}  # 8 steps; MFU not measured on CPU
    # Same seed, same process: the same curve (deterministic CPU kernels), so r = 1 and no difference.
    assert pairs[(labels[0], labels[1])][3:] == ["1.0000", "0"]
    assert float(pairs[(labels[0], labels[2])][4]) > 0
    assert (tmp_path / "out" / "loss.png").read_bytes()[:8] == PNG_MAGIC


def test_a_skipped_step_with_a_null_loss_is_left_out_of_the_comparison(tmp_path):
    a = write_run(tmp_path / "a", range(1, 8), loss_a)
    b = write_run(tmp_path / "b", range(1, 8), lambda s: None if s in (4, 7) else loss_b(s), dispatcher="fused")
    summary = compare_runs.compare([a, b], tmp_path / "out")
    [pair] = table_rows(summary, "| run A |")
    steps = [1, 2, 3, 5, 6]
    assert pair[2] == "5" and float(pair[3]) == pytest.approx(
        np.corrcoef([loss_a(s) for s in steps], [loss_b(s) for s in steps])[0, 1], abs=5e-5)
    assert table_rows(summary, "| run |")[1][6] == f"{loss_b(6):.4f}"  # the last finite loss
