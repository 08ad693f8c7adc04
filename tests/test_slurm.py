"""The Slurm scripts (scripts/slurm/): the commands a dry run prints for one node and for a faked 2-node
allocation, and real one-node jobs on the local cluster (scripts/slurm/local_cluster.sh): a training job
submitted through train_1node.sbatch as a user would; a job requeued by `scontrol requeue` (as preemption
does) that resumes from its checkpoint onto the uninterrupted run's curve; and a 2-rank job that meets its
time-limit warning, checkpoints, requeues itself and resumes.

Slurm is not among the test dependencies: the tests that need it (the multi-node dry runs need `scontrol`, the
jobs a running local cluster) skip, saying how to enable them: `scripts/slurm/local_cluster.sh start` as root,
which installs Debian's Slurm packages when missing and starts the cluster. The tests never install anything and
never start or stop the cluster. CI (.ci/run) starts it and sets QWEN_MOE_REQUIRE_SLURM=1, under which a missing
Slurm or cluster fails these tests instead of skipping them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from tests.conftest import TINY_MODEL, write_tokens

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "scripts" / "slurm"
ENABLE_HINT = ("to run it, start the local test cluster as root: scripts/slurm/local_cluster.sh start (installs "
               "Debian's slurmctld slurmd slurm-client munge if missing)")
REQUIRE_ENV = "QWEN_MOE_REQUIRE_SLURM"  # "1" (CI): no Slurm is a failure, not a skip
# Variables the scripts read: cleared so a test run inside a real allocation sees only what the test sets.
LAYOUT_VARS = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "RUNS_ROOT", "REPO_DIR",
               "DRY_RUN", "TORCHRUN")
STEPS = 400  # ~20-50 ms each plus a checkpoint every 2: a quiet machine must still leave seconds to signal it mid-run
JOB_TIMEOUT_S = 300  # a debug job takes ~10-30 s; the slack is for a loaded CI machine


def unavailable(reason: str) -> NoReturn:
    """Skip the test (Slurm is optional), or fail it where Slurm is required (QWEN_MOE_REQUIRE_SLURM=1)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 requires Slurm; {ENABLE_HINT}", pytrace=False)
    pytest.skip(f"{reason}; {ENABLE_HINT}")


def require(*binaries: str) -> None:
    missing = [b for b in binaries if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        unavailable(f"Slurm is not installed (no {', '.join(missing)})")


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in LAYOUT_VARS}
    return {**env, **extra}


# ---------------------------------------------------------------- dry runs: the commands each node would run


def dry_run(script: str, env: dict[str, str], *overrides: str) -> list[list[str]]:
    """The commands a DRY_RUN=1 run of scripts/slurm/<script> prints, one per node, split like a shell."""
    done = subprocess.run(["bash", str(SLURM_DIR / script), *overrides], env={**env, "DRY_RUN": "1"},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return [shlex.split(line) for line in done.stdout.splitlines()]


def parse(cmd: list[str]) -> tuple[dict[str, str], list[str]]:
    """torchrun's flags (--name value) and the Hydra overrides after train.py."""
    assert cmd[0] == "torchrun", cmd
    split = cmd.index("train.py")
    flags = cmd[1:split]
    return dict(zip(flags[::2], flags[1::2])), cmd[split + 1:]


@pytest.fixture
def fake_slurm_conf(tmp_path: Path) -> str:
    """Enough of a slurm.conf for `scontrol show hostnames` (no daemon is asked)."""
    require("scontrol")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=fake\nSlurmctldHost=localhost\n")
    return str(conf)


def test_dry_run_outside_slurm_is_one_local_node_with_overrides_verbatim():
    [cmd] = dry_run("launch.sh", base_env(), "train.steps=3", "data.path=/data/my corpus.npy")
    flags, overrides = parse(cmd)
    assert flags == {"--nnodes": "1", "--node_rank": "0", "--nproc_per_node": "1",
                     "--master_addr": "127.0.0.1", "--master_port": "29500"}
    assert overrides == ["train.steps=3", "data.path=/data/my corpus.npy"]


def test_dry_run_plain_multinode_torchrun_from_variables():
    env = base_env(NNODES="3", NODE_RANK="2", NPROC_PER_NODE="4", MASTER_ADDR="10.0.0.7", MASTER_PORT="29400")
    cmds = dry_run("launch.sh", env, "parallel=ep4")
    assert [parse(c)[0]["--node_rank"] for c in cmds] == ["0", "1", "2"]
    for cmd in cmds:
        flags, overrides = parse(cmd)
        assert (flags["--nnodes"], flags["--nproc_per_node"]) == ("3", "4")
        assert (flags["--master_addr"], flags["--master_port"]) == ("10.0.0.7", "29400")
        assert overrides == ["parallel=ep4"]


def test_dry_run_rejects_a_node_rank_outside_the_job():
    done = subprocess.run(["bash", str(SLURM_DIR / "launch.sh")], capture_output=True, text=True,
                          env=base_env(NNODES="2", NODE_RANK="2", DRY_RUN="1"), timeout=30)
    assert done.returncode != 0 and "NODE_RANK=2 must be below NNODES=2" in done.stderr


def fake_allocation(conf: str, **extra: str) -> dict[str, str]:
    """The variables Slurm sets in the batch shell of a 2-node job with 8 GPUs per node, submitted from the
    repository root."""
    return base_env(**{"SLURM_CONF": conf, "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
                       "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_GPUS_ON_NODE": "8",
                       "SLURM_SUBMIT_DIR": str(REPO), **extra})


def test_dry_run_of_multinode_sbatch_derives_every_node_from_the_allocation(fake_slurm_conf):
    # A NODE_RANK exported at submission would be the same on every node: the allocation's rank wins.
    env = fake_allocation(fake_slurm_conf, NODE_RANK="5")
    cmds = dry_run("train_multinode.sbatch", env, "model=qwen3_moe_30b_a3b", "train.resume=none")
    assert len(cmds) == 2
    for rank, cmd in enumerate(cmds):
        flags, overrides = parse(cmd)
        assert flags == {"--nnodes": "2", "--node_rank": str(rank), "--nproc_per_node": "8",
                         "--master_addr": "gpu-07", "--master_port": str(15000 + 4242 % 15000)}
        # The job's fixed run directory and auto-resume first; sbatch's arguments after them, so they win.
        assert overrides == [f"train.output_dir={REPO}/runs/4242", "train.resume=auto",
                             "model=qwen3_moe_30b_a3b", "train.resume=none"]


def test_dry_run_explicit_variables_override_the_allocation(fake_slurm_conf, tmp_path):
    # Submitted from elsewhere: REPO_DIR finds the repository, RUNS_ROOT places the run directories.
    env = fake_allocation(fake_slurm_conf, SLURM_SUBMIT_DIR=str(tmp_path), REPO_DIR=str(REPO), NPROC_PER_NODE="2",
                          MASTER_ADDR="gpu-08-ib", MASTER_PORT="31000", RUNS_ROOT="/scratch/runs")
    for rank, cmd in enumerate(dry_run("train_1node.sbatch", env)):
        flags, overrides = parse(cmd)
        assert (flags["--node_rank"], flags["--nproc_per_node"]) == (str(rank), "2")
        assert (flags["--master_addr"], flags["--master_port"]) == ("gpu-08-ib", "31000")
        assert overrides == ["train.output_dir=/scratch/runs/4242", "train.resume=auto"]


# ---------------------------------------------------------------- real one-node jobs on the local cluster


def slurm(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"
    return done.stdout


def cluster_up(env: dict[str, str]) -> bool:
    # Without its slurm.conf a client retries for 60 s; with it, `scontrol ping` answers at once.
    if not Path(env["SLURM_CONF"]).is_file():
        return False
    return subprocess.run(["scontrol", "ping"], env=env, capture_output=True, timeout=60).returncode == 0


@pytest.fixture(scope="module")
def cluster() -> dict[str, str]:
    """The environment for Slurm clients of the local cluster, which must be up already (local_cluster.sh start):
    starting it here could mean installing packages, and would run root daemons from inside a test run."""
    conf = Path(os.environ.get("SLURM_LOCAL_DIR", "/tmp/qmt-slurm")) / "slurm.conf"
    env = base_env(SLURM_CONF=str(conf))
    require("sbatch", "scontrol", "squeue", "sinfo", "scancel")
    if not cluster_up(env):
        unavailable(f"no local Slurm cluster answers at {conf}")
    return env


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slurm_jobs")


@pytest.fixture(scope="module")
def train_args(job_dir: Path) -> list[str]:
    """The tiny model on synthetic tokens (milliseconds a step), checkpointing every 2 steps (the newest 3 kept)."""
    data = write_tokens(job_dir / "tokens.npy", 50_000)
    return [*TINY_MODEL, "data=tokens", f"data.path={data}", "data.seq_len=32", f"data.cache_dir={job_dir / 'cache'}",
            "train.local_batch_size=4", "logging.tensorboard=false", f"train.steps={STEPS}",
            "checkpoint.interval=2"]


class Job:
    """A job submitted through train_1node.sbatch, as a user would from the repository root."""

    def __init__(self, env: dict[str, str], job_dir: Path, args: list[str], wait: bool = False) -> None:
        self.env = {**env, "RUNS_ROOT": str(job_dir / "runs")}
        cmd = ["sbatch", "--parsable", f"--output={job_dir}/%j.out", *(["--wait"] if wait else []),
               str(SLURM_DIR / "train_1node.sbatch"), *args]
        self.done = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True,
                                   timeout=JOB_TIMEOUT_S)
        self.id = self.done.stdout.strip().split(";")[0]
        assert self.id.isdigit(), f"sbatch: {self.done.stdout}{self.done.stderr}"
        self.log_path = job_dir / f"{self.id}.out"
        self.run_dir = job_dir / "runs" / self.id

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def info(self) -> dict[str, str]:
        """scontrol's fields of the job (slurmctld forgets a finished job after MinJobAge: 5 s here)."""
        line = slurm(self.env, "scontrol", "show", "job", "-o", self.id)
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not condition():
            state = self.info()["JobState"]
            # Ended without it (COMPLETED too: say, it finished before it could be interrupted). The condition is
            # asked again: the job may have reached it between the two reads (COMPLETING -> COMPLETED, when
            # completion is what is awaited).
            if (state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")
                    and not condition()):
                pytest.fail(f"job {self.id} {state} while waiting for {what}; log:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"job {self.id} ({state}): no {what} after {JOB_TIMEOUT_S} s; log:\n{self.log()[-4000:]}")
            time.sleep(0.1)

    def release_when_requeued(self, restarts: int) -> None:
        """Slurm holds a requeued job for about 2 minutes (Reason=BeginTime): let it start now. Not in the
        second it was requeued: slurmd refuses a credential issued in the second it revoked the previous one."""
        self.wait_for(lambda: self.info()["JobState"] == "PENDING" and self.info()["Restarts"] == str(restarts),
                      f"requeue number {restarts}")
        time.sleep(1.5)
        # An update schedules at once (a begin time in the future would wait for the next scheduling pass).
        slurm(self.env, "scontrol", "update", f"jobid={self.id}", "starttime=now")

    def cancel(self) -> None:
        subprocess.run(["scancel", self.id], env=self.env, timeout=60)


@pytest.fixture(scope="module")
def reference_job(cluster, job_dir, train_args) -> Iterator[Job]:
    """The uninterrupted run: `sbatch --wait` of the debug job, as a user would submit it."""
    job = Job(cluster, job_dir, train_args, wait=True)
    yield job
    job.cancel()


def test_one_node_job_trains_in_its_job_directory(reference_job):
    job = reference_job
    # sbatch --wait exits with the job's exit code.
    assert job.done.returncode == 0, f"job {job.id} failed; log:\n{job.log()[-4000:]}"
    metrics = job.metrics()
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    required = {"loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_per_device", "mfu", "peak_mem_gib"}
    assert required <= set(metrics[-1])
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert (job.run_dir / "config.yaml").is_file()
    port = 15000 + int(job.id) % 15000
    assert (f"torchrun --nnodes 1 --node_rank 0 --nproc_per_node 1 --master_addr {os.uname().nodename.split('.')[0]} "
            f"--master_port {port} train.py train.output_dir={job.run_dir} train.resume=auto") in job.log()


def resumed_steps(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"resumed from \S*step_0*(\d+)", log)]


def complete_checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*/train_state.json"))


def interrupt_once_and_finish(job: Job, how: str) -> None:
    """After the job's first checkpoint, interrupt it (``requeue``: `scontrol requeue`, as preemption does;
    ``time-limit``: the batch shell's --signal=B:USR1@120 warning, sent now), let it start again, and wait
    for it to complete."""
    try:
        job.wait_for(lambda: bool(complete_checkpoint_steps(job.run_dir)), "a first checkpoint")
        if how == "requeue":  # Slurm SIGTERMs every process of the job; the trainers save and exit
            slurm(job.env, "scontrol", "requeue", job.id)
        else:  # batch.sh SIGTERMs the job step, waits for the trainers to save, and requeues the job
            slurm(job.env, "scancel", "--batch", "--signal=USR1", job.id)
        job.release_when_requeued(restarts=1)
        job.wait_for(lambda: job.info()["JobState"] == "COMPLETED", "completion")
    finally:
        job.cancel()
    assert (job.info()["Restarts"], job.info()["ExitCode"]) == ("1", "0:0")


def test_requeued_job_resumes_from_its_checkpoint_onto_the_uninterrupted_curve(cluster, job_dir, train_args,
                                                                               reference_job):
    job = Job(cluster, job_dir, train_args)
    interrupt_once_and_finish(job, "requeue")
    log = job.log()
    [resumed] = resumed_steps(log)
    assert 2 <= resumed < STEPS and f"job {job.id} (start 2)" in log
    # The second start continues at the step after its checkpoint, so the metrics hold every step once...
    metrics = job.metrics()
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # ...and the model, optimizer, schedule, data position and RNG came back exactly: the losses are the
    # uninterrupted run's (same process count and thread count, so bitwise up to JSON's float printing).
    reference = reference_job.metrics()
    for key in ("loss", "grad_norm", "lr"):
        assert [m[key] for m in metrics] == pytest.approx([m[key] for m in reference], rel=1e-6), key


def test_two_rank_job_at_its_time_limit_checkpoints_requeues_itself_and_resumes(cluster, job_dir, train_args):
    # NPROC_PER_NODE at submission: 2 gloo ranks under one torchrun, experts split over them (parallel=ep2).
    # Both ranks get SIGTERM (from scancel and again from torchrun); they must stop at one step and save together.
    job = Job({**cluster, "NPROC_PER_NODE": "2"}, job_dir, [*train_args, "parallel=ep2"])
    interrupt_once_and_finish(job, "time-limit")
    log = job.log()
    assert "--nproc_per_node 2" in log and "time limit in ~120 s" in log and f"job {job.id} (start 2)" in log
    [resumed] = resumed_steps(log)
    assert 2 <= resumed < STEPS
    assert [m["step"] for m in job.metrics()] == list(range(1, STEPS + 1))
