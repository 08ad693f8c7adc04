#!/usr/bin/env bash
# A Slurm cluster on this machine, for tests and CI (root; no systemd, no cgroups): two nodes, each its own slurmd
# on this host. Partition `local` (the default) is the first node, <hostname>; partition `two` is both nodes
# (<hostname>, <hostname>-2), for 2-node jobs (sbatch --partition=two --nodes=2). Both nodes declare all CPUs
# and memory of the machine, so they oversubscribe it; the second node's name does not resolve, but launch.sh's
# MASTER_ADDR is the first host of an allocation, always <hostname> here (it comes first in slurm.conf).
#   scripts/slurm/local_cluster.sh start    # install Slurm if missing (below), write slurm.conf, start munged +
#                                           # slurmctld + two slurmd, wait for idle
#   scripts/slurm/local_cluster.sh stop     # stop the daemons (state and logs stay for post-mortems)
#   scripts/slurm/local_cluster.sh status   # sinfo
# Everything lives in $SLURM_LOCAL_DIR (default /tmp/qmt-slurm): slurm.conf, its own munge key and socket,
# state, logs. Nothing under /etc is touched, so a system Slurm or munge is left alone; clients find this
# cluster through SLURM_CONF=$SLURM_LOCAL_DIR/slurm.conf (start prints the export line).
# Needs Debian's slurmctld, slurmd, slurm-client and munge packages: start installs them with apt-get when missing
# (.ci/run relies on this on a fresh machine). tests/test_slurm.py never runs this script: its Slurm tests skip
# until the cluster is up (and fail instead under QWEN_MOE_REQUIRE_SLURM=1, as .ci/run sets).
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/qmt-slurm}
CTLD_PORT=${SLURM_LOCAL_PORT:-6817}  # the two slurmd listen on the next two ports
CONF=$DIR/slurm.conf
NODE=$(hostname -s)
NODE2=$NODE-2
export SLURM_CONF=$CONF

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

missing_binaries() {
  for bin in munged slurmctld slurmd sinfo sbatch scontrol; do
    command -v "$bin" >/dev/null || [[ -x /usr/sbin/$bin ]] || echo "$bin"
  done
}

# Installs Debian's packages when they are missing (root only), so a fresh machine needs no extra step.
require_binaries() {
  [[ $(id -u) == 0 ]] || die "run as root (the daemons run as root: SlurmUser=root)"
  if [[ -n $(missing_binaries) ]] && command -v apt-get >/dev/null; then
    echo "local_cluster.sh: installing slurmctld slurmd slurm-client munge" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge; } >/dev/null
  fi
  local missing
  missing=$(missing_binaries | xargs)
  [[ -z $missing ]] || die "missing $missing: apt-get install -y slurmctld slurmd slurm-client munge"
}

write_conf() {
  local mem_mb
  # A little under the total: slurmd drains a node whose real memory is below RealMemory.
  mem_mb=$(free -m | awk '/^Mem:/ {print int($2 * 0.95)}')
  cat >"$CONF" <<CONF
# Written by scripts/slurm/local_cluster.sh: two nodes on this machine, no accounting, no cgroups.
ClusterName=local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge.socket
StateSaveLocation=$DIR/state
# Per node (%n): two slurmd on one host must not share a spool directory (job step sockets), pid file or log.
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
# Containers have no usable cgroups: track job processes through /proc, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# Seconds between SIGTERM and SIGKILL when a job is cancelled or requeued: time to write a checkpoint.
KillWait=60
# Finished jobs stay visible to scontrol for 5 s (there is no accounting); and sbatch --wait polls
# every 2 s instead of backing off to 32 s (it sleeps at most MinJobAge/2).
MinJobAge=5
# One address, a port each: slurmd -N <name> serves that line (Debian's Slurm 22.05 runs several per host so).
NodeName=$NODE NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 1)) CPUs=$(nproc) RealMemory=$mem_mb State=UNKNOWN
NodeName=$NODE2 NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 2)) CPUs=$(nproc) RealMemory=$mem_mb State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
PartitionName=two Nodes=$NODE,$NODE2 MaxTime=INFINITE State=UP
CONF
}

start_munge() {
  # A private key and socket: independent of /etc/munge and of any munged already running.
  [[ -f $DIR/munge.key ]] || dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none
  chmod 600 "$DIR/munge.key"
  munged --force --socket="$DIR/munge.socket" --key-file="$DIR/munge.key" --pid-file="$DIR/munged.pid" \
    --log-file="$DIR/munged.log" --seed-file="$DIR/munged.seed"
}

stop_daemon() {  # stop_daemon NAME PIDFILE: SIGTERM, then wait up to 10 s for it to go
  local pid
  [[ -f $2 ]] || return 0
  pid=$(cat "$2")
  # A pid file left by a killed daemon may name a recycled pid: signal it only if it is still that daemon.
  if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$1" ]] && kill "$pid" 2>/dev/null; then
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && { echo "$1 ($pid) ignored SIGTERM; killing" >&2; kill -9 "$pid" || true; }
  fi
  rm -f "$2"
}

wait_idle() {  # wait_idle NODE: until sinfo shows the node idle (up to 60 s)
  local state=""
  for _ in $(seq 120); do
    state=$(sinfo -h -N -n "$1" -o %T 2>/dev/null | head -n 1 || true)
    [[ $state == idle ]] && return 0
    # A node left down or drained by an earlier run: tell slurmctld it is back.
    if [[ $state == down* || $state == drain* ]]; then
      scontrol update nodename="$1" state=resume 2>/dev/null || true
    fi
    sleep 0.5
  done
  die "node $1 not idle after 60 s (state: '${state:-none}'); see $DIR/slurmctld.log and $DIR/slurmd-$1.log"
}

start() {
  require_binaries
  stop  # a clean slate: leftovers of an earlier start would hold the ports
  mkdir -p "$DIR/state" "$DIR/spool"
  chmod 700 "$DIR"
  write_conf
  start_munge
  # State in $DIR/state survives a restart, so job ids keep counting up: a new job never lands in the run
  # directory (runs/<job id>) of an old one.
  slurmctld -f "$CONF"
  slurmd -f "$CONF" -N "$NODE"
  slurmd -f "$CONF" -N "$NODE2"
  # Jobs left by an earlier cluster (killed mid-run, requeued on restart) would hold the node: cancel them.
  local stale
  mapfile -t stale < <(squeue -h -o %A 2>/dev/null || true)
  ((${#stale[@]} == 0)) || scancel "${stale[@]}"
  wait_idle "$NODE"
  wait_idle "$NODE2"
  echo "local Slurm cluster up (nodes $NODE, $NODE2); clients need: export SLURM_CONF=$CONF"
}

stop() {
  local pidfile
  # Every slurmd: one pid file per node (slurmd.pid: a cluster started by the one-node version of this script).
  for pidfile in "$DIR"/slurmd*.pid; do stop_daemon slurmd "$pidfile"; done
  stop_daemon slurmctld "$DIR/slurmctld.pid"
  stop_daemon munged "$DIR/munged.pid"
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) sinfo ;;
  *) die "usage: $0 start|stop|status" ;;
esac
