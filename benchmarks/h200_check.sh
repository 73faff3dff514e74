#!/usr/bin/env bash
# One device call that checks and times on the GPU (H200, torch 2.11, Triton 3.6) one part or several: the KDA
# kernels, the serving engine, the vision encoder, the torchtitan parity, training, MXFP4 experts, speculative
# decoding, post-training, MoonEP, torch.compile; logs under $OUT:
#
#   bash benchmarks/h200_check.sh [MODE ...]   (one of quick|kernels|check|train|precision|decode|serve|http|
#                                              vision|parity|quant|trainstep|trainrun|spec|specdebug|
#                                              specprofile|posttrain|moonep|compile|glue;
#                                              several run one after the other in the same call)
#
# quick      the GPU tests of the kernels (tests/ops/test_kda_triton.py, test_kda_gluon.py) and kda_gpu_probe.py
#            (one process per shape, so a fault cannot hide the cases after it)                        <= 9 min
# kernels    kda_kernel.py, ours against fla 0.6.0: shape 0 (K3's layer, B1 T8192 H96 D128) with the ceilings and
#            per-kernel profiles; with two GPUs shape 1 (B4 T4096 H64) on the second                   <= 9 min
# check      a kernel change checked and timed in one call: the tests and the bf16 training check (kda_train_check.py)
#            on GPU 1, kda_kernel.py at shape 0 with the host-overhead section on GPU 0 (one GPU: the tests and
#            the kernels in turn, no training check); DECODE=1 adds the decode section after the kernels  <= 9.5 min
# train      the bf16 training check (Triton kernels against the torch path) and the parallel smoke test <= 7 min
# precision  kda_precision.py: ours and fla against the fp32 token loop, forward and gradients
#            (PRECISION_ARGS: more of its options, e.g. --shape 1,2048,96,128)                          <= 5 min
# decode     kda_kernel.py's decode section (ours and fla at B 1 / 64 / 256, eager and CUDA-graph times), then
#            kda_serve_decode.py (the engine's decode step, the kernel against the torch path)          <= 2 min
# serve      the engine's GPU tests (KDA decode and verify kernels, model runner, prefill graphs, speculative
#            decoding), serve_gpu.py at batch 1 and 64, and greedy identity of speculative decoding in fp32 on the
#            run SPEC_RUN (default runs/spec-gpu: a run with a draft; carry it)                       <= 9.5 min
# http       make_serve_run.py (debug preset, random weights) then serve_http.py: the openai client against the
#            server with CUDA graphs and with --enforce-eager (carry .whl: the serve wheels)          <= 9.5 min
# vision     vision_encoder.py: the full MoonViT-V2 tower at 1024² and 3584² and mixed sizes, packed against one
#            image per forward                                                                        <= 4 min
# parity     parity_torchtitan.py, both directions, fp32 and bf16 (carry .whl and third_party/torchtitan;
#            benchmarks/setup_torchtitan.sh)                                                          <= 9.5 min
# quant      the MXFP4 GPU tests (the expert matmul's routes, packed experts, QAT ops), then
#            mxfp4_experts.py: every route against bf16 at K3's expert shapes, 112 local experts, 1 to 2,048 rows,
#            and the layer again with the rows spread over the experts at random                     <= 9.5 min
# trainstep  train_gpu.py: the debug preset's whole training step (CUDA graph) with torchtitan's port timed in
#            the same run (carry .whl and third_party/torchtitan)                                      <= 9.5 min
# trainrun   the Trainer's graphed step and compiled blocks on the GPU (tests/train/test_graphed_step.py,
#            test_captured_step.py, test_compiled_blocks.py), then kimik3 train on the debug preset, 4 x 4,096 tokens
#            a step, 20 steps: CUDA graph + compiled blocks (the default), the graph alone, neither; then
#            train_gpu.py (the issue's step: MFU, peak memory) with and without compiled blocks        <= 10 min
# spec       a target trained on the GPU for speculative decoding (kimik3 train, tiny preset, 240 s, eager step),
#            its draft (kimik3 train-draft, 1,000 steps), then serve_speculative.py at batch 1 and 16, K = 2..5 <= 9.5 min
# specdebug  the same on the debug preset: kimik3 train (SPEC_TRAIN s, 300 by default; CUDA graph, blocks eager) on
#            SPEC_DATA (default: the device's torch package, a corpus the run cannot memorise), a draft of
#            SPEC_DRAFT_STEPS steps (300) with its own head over SPEC_DRAFT_VOCAB ids (32,768; 0: the whole
#            vocabulary), serve_speculative.py at batch 1 and 16, K = 1..4, 16 requests, then greedy identity in fp32
#            (batch 1 and 16, K = 2 and 4); SPEC_PROFILE=1 adds the batch-1 kernel profile (K = 2, 3, 4)  <= 10 min
# specprofile where a speculative step's time goes on the debug preset, without training: random weights
#            (make_serve_run.py), a draft grown in one step, serve_speculative.py --profile at batch 1, K = 1, 3
#            (the step costs do not depend on the weights; the acceptance is meaningless; SPEC_DRAFT_VOCAB as
#            in specdebug)                                                                            <= 5 min
# posttrain  the rollout engine's GPU test (bf16 weights synced from the fp32 policy), then partial_rollouts.py on
#            the GPU (lambda 1 against 0.7, the rollout engine's tokens/s in its records) on the run POST_RUN
#            (default runs/tiny-base3-sft30; carry it, its model files without the checkpoints)          <= 9 min
# moonep     the MoonEP layer's no-sync check at world size 1 (tests/parallel/test_moonep_sync.py) and moonep.py's
#            plan() latency (--latency)                                                                <= 4 min
# compile    compile_probe.py: torch.compile's graph breaks in each kind of block of the debug preset, and its forward
#            + backward with every block compiled against eager                                       <= 5 min
# glue       the GPU tests of the training path's other kernels (the glue kernels, the router's top-k, their custom
#            operators under opcheck and torch.compile, the MoE kernels) and of the captured training steps <= 4 min
#
# Options (environment): LIMIT0 (GPU 0's kernel step, s), LIMIT_TRAIN, LIMIT_DECODE, LIMIT_SERVE_DECODE; TRAIN_SEEDS
# (seeds 0 .. N-1, 2 by default), TRAIN_NOISE=1 (kda_train_check.py --noise), TRAIN_ARGS (more of its options, e.g.
# --kda-head-dim 128).
#
# Carry ".whl" (fla_core and flash_linear_attention 0.6.0, einops, pytest-xdist: wheels, gitignored; see
# benchmarks/NOTES-kda.md) and, when there is one, ".triton-cache.tgz". Triton's cache, with fla's autotune records
# (TRITON_CACHE_AUTOTUNING=1), comes back as $OUT/triton-cache.tgz (only the autotune records when the whole cache is
# over 15 MiB); copied to .triton-cache.tgz in the repository root and carried, it saves fla's autotuning (~90 s per
# shape and pass) in the next call. Each step has its own time limit and writes its log even when it fails; its
# status is a line of $OUT/rc.txt, and the exit status is non-zero if any step failed. With two or more GPUs the
# steps of a mode run side by side, one GPU each.
set -u
MODES="quick|kernels|check|train|precision|decode|serve|http|vision|parity|quant|trainstep|trainrun|spec|specdebug|specprofile|posttrain|moonep|compile|glue"
if [ $# -eq 0 ]; then set -- kernels; fi
for MODE in "$@"; do
  case "|$MODES|" in *"|$MODE|"*) ;; *) echo "usage: $0 [MODE ...], MODE one of $MODES" >&2; exit 2 ;; esac
done
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
# the GPU test files compile ~100 kernels: with pytest-xdist (a wheel in .whl/) 8 workers compile side by side
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

kernel() {  # kernel GPU NAME LIMIT SHAPE SECTIONS: kda_kernel.py at one shape (fla side by side)
  step "$1" "$2" "$3" python3 benchmarks/kda_kernel.py --shapes "$4" --sections "$5" --out "$OUT/shape$4" \
    ${FLA_ARGS[@]+"${FLA_ARGS[@]}"}
}
decode_step() {  # the decode section (ours and fla) on GPU 0
  step 0 kda_decode "${LIMIT_DECODE:-120}" python3 benchmarks/kda_kernel.py --sections decode --out "$OUT/decode" \
    ${FLA_ARGS[@]+"${FLA_ARGS[@]}"}
}
TESTS="python3 -m pytest -v -rf ${XDIST[*]} tests/ops/test_kda_triton.py tests/ops/test_kda_gluon.py"
TRAIN="python3 benchmarks/kda_train_check.py --steps 30 --seeds ${TRAIN_SEEDS:-2}${TRAIN_NOISE:+ --noise}${TRAIN_ARGS:+ $TRAIN_ARGS}"
for MODE in "$@"; do   # several modes: one after the other, in one call (mind the call's 10 minutes)
case $MODE in
  quick)  # one GPU: both in one call's 10 minutes, so shorter limits
    if [ "$GPUS" -ge 2 ]; then LIMITS=(540 300); else LIMITS=(330 200); fi
    step 1 kda_tests "${LIMITS[0]}" $TESTS
    step 0 kda_gpu_probe "${LIMITS[1]}" python3 benchmarks/kda_gpu_probe.py ;;
  kernels)
    if [ "$GPUS" -ge 2 ]; then kernel 1 kda_kernel_shape1 540 1 chunk; fi
    kernel 0 kda_kernel "${LIMIT0:-540}" 0 env,ceilings,chunk,profile ;;
  check)
    if [ "$GPUS" -ge 2 ]; then
      step 1 kda_train_tests 560 bash -c "$TRAIN; rc=\$?; $TESTS && exit \$rc"
      LIMIT=540
    else
      step 0 kda_tests 300 $TESTS
      LIMIT=280
    fi
    kernel 0 kda_kernel "${LIMIT0:-$LIMIT}" 0 env,ceilings,chunk,host,profile
    if [ "${DECODE:-0}" = 1 ]; then decode_step; fi ;;
  train)
    step 1 kda_train_check "${LIMIT_TRAIN:-300}" $TRAIN
    step 0 parallel_smoke 120 torchrun --standalone --nproc_per_node 1 benchmarks/parallel_smoke.py ;;
  precision)
    step 0 kda_precision 300 python3 benchmarks/kda_precision.py --out "$OUT" ${PRECISION_ARGS:-} \
      ${FLA_ARGS[@]+"${FLA_ARGS[@]}"} ;;
  decode)
    decode_step
    step 0 kda_serve_decode "${LIMIT_SERVE_DECODE:-120}" python3 benchmarks/kda_serve_decode.py --out "$OUT/decode" ;;
  serve)
    step 0 serve_kernel_tests 150 python3 -m pytest -v -rf ${XDIST[*]} tests/ops/test_kda_triton.py -k "decode or verify"
    step 0 serve_tests 200 python3 -m pytest -v -rf ${XDIST[*]} tests/serve/test_model_runner.py \
      tests/serve/test_prefill_graphs.py tests/serve/test_spec_verify.py tests/serve/test_speculative.py
    step 0 serve_gpu 120 python3 benchmarks/serve_gpu.py --batches 1,64 --steps 30 --json "$OUT/serve_gpu.json"
    step 0 serve_speculative 100 python3 benchmarks/serve_speculative.py --run "${SPEC_RUN:-runs/spec-gpu}" \
      --device cuda --batches 1,16 --tokens 3 --dtype float32 --enforce-eager --max-tokens 96 ;;
  http)
    step 0 make_serve_run 120 python3 benchmarks/make_serve_run.py --out /tmp/debug-random
    step 0 serve_http 450 python3 benchmarks/serve_http.py --run /tmp/debug-random --json "$OUT/serve_http.json" ;;
  vision)
    step 0 vision_encoder 240 python3 benchmarks/vision_encoder.py --mixed --json "$OUT/vision_encoder.json" ;;
  parity)
    step 0 parity_torchtitan 560 python3 benchmarks/parity_torchtitan.py --fp32-experts --force-routing \
      --port-init device --compile eager --time-budget 540 --json "$OUT/parity_torchtitan.json" ;;
  quant)
    step 0 quant_tests 200 python3 -m pytest -v -rf ${XDIST[*]} tests/ops/test_mxfp4_grouped_mm.py tests/ops/test_mxfp4_wgmma.py \
      tests/ops/test_mxfp4_mma.py tests/ops/test_mxfp8_rows.py tests/quant \
      tests/serve/test_packed_experts.py
    step 0 mxfp4_experts 280 python3 benchmarks/mxfp4_experts.py --tokens 1,4,8,16,32,64,128,256,512,2048 --layer \
      --out "$OUT"
    step 0 mxfp4_layer_random 100 python3 benchmarks/mxfp4_experts.py --tokens 8,32,64 --shapes down --layer \
      --routing random --out "$OUT/random" ;;
  trainstep)
    step 0 train_gpu 560 python3 benchmarks/train_gpu.py --peer torchtitan --json "$OUT/train_gpu.json" ;;
  trainrun)
    step 0 train_graph_tests 270 python3 -m pytest -v -rf tests/train/test_graphed_step.py tests/train/test_captured_step.py \
      tests/train/test_compiled_blocks.py
    for STEP_KIND in cuda-graph:compile cuda-graph:no-compile no-cuda-graph:no-compile; do
      GRAPH=${STEP_KIND%:*} BLOCKS=${STEP_KIND#*:}
      step 0 "kimik3_train_${GRAPH}_$BLOCKS" 150 python3 -m kimik3 train --preset debug --device cuda --steps 20 \
        --seq-len 4096 --batch-size 4 --checkpoint-every 1000 --no-progress --"$GRAPH" --"$BLOCKS" \
        --out "/tmp/train-debug-$GRAPH-$BLOCKS"
    done
    for BLOCKS in compile no-compile; do
      step 0 "train_gpu_$BLOCKS" 120 python3 benchmarks/train_gpu.py --"$BLOCKS" --json "$OUT/train_gpu_$BLOCKS.json"
    done ;;
  spec)
    step 0 spec_train 300 python3 -m kimik3 train --device cuda --time-budget 240 --seq-len 512 --batch-size 32 \
      --no-cuda-graph --no-progress --out /tmp/spec-h200
    step 0 spec_draft 120 python3 -m kimik3 train-draft --run /tmp/spec-h200 --device cuda --steps 1000 --batch 32 \
      --no-progress
    step 0 serve_speculative 150 python3 benchmarks/serve_speculative.py --run /tmp/spec-h200 --batches 1,16 \
      --tokens 2,3,4,5 --requests 8 --json "$OUT/serve_speculative.json" ;;
  specdebug)
    SPEC_DATA=${SPEC_DATA:-$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")}
    step 0 specdebug_train $((${SPEC_TRAIN:-300} + 40)) python3 -m kimik3 train --preset debug --device cuda \
      --time-budget "${SPEC_TRAIN:-300}" --seq-len 512 --batch-size 32 --no-compile --no-progress \
      --data "$SPEC_DATA" --out /tmp/specdebug
    step 0 specdebug_draft $((${SPEC_DRAFT_STEPS:-300} / 6 + 100)) python3 -m kimik3 train-draft --run /tmp/specdebug \
      --device cuda --steps "${SPEC_DRAFT_STEPS:-300}" --batch 16 --draft-vocab "${SPEC_DRAFT_VOCAB:-32768}" \
      --no-progress
    step 0 specdebug_serve 150 python3 benchmarks/serve_speculative.py --run /tmp/specdebug --batches 1,16 \
      --tokens 1,2,3,4 --requests 16 --memory-mb 2048 --json "$OUT/specdebug_serve.json"
    step 0 specdebug_fp32 150 python3 benchmarks/serve_speculative.py --run /tmp/specdebug --batches 1,16 \
      --tokens 2,4 --requests 16 --max-tokens 48 --dtype float32 --memory-mb 4096 --json "$OUT/specdebug_fp32.json"
    if [ "${SPEC_PROFILE:-0}" = 1 ]; then
      step 0 specdebug_profile 120 python3 benchmarks/serve_speculative.py --run /tmp/specdebug --batches 1 \
        --tokens 2,3,4 --requests 8 --memory-mb 2048 --profile --json "$OUT/specdebug_profile.json"
    fi ;;
  specprofile)
    step 0 specprofile_run 120 python3 benchmarks/make_serve_run.py --out /tmp/specprofile
    step 0 specprofile_draft 120 python3 -m kimik3 train-draft --run /tmp/specprofile --device cuda --steps 1 \
      --held-out 2 --draft-vocab "${SPEC_DRAFT_VOCAB:-32768}" --no-progress
    step 0 specprofile_serve 240 python3 benchmarks/serve_speculative.py --run /tmp/specprofile --batches 1 \
      --tokens 1,3 --requests 1 --max-tokens 64 --memory-mb 2048 --profile --json "$OUT/specprofile.json" ;;
  posttrain)
    step 0 rollout_cuda_test 60 python3 -m pytest -v -rf tests/posttrain/test_rl.py -k cuda
    step 0 partial_rollouts 480 python3 benchmarks/partial_rollouts.py --run "${POST_RUN:-runs/tiny-base3-sft30}" \
      --device cuda --iterations 16 --prompts 8 --group 4 --alpha 0.6 --cap 1024 --out "$OUT/partial_rollouts.json" ;;
  moonep)
    step 0 moonep_sync 120 python3 -m pytest -v -rf tests/parallel/test_moonep_sync.py -k cuda
    step 0 moonep_latency 120 python3 benchmarks/moonep.py --latency --json "$OUT/moonep_latency.json" ;;
  compile)
    step 0 compile_probe 300 python3 benchmarks/compile_probe.py --json "$OUT/compile_probe.json" ;;
  glue)
    step 0 glue_tests 240 python3 -m pytest -v -rf ${XDIST[*]} tests/ops/test_custom_ops.py tests/ops/test_glue_*.py \
      tests/ops/test_moe_route.py tests/ops/test_moe_small_batch.py tests/ops/test_moe_permute.py \
      tests/train/test_captured_step.py tests/train/test_graphed_step.py ;;
esac
done
finish
