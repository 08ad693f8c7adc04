#!/usr/bin/env bash
# The GPU measurements still owed (issues 62 and 61), in priority order, resumable across device calls:
#
#   OUT=<dir> [BUDGET=<s>] bash scripts/gpu/pending.sh     # from the repository root, on one H100 or H200
#
# Each call runs the tasks not yet done on this machine, in order, and stops before a task that its BUDGET (seconds
# from the start, default 555) leaves no time for; the same command in the next call on the same (warm) machine
# goes on where it stopped. State and results in $STATE (default /tmp/pending-gpu: a fresh machine starts over);
# each call packs every small result (logs, simulation.json and calibration.json files) into $OUT/res.tgz. Device starts
# were scarce when this was written: a session got one call, or none; put what resolves an issue first.
#
#   link_tests   issue 62: the emulation's stream semantics on the GPU (tests/test_link_emulation.py -k gpu); 2 of 4
#                failed on the host's time of a first call (2026-12-07, second session): the fixture now warms every
#                timed path first
#   j30e16-*     issue 62: Qwen3-30B-A3B ep16 on 16 at the fitted rate (its target is bounded by its compute already)
#   check_*      scripts/check_kernels.py's default on cold caches (issue 61)
# Done on 2026-12-07 (one H100, docs/scaling.md and the lab log): the calibration (rate 160 GB/s), the 30B ep8 levers
# at the fitted rate and under learned routing, the 130/250/450 sensitivity, the link timer against its reference,
# the ring-SM retry, the Qwen3.5 and 235B targets, 16 GPUs without checkpointing, the levers' loss curves, and
# issue 64's VLM row (scripts/bench_vlm.py --seq-len 1024 with expandable_segments: 2,048 does not fit 80 GB).
# scripts/gpu/issue62.sh runs issue 62's parts as whole calls instead (and its 2-GPU agreement part). A machine
# without hydra, omegaconf and tiktoken takes the carried wheels first (docs/lab/benchmarks.md):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -u
: "${OUT:?set OUT to the directory for the results}"
cd "$(dirname "$0")/../.."
T0=$(date +%s)
DEADLINE=$((T0 + ${BUDGET:-555}))
S=${STATE:-/tmp/pending-gpu}
R=$S/res
mkdir -p "$S/done" "$R"
[ -f "$R/machine.txt" ] || { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1; } > "$R/machine.txt" 2>&1
cat "$R/machine.txt"

collect() {  # every small result as one file, $OUT/res.tgz (a call brings back 8 files at most)
  (cd "$S" && find res -type f -size -2M \( -name '*.txt' -o -name '*.json' -o -name '*.md' \) \
    | tar -czf "$OUT/res.tgz" -T -)
}
task() {  # task <name> <estimated seconds> <command...>: run unless done; stop the call where the budget is short
  local name=$1 estimate=$2 now took rc
  shift 2
  [ -f "$S/done/$name" ] && return 0
  now=$(date +%s)
  if [ $((DEADLINE - now)) -lt "$estimate" ]; then
    echo "== stopped before $name: $((DEADLINE - now)) s left, it needs about $estimate; call again to go on"
    collect
    exit 0
  fi
  echo "== +$((now - T0)) s $name: $*"
  rm -rf "${R:?}/$name"
  timeout $((DEADLINE - now)) "$@" > "$R/$name.txt" 2>&1
  rc=$?
  took=$(($(date +%s) - now))
  echo "   rc=$rc, ${took} s"
  echo "$name rc=$rc ${took}s" >> "$R/times.txt"
  [ $rc -ne 124 ] && touch "$S/done/$name"  # a task cut by the deadline runs again next call
  grep -E "^(predicted|peak memory|error|fit on|\| |order|mean abs)|passed|failed|tokens/s|Error" "$R/$name.txt" \
    | grep -v Warning | tail -14
}
sim() { local name=$1 estimate=$2; shift 2; task "$name" "$estimate" python scripts/simulate.py "$@" "sim.out=$R/$name"; }
RATE=${RATE:-160}  # the all-to-all rate fitted on 2026-12-07 (H100; docs/scaling.md#calibration-at-one-rate)
COMMON=(train.local_batch_size=4 parallel.activation_checkpoint=full data.seq_len=4096 sim.steps=5)
JOB30B16=(model=qwen3_moe_30b_a3b parallel=ep16 sim.world=16 "${COMMON[@]}")
DEDUP_FP8=(dispatcher=dedup dispatcher.fp8_dispatch=true)

task link_tests 60 python -m pytest -q -p no:cacheprovider tests/test_link_emulation.py -k gpu
# ep16 on 16 (its target is bounded by its measured compute already: docs/scaling.md)
sim j30e16-fused-fit 90 "${JOB30B16[@]}" dispatcher=fused "sim.a2a_gb_s=$RATE" sim.advise=off
sim j30e16-dedup-fp8-fit 90 "${JOB30B16[@]}" "${DEDUP_FP8[@]}" "sim.a2a_gb_s=$RATE" sim.advise=off
task check_kernels_cold 150 bash -c 'rm -rf /tmp/pending-ck-t /tmp/pending-ck-i; TRITON_CACHE_DIR=/tmp/pending-ck-t \
  TORCHINDUCTOR_CACHE_DIR=/tmp/pending-ck-i /usr/bin/time -f "check_kernels cold: %e s" python scripts/check_kernels.py'
echo "== every task done"
collect
