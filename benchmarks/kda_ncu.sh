#!/usr/bin/env bash
# Nsight Compute on one forward+backward of our KDA kernels at K3's shape (benchmarks/kda_ncu.py), on the GPU
# machine (Firecracker runtime: ncu reads the counters there; clocks left alone, as device/METHOD.md asks):
#
#   bash benchmarks/kda_ncu.sh [KERNEL [kda_ncu.py args...]]   # KERNEL: ncu's --kernel-name (e.g. regex:_bwd_);
#                                                              # default: every kernel of the profiled step
#   bash benchmarks/kda_ncu.sh 'regex:.' --peer                # fla 0.6.0's kernels instead (carry .whl)
#
# Writes $OUT/ncu/report.ncu-rep and, per kernel, the sections as text (ncu.txt): speed of light, occupancy and
# launch, warp states (what the warps wait on), scheduler, memory and instruction statistics, and the source
# counters' summary (SOURCE=1 adds each kernel's SASS with its counters, with the Triton source lines where ncu
# can place them: sass_KERNEL.csv.gz). Carry .triton-cache.tgz so the warm-up step does not recompile (~1 minute).
set -u
FILTER=()
if [ $# -gt 0 ]; then FILTER=(--kernel-name "$1"); shift; fi
OUT=${OUT:-./h200-logs}
mkdir -p "$OUT/ncu"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then  # fla and its einops, for --peer (as h200_check.sh installs them)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton-cache.tgz ] && tar -C "$TRITON_CACHE_DIR" -xzf .triton-cache.tgz
ncu --clock-control none --profile-from-start off ${FILTER[@]+"${FILTER[@]}"} \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section InstructionStats --section SourceCounters \
  -f -o "$OUT/ncu/report" python3 benchmarks/kda_ncu.py "$@" > "$OUT/ncu/run.log" 2>&1
rc=$?
tail -n 5 "$OUT/ncu/run.log"
ncu --import "$OUT/ncu/report.ncu-rep" --page details --print-units base > "$OUT/ncu/ncu.txt" 2>&1
# SOURCE=1: per kernel, the SASS with its counters (stall samples, excessive sectors / wavefronts), gzipped CSV
if [ "${SOURCE:-0}" = 1 ]; then
  for name in $(grep -oE '^  [A-Za-z_][A-Za-z0-9_]*' "$OUT/ncu/ncu.txt" | sort -u); do
    csv="$OUT/ncu/sass_$name.csv"
    ncu --import "$OUT/ncu/report.ncu-rep" --page source --csv --print-source cuda,sass --kernel-name "$name" \
      > "$csv" 2>&1 || ncu --import "$OUT/ncu/report.ncu-rep" --page source --csv --print-source sass \
      --kernel-name "$name" > "$csv" 2>&1
    gzip -f "$csv"
  done
fi
echo "ncu exit $rc; $(grep -c 'Section: GPU Speed Of Light Throughput' "$OUT/ncu/ncu.txt") kernels in $OUT/ncu/ncu.txt"
exit $rc
