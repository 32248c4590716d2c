#!/usr/bin/env bash
# The call before a one-call release run: compile and tune what the release workers would otherwise
# compile inside the timed run, and spend the wait on the GPU tests and the capture bench.
#   run(command="bash scripts/gpu_warm_tests.sh", carry=[".whl"], timeout_s=600)
# then the release, its kernels read from the cache this call leaves:
#   run(command="SUITE=release JOBS=14 bash scripts/gpu_all.sh", carry=[".whl", ".gpu-cache"], timeout_s=600)
# after copying this call's triton-cache.tar.gz to .gpu-cache/.
# 1. fla's KDA kernels for every head size the release suite runs (k3-mini 16:4, golden/k3-dims 128:2,
#    k3-small 128:8), in parallel (~80-150 s on a fresh machine);
# 2. the GPU tests (`pytest -m gpu`: the reference on CUDA, the batched capture, the in-step digests,
#    the fla decode toggles' rows forms;
#    and the device digest kernel's and the GEMM's tests), which also compile this repository's own
#    Triton kernels; then the tile probes (perf/gpu_probes.py router_tiles, paged_tiles: seconds);
# 3. the capture's overhead on the counted engine at B = 16, then 64 (perf/capture_bench.py, the
#    device digests: issue 27's <= 5% goal), while the call has time. CAPTURE_B (default "16 64") picks
#    the batches; at the batches in PER_REQUEST_B (default 16) the bench also times the capture through
#    the per-request observer calls in the same process (the form before session 16's batched calls);
#    at those in AFTER_STEP_B (default 64) it also times the capture with its calls after the step
#    (--after-step: the form before the in-step digests of 2026-12-07) beside the default, in-step one.
#    TESTS=0 skips step 2 (a call whose kernels the carried .gpu-cache already holds).
# 4. PREFILL_PROFILE=32768: the prefill A/B and kernel-family profile against transformers (below).
# Results in $OUT (8 files at most): logs.tar (env, warm, pytest and bench logs, the bench JSONs) and
# triton-cache.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/k3-warm-out}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1
source scripts/gpu_env.sh
t0=$(date +%s)
since() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
DEADLINE=$(( t0 + ${BUDGET_S:-540} ))     # the call's 600 s less the cache's packing and a margin
limit() { local left=$(( DEADLINE - $(date +%s) )); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }
env_log "$OUT/logs/env.log"
for dh in ${WARM_DIMS-16:4 128:2 128:8}; do
  python3 scripts/gpu_warm_fla.py "${dh%%:*}" "${dh##*:}" > "$OUT/logs/warm-${dh/:/x}.log" 2>&1 &
done
wait
since "fla warm"
if [ "${TESTS:-1}" = 1 ]; then
  # the digest kernel's tests carry no gpu marker (they run under the interpreter in CI): all of them here
  timeout "$(limit 200)" python3 -m pytest -m gpu tests/test_gpu_reference.py tests/test_capture_batched.py \
    tests/test_step_digests.py tests/test_fast_gpu.py::test_fla_rows_forms_equal_one_request_per_call \
    tests/test_fast_gpu.py::test_the_flash_bf16_toggle_decodes_batched_with_the_bits_of_its_one_request_calls \
    tests/test_triton_situ.py \
    -q -p no:cacheprovider -rs > "$OUT/logs/pytest-gpu.log" 2>&1
  since "pytest -m gpu rc=$?"
  tail -3 "$OUT/logs/pytest-gpu.log"
  timeout "$(limit 150)" python3 -m pytest tests/test_triton_digest.py tests/test_triton_step_digests.py \
    tests/test_triton_gemm.py -q -p no:cacheprovider -rs \
    > "$OUT/logs/pytest-digest-kernel.log" 2>&1
  since "pytest digest kernel rc=$?"
  tail -3 "$OUT/logs/pytest-digest-kernel.log"
fi
# GPU_TESTS (default empty): pytest node ids run first whatever TESTS says, for the changes since the
# last call (e.g. one new kernel's GPU test, with its mutant's control), -m gpu not applied
if [ -n "${GPU_TESTS:-}" ]; then
  # shellcheck disable=SC2086 # a list of node ids
  timeout "$(limit 150)" python3 -m pytest $GPU_TESTS -q -p no:cacheprovider -rs > "$OUT/logs/pytest-new.log" 2>&1
  since "pytest GPU_TESTS rc=$?"
  tail -3 "$OUT/logs/pytest-new.log"
fi
# the router GEMM's tiles and the paged MLA decode kernel's query tiles (perf/gpu_probes.py): us a call, bitwise the reference's
timeout "$(limit 90)" python3 -m k3verify.perf.gpu_probes --out "$OUT/logs/probes" --only router_tiles,paged_tiles \
  > "$OUT/logs/probes.log" 2>&1
since "tile probes rc=$?"
for b in ${CAPTURE_B-16 64}; do
  [ "$(limit 60)" -lt 60 ] && { since "capture bench B=$b: no time left"; break; }
  extra=(); [[ " ${PER_REQUEST_B-16} " == *" $b "* ]] && extra=(--per-request)
  [[ " ${AFTER_STEP_B-64} " == *" $b "* ]] && extra+=(--after-step)
  timeout "$(limit ${BENCH_S:-200})" python3 -m k3verify.perf.capture_bench --out "$OUT/logs/capture-b$b" \
    --model k3-small --batch "$b" --new-tokens 32 --repeats 6 "${extra[@]}" > "$OUT/logs/capture-b$b.log" 2>&1
  since "capture bench B=$b rc=$?"
  tail -2 "$OUT/logs/capture-b$b.log"
done
# STEP_SITES=1 (default off): the counted decode step at B = 64 profiled by the model line that launched
# each kernel (perf/step_profile.py --sites: where the step's ~1,500 launches and its casts come from).
if [ "${STEP_SITES:-0}" = 1 ]; then
  if [ "$(limit 60)" -lt 60 ]; then
    since "step sites: no time left"
  else
    timeout "$(limit 150)" python3 -m k3verify.perf.step_profile --out "$OUT/logs/step" --model k3-small \
      --batches 64 --stacks "+moe_grouped_static+fused_conv" --repeats 10 --sites > "$OUT/logs/step.log" 2>&1
    since "step sites rc=$?"
    head -25 "$OUT/logs/step/step_sites.txt" 2>/dev/null | cut -c1-160
  fi
fi
# SEGMENTS_AB=1 (default off): one engine step prefilling 1, 4 and 16 prompts of 256 tokens on k3-small,
# with and without prefill_batched_mixers (perf/segments_ab.py: the host-bound multi-prompt prefill).
if [ "${SEGMENTS_AB:-0}" = 1 ]; then
  if [ "$(limit 60)" -lt 60 ]; then
    since "segments A/B: no time left"
  else
    timeout "$(limit 150)" python3 -m k3verify.perf.segments_ab --out "$OUT/logs/segments" --model k3-small \
      --device cuda --dtype bfloat16 --prompts 1,4,16 --tokens 256 --repeats 5 \
      --base batched_decode+prefill_sorted_experts > "$OUT/logs/segments.log" 2>&1
    since "segments A/B rc=$?"
    grep '^|' "$OUT/logs/segments.log"
  fi
fi
# 4. PREFILL_PROFILE=N (default off): perf/prefill_ab at N tokens, the phase set against the reference
#    and transformers (--peer), then --profile N (device ms by kernel family) while the call has time.
#    PREFILL_SETS (default "phase;phase+gemm_per_shape").
if [ -n "${PREFILL_PROFILE:-}" ]; then
  if [ "$(limit 90)" -lt 90 ]; then
    since "prefill profile: no time left"
  else
    timeout "$(limit 240)" python3 -m k3verify.perf.prefill_ab --out "$OUT/logs/prefill" --model k3-small --peer \
      --tokens "$PREFILL_PROFILE" --repeats 3 --sets "${PREFILL_SETS:-phase;phase+gemm_per_shape}" \
      --profile "$PREFILL_PROFILE" > "$OUT/logs/prefill.md" 2> "$OUT/logs/prefill.log"
    since "prefill profile rc=$?"
    grep "^profile" "$OUT/logs/prefill.log" | cut -c1-240
  fi
fi
triton_cache_save "$OUT"
(cd "$OUT" && tar -cf logs.tar logs && rm -rf logs)
since "packed"
ls -la "$OUT"
