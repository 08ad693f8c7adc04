"""Run a Hydra job on several local processes: ``python train.py launch.nproc_per_node=8 parallel=ep8``
re-launches itself under torchrun with the same overrides, so Hydra multirun sweeps (``-m``) run each job
as its own torchrun, one after another."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LaunchConfig:
    nproc_per_node: int = 1  # > 1 and not already under torchrun: re-launch this job with torchrun


def needs_torchrun(cfg: LaunchConfig) -> bool:
    return cfg.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ


def relaunch_with_torchrun(cfg: LaunchConfig, overrides: list[str], run_dir: str) -> None:
    """Run ``train.py <overrides>`` under torchrun on this node, writing into this job's run directory."""
    script = Path(__file__).resolve().parents[1] / "train.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.nproc_per_node}",
           str(script), *overrides, f"train.output_dir={run_dir}"]
    print("launching:", " ".join(cmd), flush=True)
    result = subprocess.run(cmd)
    if result.returncode != 0:
        raise RuntimeError(f"torchrun job failed with exit code {result.returncode}: {' '.join(cmd)}")
