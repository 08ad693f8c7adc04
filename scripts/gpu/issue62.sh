#!/usr/bin/env bash
# Issue 62's measurements on one GPU (written for an H100 80GB, torch 2.11, triton 3.6), from the repository root:
#
#   OUT=<dir> bash scripts/gpu/issue62.sh [parts]      parts: checks calib sensitivity levers (default: all four);
#                                                     agreement (2 GPUs) only when named
#
# Two device calls of under 9 minutes each on one H100 (estimates; the first pays Triton's compiles):
#   OUT=$OUT bash scripts/gpu/issue62.sh checks calib sensitivity     # about 8 minutes
#   OUT=$OUT bash scripts/gpu/issue62.sh levers                       # about 5 minutes
# and, on 2 GPUs (nvidia-h100-x2), the levers' bf16 loss curves against fused's (about 4 minutes):
#   OUT=$OUT bash scripts/gpu/issue62.sh agreement
# Every part writes its log and simulation.json files under $OUT; summary.md gathers every prediction.
#
# checks       the link timer against its reference (scripts/check_kernels.py --ops link_timer) and the stream
#              semantics of the emulation (tests/test_link_emulation.py's GPU tests: a synchronous all-to-all holds
#              the caller's stream and not the host, an async one overlaps compute until waited, a functional one
#              waits at first use)
# calib        scripts/calibrate_links.py --fit --baseline: the 2 x H200 rows of docs/results.md simulated with the
#              links emulated at one all-to-all rate (fitted on the 8-layer fused row), each beside its measured
#              figure and beside today's main prediction (sim.links=off, 130 GB/s) on this card in this call
# sensitivity  Qwen3-30B-A3B ep8 on 8 GPUs (the README's setting: local batch 4, full checkpointing, fused), the
#              full-depth rank with the links emulated at 130, 250 and 450 GB/s and at the fitted rate, and
#              today's main prediction (sim.links=off) beside them
# levers       the same job at the fitted rate (130 if calib did not run) with each lever, fused beside them:
#              domino, dedup, the e4m3 dispatch (fused, dedup), dedup with full_keep_exchange
# agreement    2 GPUs, real torchrun jobs: 4 layers, ep2, chitchat, seq 2048, 100 steps, bf16: fused beside the e4m3
#              dispatch (fused, domino, dedup) and full checkpointing beside full_keep_exchange;
#              scripts/compare_runs.py gives each pair's Pearson r of the loss curves (the target: >= 0.999)
set -uo pipefail
: "${OUT:?set OUT to the directory for the results}"
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(checks calib sensitivity levers)
T0=$(date +%s)
log() { echo "== +$(( $(date +%s) - T0 ))s $*" | tee -a "$OUT/timeline.txt"; }

JOB30B=(model=qwen3_moe_30b_a3b parallel=ep8 sim.world=8 train.local_batch_size=4 parallel.activation_checkpoint=full
        data.seq_len=4096 sim.steps=5)
rate_file="$OUT/fitted_rate.txt"
fitted() { if [ -f "$rate_file" ]; then cat "$rate_file"; else echo 130; fi; }
sim() {  # sim <name> <args...>: one scripts/simulate.py run into $OUT/<name>
  local name=$1; shift
  log "simulate $name: $*"
  python scripts/simulate.py "$@" "sim.out=$OUT/$name" > "$OUT/$name.txt" 2>&1 || log "FAILED $name (see $name.txt)"
  grep -E "^(predicted|peak memory|error)" "$OUT/$name.txt"
}

{ nvidia-smi; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
  torch.cuda.get_device_name())"; git log --oneline -1 2>/dev/null; } > "$OUT/machine.txt" 2>&1

for part in "${PARTS[@]}"; do
  case $part in
    checks)
      log "checks"
      python scripts/check_kernels.py --ops link_timer > "$OUT/check_link_timer.txt" 2>&1 || log "FAILED check_kernels"
      python -m pytest -q -p no:cacheprovider tests/test_link_emulation.py -k gpu > "$OUT/gpu_tests.txt" 2>&1 \
        || log "FAILED gpu tests"
      tail -n 2 "$OUT/gpu_tests.txt" ;;
    calib)
      log "calibration"
      python scripts/calibrate_links.py --fit --baseline --out "$OUT/calib" > "$OUT/calibration.txt" 2>&1 \
        || log "FAILED calibration"
      python -c "import json; print(json.load(open('$OUT/calib/calibration.json'))['rate'])" > "$rate_file" \
        2>/dev/null || rm -f "$rate_file"
      sed -n '/^Simulated on/,$p' "$OUT/calibration.txt" ;;
    sensitivity)
      R=$(fitted)
      sim job30b-main-baseline "${JOB30B[@]}" dispatcher=fused sim.links=off sim.advise=off
      for rate in 130 250 450 "$R"; do
        [ -d "$OUT/job30b-fused-$rate" ] && continue
        sim "job30b-fused-$rate" "${JOB30B[@]}" dispatcher=fused "sim.a2a_gb_s=$rate" \
          "sim.advise=$([ "$rate" = 130 ] && echo on || echo off)"
      done ;;
    levers)
      R=$(fitted)
      [ -d "$OUT/job30b-fused-$R" ] || sim "job30b-fused-$R" "${JOB30B[@]}" dispatcher=fused "sim.a2a_gb_s=$R" sim.advise=off
      sim "job30b-domino-$R" "${JOB30B[@]}" dispatcher=domino "sim.a2a_gb_s=$R" sim.advise=off
      sim "job30b-dedup-$R" "${JOB30B[@]}" dispatcher=dedup "sim.a2a_gb_s=$R" sim.advise=off
      sim "job30b-fused-fp8-$R" "${JOB30B[@]}" dispatcher=fused dispatcher.fp8_dispatch=true "sim.a2a_gb_s=$R" \
        sim.advise=off
      sim "job30b-dedup-fp8-$R" "${JOB30B[@]}" dispatcher=dedup dispatcher.fp8_dispatch=true "sim.a2a_gb_s=$R" \
        sim.advise=off
      sim "job30b-dedup-fp8-keep-$R" "${JOB30B[@]}" dispatcher=dedup dispatcher.fp8_dispatch=true \
        parallel.activation_checkpoint=full_keep_exchange "sim.a2a_gb_s=$R" sim.advise=off ;;
    agreement)
      runs=()
      for spec in "fused:dispatcher=fused" "fused-fp8:dispatcher=fused dispatcher.fp8_dispatch=true" \
                  "domino-fp8:dispatcher=domino dispatcher.fp8_dispatch=true" \
                  "dedup-fp8:dispatcher=dedup dispatcher.fp8_dispatch=true" \
                  "fused-full:dispatcher=fused parallel.activation_checkpoint=full" \
                  "fused-keep:dispatcher=fused parallel.activation_checkpoint=full_keep_exchange"; do
        name=${spec%%:*}; log "agreement $name"
        # shellcheck disable=SC2086
        torchrun --standalone --nproc_per_node 2 train.py model=qwen3_moe_30b_a3b model.arch.num_hidden_layers=4 \
          parallel=ep2 ${spec#*:} train.steps=100 data.seq_len=2048 train.local_batch_size=4 optim.lr=3e-4 \
          optim.warmup_steps=10 train.save_final=false "train.output_dir=$OUT/agreement/$name" \
          > "$OUT/agreement-$name.txt" 2>&1 || log "FAILED agreement $name"
        runs+=("$OUT/agreement/$name")
      done
      python scripts/compare_runs.py "${runs[@]}" --out "$OUT/agreement/report" > "$OUT/agreement.txt" 2>&1
      cat "$OUT/agreement.txt" ;;
    *) echo "unknown part $part (checks, calib, sensitivity, levers, agreement)"; exit 2 ;;
  esac
done

python - "$OUT" > "$OUT/summary.md" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| run | links | a2a GB/s | predicted tokens/s/GPU | step s | all-to-all held ms/step | compute busy ms/step | "
      "peak GiB (planned) |\n|---|---|---|---|---|---|---|---|")
for path in sorted(out.glob("job30b-*/simulation.json")):
    r = json.loads(path.read_text())
    held = r.get("held_link_s", {}).get("all_to_all")
    name = path.parent.name
    rate = name.rsplit("-", 1)[-1] if r["links"] == "emulated" else "130 (paper)"
    print(f"| {name} | {r['links']} | {rate} | {r['predicted_tokens_per_s_per_gpu']:,.0f} | {r['step_s']:.3f} | "
          f"{held * 1e3 if held is not None else float('nan'):.0f} | {r['profile']['busy_ms']:.0f} | "
          f"{r['peak_gib']:.1f} ({r['planned_peak_gib']:.1f}) |")
PY
cat "$OUT/summary.md"
log "done"
