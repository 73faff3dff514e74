#!/usr/bin/env bash
# One device call that checks and times the GPU code paths (H200, torch 2.11, Triton 3.6):
#
#   bash benchmarks/h200_check.sh [quick|kernels|check|train|precision|final|decode]  # logs under $OUT
#
# quick    compile + correctness of every Triton KDA kernel on the GPU: kda_gpu_probe.py (one process
#          per shape, so a fault cannot hide the cases after it) and tests/ops/test_kda_triton.py
#          (a fresh machine spends most of this compiling)                              <= 9 min
# kernels  kda_kernel.py at K3's per-layer shape with the experiments (--try) and per-kernel profiles
#          (ours and fla's), fla 0.6.0 side by side when its wheels are in .whl/ (its first calls
#          autotune ~90 s each)                                                         <= 9 min
# check    (two GPUs) the bf16 training check (TRAIN_SEEDS seeds, 2 by default) and then the Triton test file on
#          GPU 1 while GPU 0 runs `kernels` at shape 0 only, with the host-overhead section: a kernel change checked
#          and timed in one call (one GPU: the test file and `kernels` in turn, shorter limits; LIMIT0 sets GPU 0's)  <= 9.5 min
# train    the parallel smoke test and the bf16 training check (Triton kernels vs torch; LIMIT_TRAIN, 300 s) <= 7 min
# precision (two GPUs) GPU 1: kda_precision.py (each bf16 variant and fla against the fp32 token loop, forward
#          and gradients), then the bf16 training check for the default and for variant $TRAIN_VARIANT
#          (TRAIN_SEEDS seeds each); GPU 0: `kernels` at shape 0. Deciding a precision variant in one call  <= 9.5 min
# final    (two GPUs) closing a session's defaults in one call. GPU 1: the Triton test file (then, with PRECISION_TRIES,
#          kda_precision.py --try PRECISION_TRIES: the tries' errors against fla's); GPU 0: shape 0 with TRIES_FINAL
#          (the previous defaults, timed in the same run), shape 1 (B4 T4096 H64) with TRIES1, then the bf16 training
#          check (TRAIN_SEEDS seeds; LIMIT_TRAIN, 300 s). One GPU: the test file and shape 0 in turn
#          (`train` and `kernels` do the rest). On a fresh machine fla autotunes ~90 s per shape and pass and
#          our kernels compile: a shape's step needs ~250-300 s, so the precision table is not part of this
#          mode (`precision` has it). LIMIT0 / LIMIT1 set the two shapes' limits (200 / 150 s; LIMIT1=0 skips
#          shape 1). check and final: DECODE=1 adds the decode section with its launch sweep on GPU 0 after
#          the kernels (LIMIT_DECODE, 120 s)                                                          <= 9.5 min
# decode   the decode section alone (ours and fla at B 1 / 64 / 256, eager and CUDA-graph times, the launch sweep),
#          then benchmarks/kda_serve_decode.py (the engine's decode step, kernel vs the torch path), on one GPU
#                                                                                              <= 2 min
# Each mode fits one device call (10 minutes at most). Autotune results persist between calls: Triton's cache
# (TRITON_CACHE_AUTOTUNING=1, so fla's autotune timings too) comes back as $OUT/triton-cache.tgz (only the autotune
# records, ~20 KB, when the whole cache is over 15 MiB, as it is after any timing step); copy it to
# .triton-cache.tgz in the repository root (gitignored) and carry it: fla's first call at a shape then takes ~6 s
# instead of ~90 s, and a shape's timing step about a minute.
# Step results are in $OUT/rc.txt (one "name status" line each). On a machine with two or more GPUs the steps of
# a mode run side by side, one GPU each (kernels: shape 1, B4 T4096 H64, on the second GPU too).
#
# fla (fla_core, flash_linear_attention 0.6.0), einops and pytest-xdist travel as wheels in .whl/ (gitignored; see
# benchmarks/NOTES-kda.md): carry ".whl" in the device call. Each step has its own time limit and
# writes its log even when it fails; the exit status is non-zero if any step failed.
set -u
MODE=${1:-kernels}
case $MODE in quick|kernels|check|train|precision|final|decode) ;; *) echo "usage: $0 [quick|kernels|check|train|precision|final|decode]" >&2; exit 2 ;; esac
OUT=${OUT:-./h200-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
FLA_ARGS=(--no-fla)
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH && FLA_ARGS=()
fi
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .triton-cache.tgz ]; then
  tar -C "$TRITON_CACHE_DIR" -xzf .triton-cache.tgz && echo "Triton cache restored from .triton-cache.tgz"
fi
FAILED=()
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
# the Triton test file compiles ~100 kernels: with pytest-xdist (a wheel in .whl/) 8 workers compile side by
# side (the whole file in ~4 minutes on a fresh machine instead of > 9)
XDIST=()
if python3 -c "import xdist" 2>/dev/null; then XDIST=(-n 8); fi
PIDS=()

step() {  # step GPU NAME SECONDS COMMAND...: GPU 1 runs in the background when there are two GPUs
  local gpu=$1 name=$2 limit=$3
  shift 3
  if [ "$gpu" -ge 1 ] && [ "$GPUS" -lt 2 ]; then gpu=0; fi
  echo "===== $name (GPU $gpu, limit ${limit}s): $*"
  if [ "$gpu" -ge 1 ]; then
    ( CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo $? > "/tmp/h200-$name.rc" ) &
    PIDS+=("$!:$name")
    return
  fi
  CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo $? > "/tmp/h200-$name.rc"
  report "$name"
}

report() {
  local rc
  rc=$(cat "/tmp/h200-$1.rc")
  echo "$1 $rc" >> "$OUT/rc.txt"
  [ "$rc" = 0 ] || FAILED+=("$1")
  tail -n 25 "$OUT/$1.log"
}

save_triton_cache() {  # $OUT/triton-cache.tgz: the whole cache if it fits a returned file, else the autotune records
  local tgz="$OUT/triton-cache.tgz"
  tar -C "$TRITON_CACHE_DIR" -czf "$tgz" .
  if [ "$(stat -c %s "$tgz")" -gt $((15 * 1024 * 1024)) ]; then
    (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0 | tar --null -T - -czf "$tgz")
  fi
  echo "Triton cache saved: $(du -sh "$TRITON_CACHE_DIR" | cut -f1) in $TRITON_CACHE_DIR, $(du -h "$tgz" | cut -f1) returned"
}

finish() {
  local entry
  for entry in "${PIDS[@]+"${PIDS[@]}"}"; do
    wait "${entry%%:*}"
    echo "===== $(printf %s "${entry#*:}") (background) finished"
    report "${entry#*:}"
  done
  save_triton_cache
  echo "===== failed steps: ${FAILED[*]:-none} (logs in $OUT; $GPUS GPU(s))"
  [ ${#FAILED[@]} -eq 0 ]
}

VARIANT=${VARIANT:-h}  # the forward precision variant timed as ours_fwd[VARIANT] (the default: 'h')
# shape 0 (with per-kernel profiles); shape 1 only TRIES1; final: TRIES_FINAL at shape 0
# (each may be given in the environment)
TRIES=${TRIES:-wys=3,wys=3+wyv,wys=2}
TRIES1=${TRIES1:-nofpb+wyunroll}
TRIES_FINAL=${TRIES_FINAL:-nofpb+wyunroll}
PRECISION_VARIANTS=${PRECISION_VARIANTS:-h,ach,}  # kda_precision.py's variants ('' = all bf16)
TRAIN_VARIANT=${TRAIN_VARIANT:-ach}               # precision: the variant trained next to the default
kernel() {  # kernel GPU NAME LIMIT SHAPE SECTIONS TRIES: kda_kernel.py at one shape (fla side by side)
  step "$1" "$2" "$3" python3 benchmarks/kda_kernel.py --shapes "$4" --variants "$VARIANT" --sections "$5" \
    --no-hybrid --try "$6" --out "$OUT/shape$4" ${FLA_ARGS[@]+"${FLA_ARGS[@]}"}
}
decode_step() {  # DECODE=1: the decode section (ours, fla, the launch sweep) on GPU 0 after the kernels
  if [ "${DECODE:-0}" = 1 ] || [ "$MODE" = decode ]; then
    step 0 kda_decode "${LIMIT_DECODE:-120}" python3 benchmarks/kda_kernel.py --sections decode --decode-sweep \
      --out "$OUT/decode" ${FLA_ARGS[@]+"${FLA_ARGS[@]}"}
  fi
}
TESTS="python3 -m pytest -v -rf ${XDIST[*]} tests/ops/test_kda_triton.py tests/ops/test_kda_gluon.py"
# TRAIN_SEEDS: seeds 0 .. N-1; TRAIN_NOISE=1: the torch path trains twice per seed and the verdict allows twice its own
# run-to-run distance (kda_train_check.py --noise); TRAIN_ARGS: more of its options (e.g. --kda-head-dim 128 --try ...)
TRAIN="python3 benchmarks/kda_train_check.py --steps 30 --seeds ${TRAIN_SEEDS:-2}${TRAIN_NOISE:+ --noise}${TRAIN_ARGS:+ $TRAIN_ARGS}"
case $MODE in
  quick)  # one GPU: both in one call's 10 minutes, so shorter limits
    if [ "$GPUS" -ge 2 ]; then LIMITS=(540 300); else LIMITS=(330 200); fi
    step 1 kda_tests "${LIMITS[0]}" $TESTS
    step 0 kda_gpu_probe "${LIMITS[1]}" python3 benchmarks/kda_gpu_probe.py ;;
  kernels)
    if [ "$GPUS" -ge 2 ]; then
      kernel 1 kda_kernel_shape1 540 1 chunk "$TRIES1"
    fi
    kernel 0 kda_kernel "${LIMIT0:-540}" 0 env,ceilings,chunk,profile "$TRIES" ;;
  check)  # two GPUs: the bf16 training check (TRAIN_SEEDS seeds) and then the test file
    if [ "$GPUS" -ge 2 ]; then
      step 1 kda_train_tests 560 bash -c "$TRAIN; rc=\$?; $TESTS && exit \$rc"
      LIMITS=(540 540)
    else
      LIMITS=(300 280)
      step 1 kda_tests "${LIMITS[0]}" $TESTS
    fi
    kernel 0 kda_kernel "${LIMIT0:-${LIMITS[1]}}" 0 env,ceilings,chunk,host,profile "$TRIES"
    decode_step ;;
  train)
    step 1 kda_train_check "${LIMIT_TRAIN:-300}" $TRAIN
    step 0 parallel_smoke 120 torchrun --standalone --nproc_per_node 1 benchmarks/parallel_smoke.py ;;
  precision)
    step 1 kda_precision_train 560 bash -c "python3 benchmarks/kda_precision.py --variants '$PRECISION_VARIANTS' \
      --out '$OUT' && $TRAIN && KIMIK3_KDA_VARIANT='$TRAIN_VARIANT' $TRAIN"
    kernel 0 kda_kernel 540 0 chunk,profile "$TRIES" ;;
  decode)
    decode_step
    # the serving engine's KDA decode step: the pooled kernel path against the torch path it replaced, the state
    # update alone and K3's whole KDA layer (~30 s)
    step 0 kda_serve_decode "${LIMIT_SERVE_DECODE:-120}" python3 benchmarks/kda_serve_decode.py --out "$OUT/decode" ;;
  final)
    if [ "$GPUS" -ge 2 ]; then
      if [ -n "${PRECISION_TRIES:-}" ]; then  # the tries' precision against fla's after the tests, on GPU 1
        step 1 kda_tests_precision 560 bash -c "$TESTS; rc=\$?; python3 benchmarks/kda_precision.py --variants \
          '$VARIANT' --try '$PRECISION_TRIES' --out '$OUT' && exit \$rc"
      else
        step 1 kda_tests 560 $TESTS
      fi
      kernel 0 kda_kernel "${LIMIT0:-200}" 0 chunk,profile "$TRIES_FINAL"
      if [ "${LIMIT1:-150}" -gt 0 ]; then kernel 0 kda_kernel_shape1 "${LIMIT1:-150}" 1 chunk "$TRIES1"; fi
      step 0 kda_train_check "${LIMIT_TRAIN:-300}" $TRAIN
      decode_step
    else  # one GPU: the test file first, no training check and no shape 1 (`train` / `kernels` do those)
      step 0 kda_tests 240 $TESTS
      kernel 0 kda_kernel 320 0 chunk,profile "$TRIES_FINAL"
    fi ;;
esac
finish
