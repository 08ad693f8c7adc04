#!/usr/bin/env bash
# The batch step of train_1node.sbatch and train_multinode.sbatch (they exec it; not meant to be run by hand):
# fixes the run directory to the job id, starts launch.sh once per node with srun, and turns the time-limit
# warning (USR1, from --signal=B:USR1@120) into checkpoint + requeue.
#   RUNS_ROOT  where run directories go (default: <submit dir>/runs); the run is RUNS_ROOT/SLURM_JOB_ID
#   DRY_RUN=1  print every node's command (launch.sh) instead of running it
set -euo pipefail
: "${SLURM_JOB_ID:?not inside a Slurm job: submit with sbatch scripts/slurm/train_1node.sbatch}"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
run_dir=${RUNS_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}/runs}/$SLURM_JOB_ID
# A requeued job keeps its id, so every start of it trains in the same directory and train.resume=auto
# continues from its newest checkpoint. sbatch's arguments come last: Hydra keeps the last value of a key.
overrides=("train.output_dir=$run_dir" "train.resume=auto" "$@")

if [[ ${DRY_RUN:-0} == 1 ]]; then
  exec "$here/launch.sh" "${overrides[@]}"
fi

echo "job $SLURM_JOB_ID (start $((${SLURM_RESTART_COUNT:-0} + 1))) on $SLURM_JOB_NODELIST: run directory $run_dir"
requeue=0
# shellcheck disable=SC2317  # run by the trap below
on_time_limit() {
  echo "time limit in ~120 s: trainers checkpoint and stop, then job $SLURM_JOB_ID is requeued"
  requeue=1
  scancel --signal=TERM "$SLURM_JOB_ID"  # every job step, not this batch shell
}
trap on_time_limit USR1
# Preemption, scancel and scontrol requeue send SIGTERM to every process of the job, the trainers included,
# and SIGKILL KillWait seconds later: nothing to forward, only wait here while the trainers save.
trap 'echo "SIGTERM: waiting for the trainers to checkpoint"' TERM

# One task per node (launch.sh runs torchrun, which starts the workers); the task gets every CPU of the
# node, or a task/affinity or cgroup site would pin all workers to one core.
srun --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" --kill-on-bad-exit=1 \
  "$here/launch.sh" "${overrides[@]}" &
pid=$!
# A trapped signal cuts `wait` short: wait again until srun has really exited, then take its status.
while kill -0 "$pid" 2>/dev/null; do wait "$pid" || true; done
rc=0
wait "$pid" || rc=$?
if ((requeue)); then
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
