"""Two nodes on one machine, each its own torchrun, joined into one gloo job over the loopback:

- two launches of scripts/slurm/launch.sh (NNODES=2, NODE_RANK=0/1, MASTER_ADDR=127.0.0.1), 4 workers each,
  train ep4_efsdp2 on 2 x 4 ranks;
- a 2-node job of scripts/slurm/train_multinode.sbatch on the local Slurm cluster, whose partition `two` is two
  slurmd on this host (scripts/slurm/local_cluster.sh): srun starts launch.sh once on each, 2 workers each, ep4.

Both train the single-process run's curve (fp32, rel 1e-4: the layouts differ only in summation order) on the same
global batch of 8 sequences.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

import train
from models import build_args, get_spec
from models.hf_io import export_hf
from tests.conftest import TINY_MODEL, compose_config, write_tokens
from tests.dist_utils import _free_port, assert_same_curve
from tests.test_slurm import (JOB_TIMEOUT_S, REPO, SLURM_DIR, base_env, cluster,  # noqa: F401 (cluster: fixture)
                               slurm, unavailable)

pytestmark = pytest.mark.torch_apis  # torchrun's rendezvous across nodes

GLOBAL_BATCH, STEPS = 8, 3


def overrides(tmp_path: Path, parallel: str, local_batch: int) -> list[str]:
    """3 steps of the tiny Qwen3-MoE from tmp_path/hf on tmp_path/tokens.npy, clipping active; the run directory is
    the caller's."""
    return [*TINY_MODEL, f"model.init_from={tmp_path / 'hf'}", f"parallel={parallel}", "data=tokens", f"data.path={tmp_path / 'tokens.npy'}",
            "data.seq_len=16", f"data.cache_dir={tmp_path / 'cache'}", f"train.steps={STEPS}",
            f"train.local_batch_size={local_batch}", "train.save_final=false", "optim.warmup_steps=0", "optim.lr=1e-2",
            "optim.grad_clip=0.5", "logging.tensorboard=false", "train.device=cpu", "train.mixed_precision=fp32"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The token file, the Hugging Face checkpoint of a seeded model that every run loads, and the single-process
    run on the whole global batch."""
    tmp_path = tmp_path_factory.mktemp("two_nodes")
    write_tokens(tmp_path / "tokens.npy", 4096)
    args = build_args("qwen3_moe", dict(compose_config(TINY_MODEL).model.arch))
    model = get_spec("qwen3_moe").model_cls(args)
    model.init_weights()
    export_hf(model, "qwen3_moe", tmp_path / "hf")
    reference = train.run(compose_config([*overrides(tmp_path, "single", GLOBAL_BATCH),
                                          f"train.output_dir={tmp_path / 'single'}"]))
    assert reference[0]["grad_norm"] > 0.5  # max_norm 0.5 really clipped
    return tmp_path, reference


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_launches_of_launch_sh_form_one_job(inputs):
    tmp_path, reference = inputs
    run_dir = tmp_path / "launch-2x4"
    env = base_env(NNODES="2", NPROC_PER_NODE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    args = ["bash", str(SLURM_DIR / "launch.sh"), *overrides(tmp_path, "ep4_efsdp2", 1), f"train.output_dir={run_dir}"]
    # Each node in its own session, so a hung one is killed with its torchrun workers.
    nodes = [subprocess.Popen(args, env={**env, "NODE_RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for rank in (0, 1)]
    try:
        logs = [node.communicate(timeout=JOB_TIMEOUT_S)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    for rank, (node, log) in enumerate(zip(nodes, logs)):
        assert node.returncode == 0, f"node {rank}:\n{log[-4000:]}"
        assert f"node {rank}/2 on " in log
    # One world of 8 ranks across both torchruns, not two jobs of 4.
    assert "layout: world 8 = dp 8 x cp 1; experts: ep 4 x efsdp 2 x edp 1" in (run_dir / "train.log").read_text()
    assert_same_curve(metrics(run_dir), reference, steps=list(range(1, STEPS + 1)))


def test_two_node_slurm_job_runs_train_multinode_sbatch(cluster, inputs):  # noqa: F811 (cluster: fixture)
    tmp_path, reference = inputs
    env = {**cluster, "RUNS_ROOT": str(tmp_path / "runs"), "NPROC_PER_NODE": "2"}
    if len(slurm(env, "sinfo", "-h", "-N", "-p", "two", "-o", "%N").split()) != 2:  # a line per node, whatever its state
        unavailable("the local cluster has no 2-node partition `two` (started by an older local_cluster.sh?)")
    # `--wait`: sbatch exits with the job's exit code. Partition `two` holds the cluster's two nodes.
    done = subprocess.run(["sbatch", "--parsable", "--wait", "--partition=two", f"--output={tmp_path}/%j.out",
                           str(SLURM_DIR / "train_multinode.sbatch"), *overrides(tmp_path, "ep4", 2)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    job_id = done.stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch: {done.stdout}{done.stderr}"
    log = (tmp_path / f"{job_id}.out").read_text()
    assert done.returncode == 0, f"job {job_id} failed; log:\n{log[-4000:]}"
    [nodelist] = re.findall(rf"job {job_id} \(start 1\) on (\S+): run directory", log)
    assert len(slurm(env, "scontrol", "show", "hostnames", nodelist).split()) == 2  # two slurmd, one task each
    for rank in (0, 1):
        assert f"node {rank}/2 on " in log and f"--nnodes 2 --node_rank {rank} --nproc_per_node 2" in log
    run_dir = tmp_path / "runs" / job_id
    assert "layout: world 4 = dp 4 x cp 1; experts: ep 4 x efsdp 1 x edp 1" in (run_dir / "train.log").read_text()
    assert_same_curve(metrics(run_dir), reference, steps=list(range(1, STEPS + 1)))
