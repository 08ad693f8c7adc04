#!/usr/bin/env bash
# Per-node launcher: runs (or, with DRY_RUN=1, prints) this node's
#   torchrun --nnodes N --node_rank R --nproc_per_node P --master_addr A --master_port M train.py OVERRIDES...
# Under Slurm, srun starts it once per node (train_*.sbatch) and the variables come from the allocation.
# Without Slurm, run it on every node with the same NNODES/MASTER_ADDR/MASTER_PORT and NODE_RANK=0..NNODES-1.
#
#   NNODES          SLURM_NNODES inside an allocation, else NNODES, else 1
#   NODE_RANK       SLURM_NODEID (else SLURM_PROCID) inside an allocation, else NODE_RANK, else 0
#   NPROC_PER_NODE  NPROC_PER_NODE, else SLURM_GPUS_ON_NODE, else 1 (a CPU node: one gloo process)
#   MASTER_ADDR     MASTER_ADDR, else the first host of SLURM_JOB_NODELIST, else 127.0.0.1
#   MASTER_PORT     MASTER_PORT, else 15000 + SLURM_JOB_ID % 15000 (below the ephemeral range; jobs
#                   sharing a node differ), else 29500
#   DRY_RUN=1       print the command of every node (node_rank 0..NNODES-1), one line each; run nothing
#   TORCHRUN        the launcher command (default: torchrun)
# One process is also started through torchrun: one code path (RANK/WORLD_SIZE/LOCAL_RANK set the same way,
# the same signal forwarding) whatever the size.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."  # the repository root: train.py and conf/

die() { echo "launch.sh: $*" >&2; exit 1; }

# Inside an allocation the layout is Slurm's: a NODE_RANK exported at submission would be the same on every node.
if [[ -n ${SLURM_JOB_ID:-} ]]; then
  NNODES=${SLURM_NNODES:?SLURM_NNODES unset inside job $SLURM_JOB_ID}
  NODE_RANK=${SLURM_NODEID:-${SLURM_PROCID:-0}}
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
if [[ -z ${MASTER_ADDR:-} && -n ${SLURM_JOB_NODELIST:-} ]]; then
  command -v scontrol >/dev/null || die "scontrol not found: set MASTER_ADDR to the first node's address"
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
if [[ -z ${MASTER_PORT:-} && -n ${SLURM_JOB_ID:-} ]]; then
  MASTER_PORT=$((15000 + SLURM_JOB_ID % 15000))
fi
MASTER_PORT=${MASTER_PORT:-29500}
((NODE_RANK < NNODES)) || die "NODE_RANK=$NODE_RANK must be below NNODES=$NNODES"
# torchrun gives workers this long to write their checkpoint after SIGTERM before it kills them (default 30 s).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}

read -ra launcher <<<"${TORCHRUN:-torchrun}"  # may be several words: TORCHRUN="python -m torch.distributed.run"

node_cmd() {  # node_cmd RANK OVERRIDES...: the command array of node RANK, in $cmd
  local rank=$1
  shift
  cmd=("${launcher[@]}" --nnodes "$NNODES" --node_rank "$rank" --nproc_per_node "$NPROC_PER_NODE"
       --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" train.py "$@")
}

if [[ ${DRY_RUN:-0} == 1 ]]; then
  for ((rank = 0; rank < NNODES; rank++)); do
    node_cmd "$rank" "$@"
    printf '%q ' "${cmd[@]}" | sed 's/ $//'
    echo
  done
  exit 0
fi
node_cmd "$NODE_RANK" "$@"
echo "node $NODE_RANK/$NNODES on $(hostname -s): ${cmd[*]}" >&2
exec "${cmd[@]}"
