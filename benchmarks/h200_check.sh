#!/usr/bin/env bash
# One device call that checks and times the GPU code paths (H200, torch 2.11, Triton 3.6):
#
#   bash benchmarks/h200_check.sh [quick|kernels|train]      # logs under $OUT (default ./h200-logs)
#
# quick    compile + correctness of every Triton KDA kernel on the GPU: kda_gpu_probe.py (one process
#          per shape, so a fault cannot hide the cases after it), then tests/ops/test_kda_triton.py
#          (a fresh machine spends most of this compiling)                              <= 9 min
# kernels  kda_kernel.py at K3's per-layer shape with the structure experiments (--try), fla 0.6.0
#          side by side when its wheels are in .whl/ (fla's first call autotunes ~100 s) <= 9 min
# train    the parallel smoke test and the bf16 training check (Triton kernels vs torch) <= 5 min
# Each mode fits one device call (10 minutes at most).
#
# fla (fla_core, flash_linear_attention 0.6.0) and einops travel as wheels in .whl/ (gitignored; see
# benchmarks/NOTES-kda.md): carry ".whl" in the device call. Each step has its own time limit and
# writes its log even when it fails; the exit status is non-zero if any step failed.
set -u
MODE=${1:-kernels}
case $MODE in quick|kernels|train) ;; *) echo "usage: $0 [quick|kernels|train]" >&2; exit 2 ;; esac
OUT=${OUT:-./h200-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
FLA_ARGS=(--no-fla)
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH && FLA_ARGS=()
fi
FAILED=()

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "===== $name (limit ${limit}s): $*"
  if ! timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
    FAILED+=("$name")
  fi
  tail -n 25 "$OUT/$name.log"
}

if [ "$MODE" = quick ]; then
  step kda_gpu_probe 200 python3 benchmarks/kda_gpu_probe.py
  step kda_tests 330 python3 -m pytest -q -rf tests/ops/test_kda_triton.py
fi
if [ "$MODE" = train ]; then
  step parallel_smoke 60 torchrun --standalone --nproc_per_node 1 benchmarks/parallel_smoke.py
fi
if [ "$MODE" = kernels ]; then
  step kda_kernel 540 python3 benchmarks/kda_kernel.py --shapes 0 --variants acsw --sections env,ceilings,chunk \
    --try wy,bscan=8,wy+bscan=8,intra+wy+bscan=8,intra+wy+bscan=8+scan=32/4/2 ${FLA_ARGS[@]+"${FLA_ARGS[@]}"}
fi
if [ "$MODE" = train ]; then
  step kda_train_check 200 python3 benchmarks/kda_train_check.py --steps 30
fi
echo "===== failed steps: ${FAILED[*]:-none} (logs in $OUT)"
[ ${#FAILED[@]} -eq 0 ]
