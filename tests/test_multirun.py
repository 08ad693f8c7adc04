"""Hydra multirun as a user runs it: a 2-job sweep, each job re-launched under its own torchrun
(launch.nproc_per_node=2, parallel=ep2), then compare_runs on the two run directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import TINY_MODEL, write_tokens

REPO = Path(__file__).resolve().parents[1]


def test_two_job_sweep_under_torchrun_then_compare_runs(tmp_path):
    data = write_tokens(tmp_path / "tokens.npy", 4096)
    sweep = subprocess.run(
        [sys.executable, "train.py", "-m", "train.seed=0,1", *TINY_MODEL, "parallel=ep2", "launch.nproc_per_node=2",
         "data=tokens", f"data.path={data}", "data.seq_len=16", f"data.cache_dir={tmp_path / 'cache'}",
         "train.steps=6", "train.local_batch_size=2", "logging.tensorboard=false", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert sweep.returncode == 0, sweep.stdout[-2000:] + sweep.stderr[-3000:]
    assert sweep.stdout.count("launching: torchrun --standalone --nproc_per_node=2") == 2
    jobs = [tmp_path / "sweep" / str(n) for n in (0, 1)]
    for n, job in enumerate(jobs):
        metrics = [json.loads(line) for line in (job / "metrics.jsonl").open()]
        assert [m["step"] for m in metrics] == list(range(1, 7))
        assert f"seed: {n}" in (job / "config.yaml").read_text() and "name: ep2" in (job / "config.yaml").read_text()

    compare = subprocess.run([sys.executable, "scripts/compare_runs.py", *map(str, jobs), "--out", str(tmp_path / "cmp")],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert compare.returncode == 0, compare.stderr[-2000:]
    assert (tmp_path / "cmp" / "loss.png").stat().st_size > 0
    summary = (tmp_path / "cmp" / "summary.md").read_text()
    assert "Pearson" in summary and summary.count("fused/ep2/qwen3_moe_debug") >= 2
