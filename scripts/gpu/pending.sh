#!/usr/bin/env bash
# The GPU measurements still owed (issues 62 and 64), in priority order, resumable across device calls:
#
#   OUT=<dir> [BUDGET=<s>] bash scripts/gpu/pending.sh     # from the repository root, on one H100 or H200
#
# Each call runs the tasks not yet done on this machine, in order, and stops before a task that its BUDGET (seconds
# from the start, default 555) leaves no time for; the same command in the next call on the same (warm) machine
# goes on where it stopped. State and results in $STATE (default /tmp/pending-gpu: a fresh machine starts over);
# each call copies every result (logs, simulation.json and calibration.json files) under $OUT/res. Device starts
# were scarce when this was written: a session got one call, or none; put what resolves an issue first.
#
#   vlm          issue 64: scripts/bench_vlm.py (ours, the text model alone, transformers + FSDP2 on the same windows)
#   link_tests   issue 62: the emulation's stream semantics on the GPU (tests/test_link_emulation.py -k gpu)
#   calib_*      issue 62: the 2 x H200 rows at one fitted all-to-all rate, each beside main's paper prediction
#   j30-*, q35-* issue 62: the full-depth ep8 ranks (Qwen3-30B-A3B, Qwen3.5-35B-A3B) at the fitted rate, fused beside
#                each lever and main's prediction (sim.links=off), then fused at 130, 250 and 450 GB/s
#   check_*      the link timer against its reference; scripts/check_kernels.py's default on cold caches (issue 61)
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

collect() {  # every small result under $OUT/res
  (cd "$R" && find . -type f -size -3M \( -name '*.txt' -o -name '*.json' -o -name '*.md' \) | tar -cf - -T -) \
    | (mkdir -p "$OUT/res" && cd "$OUT/res" && tar -xf -)
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
rate() {  # the fitted all-to-all rate (130, main's, until calib_fit ran)
  python -c "import json; print(json.load(open('$R/calib_fit/calibration.json'))['rate'])" 2>/dev/null || echo 130
}
sim() { local name=$1 estimate=$2; shift 2; task "$name" "$estimate" python scripts/simulate.py "$@" "sim.out=$R/$name"; }
calib_row() {
  task "calib_row$1" 60 python scripts/calibrate_links.py --rate "$(rate)" --rows "$1" --baseline --out "$R/calib_row$1"
}
JOB30B=(model=qwen3_moe_30b_a3b parallel=ep8 sim.world=8 train.local_batch_size=4 parallel.activation_checkpoint=full
        data.seq_len=4096 sim.steps=5)
JOB35B=(model=qwen35_moe parallel=ep8 sim.world=8 train.local_batch_size=4 parallel.activation_checkpoint=full
        data.seq_len=4096 sim.steps=5)

task vlm 240 python scripts/bench_vlm.py --layers 4 --seq-len 2048 --local-batch 2 --images 2 --image-size 448 \
  --steps 12 kernel_config=auto_fla --out "$R/vlm.json"
task link_tests 60 python -m pytest -q -p no:cacheprovider tests/test_link_emulation.py -k gpu
task calib_fit 90 python scripts/calibrate_links.py --fit --rows 1 --baseline --out "$R/calib_fit"
sim j30-main-off 80 "${JOB30B[@]}" dispatcher=fused sim.links=off sim.advise=off
sim j30-fused-fit 80 "${JOB30B[@]}" dispatcher=fused "sim.a2a_gb_s=$(rate)" sim.advise=on
sim j30-dedup-fp8-fit 80 "${JOB30B[@]}" dispatcher=dedup dispatcher.fp8_dispatch=true "sim.a2a_gb_s=$(rate)" \
  sim.advise=off
calib_row 2
sim j30-domino-fit 80 "${JOB30B[@]}" dispatcher=domino "sim.a2a_gb_s=$(rate)" sim.advise=off
for row in 5 7 4 3 6; do calib_row $row; done
sim j30-dedup-fit 80 "${JOB30B[@]}" dispatcher=dedup "sim.a2a_gb_s=$(rate)" sim.advise=off
sim j30-fused-fp8-fit 80 "${JOB30B[@]}" dispatcher=fused dispatcher.fp8_dispatch=true "sim.a2a_gb_s=$(rate)" \
  sim.advise=off
sim j30-dedup-fp8-keep-fit 80 "${JOB30B[@]}" dispatcher=dedup dispatcher.fp8_dispatch=true \
  parallel.activation_checkpoint=full_keep_exchange "sim.a2a_gb_s=$(rate)" sim.advise=off
sim q35-main-off 90 "${JOB35B[@]}" dispatcher=fused sim.links=off sim.advise=off
sim q35-fused-fit 90 "${JOB35B[@]}" dispatcher=fused "sim.a2a_gb_s=$(rate)" sim.advise=on
sim q35-dedup-fp8-fit 90 "${JOB35B[@]}" dispatcher=dedup dispatcher.fp8_dispatch=true "sim.a2a_gb_s=$(rate)" \
  sim.advise=off
for r in 130 250 450; do sim "j30-fused-$r" 80 "${JOB30B[@]}" dispatcher=fused "sim.a2a_gb_s=$r" sim.advise=off; done
task check_link_timer 40 python scripts/check_kernels.py --ops link_timer
task check_kernels_cold 150 bash -c 'rm -rf /tmp/pending-ck-t /tmp/pending-ck-i; TRITON_CACHE_DIR=/tmp/pending-ck-t \
  TORCHINDUCTOR_CACHE_DIR=/tmp/pending-ck-i /usr/bin/time -f "check_kernels cold: %e s" python scripts/check_kernels.py'
echo "== every task done"
collect
