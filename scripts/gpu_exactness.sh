#!/usr/bin/env bash
# The one device command of the GPU exactness run (issue 18) on an nvidia-h200 (carry .whl:
# fla-core). Results land in $OUT: gpu_exactness.{json,md}, summary.json, logs.tar.
#   1. fla's kernels compile for head sizes 16 (k3-mini) and 128 (k3-small) in two background
#      processes (Triton's disk cache keeps them: ~80 s each on a fresh machine);
#   2. meanwhile (background) the kernel tests run natively on the GPU (the same files CI runs
#      through Triton's interpreter) and the fast-engine GPU tests;
#   3. python -m k3verify.perf.gpu_exactness: invariance, drift vs the CPU reference, every exact
#      toggle and mutant, approx toggles, fla chunk vs recurrent, the price of exactness.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/k3-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source scripts/gpu_env.sh     # carried wheels (.whl/) and PYTHONPATH
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
rm -f /tmp/k3-warm16 /tmp/k3-warm128
(timeout 200 python3 scripts/gpu_warm_fla.py 16 > "$OUT/warm16.log" 2>&1; touch /tmp/k3-warm16) &
(timeout 240 python3 scripts/gpu_warm_fla.py 128 > "$OUT/warm128.log" 2>&1; touch /tmp/k3-warm128) &
(timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gemm.py tests/test_triton_norm.py \
  tests/test_triton_attn_res.py tests/test_triton_mla_attention.py tests/test_gpu_reference.py \
  tests/test_cuda_toggles.py tests/test_fast_gpu.py > "$OUT/pytest_kernels.log" 2>&1) &
# six lanes in parallel: the work is Python-dispatch-bound (one core each, the GPU mostly idle);
# the prefix toggles and the host tier judge full-scale grid scenarios (GRID_SCENARIOS), the
# heaviest items, so they have lanes of their own
LANE1=${LANE1:-spec_copy_states,spec_replay_ssm,continuous_batching,chunked_prefill,state_offload_roundtrip,prefill_step_api,batched_decode,cuda_graphs}
LANE2=${LANE2:-prefix_cache,prefix_cache_subblock,ckpt_with_mla_tail}
LANE3=${LANE3:-projected_kv_cache,host_kv_tier,preemption,preempt_swap}
LANE4=${LANE4:-shared_expert_side_stream}
LANE5=${LANE5:-invariance_mini,controls,drift,price,invariance_small,fla}
LANE6=${LANE6:-kda_chunked,kda_fla_chunk,kda_fla_chunk_prefill,kda_fla_recurrent,mla_absorbed,mla_sdpa,moe_grouped,moe_grouped_static,gemm_per_shape}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-3}
run_lane() {  # tag sections [toggles] [model]
  K3VERIFY_WAIT_FOR=${WAIT_FOR-16:/tmp/k3-warm16,128:/tmp/k3-warm128} timeout "${RUN_TIMEOUT_S:-500}" \
    python3 -m k3verify.perf.gpu_exactness --out "$OUT" --budget-s "${RUN_BUDGET_S:-430}" --tag "$1" --sections "$2" ${3:+--only $3} ${4:+--model $4} \
    > "$OUT/lane_$1.log" 2>&1
  echo "lane $1 rc=$?"
}
if [ -n "${LANES:-}" ]; then          # e.g. LANES="mutants:mutants approx:approx:kda_fla_chunk,mla_sdpa small:exact,mutants:batched_decode:k3-small"
  for spec in $LANES; do
    IFS=: read -r tag secs only model <<< "$spec"
    run_lane "${model:+${model}__}$tag" "$secs" "$only" "$model" &
  done
else
  run_lane exact1 exact,mutants "$LANE1" &
  run_lane exact2 exact,mutants "$LANE2" &
  run_lane exact3 exact,mutants "$LANE3" &
  run_lane exact4 exact,mutants "$LANE4" &
  run_lane rest "$LANE5" &
  run_lane approx approx "$LANE6" &
fi
if [ -n "${IEEE_LANE:-}" ]; then       # e.g. IEEE_LANE=drift,fla,approx:kda_fla_chunk: fla's dots all in IEEE fp32
  IFS=: read -r secs only <<< "$IEEE_LANE"
  # its own Triton cache (the warm-up compiles fla's default dots, so it does not wait for it)
  K3_FLA_DOTS=ieee TRITON_CACHE_DIR=/tmp/triton-ieee K3VERIFY_DRIFT_NOTE="K3_FLA_DOTS=ieee" WAIT_FOR="" \
    run_lane ieee "$secs" "$only" &
fi
wait
tail -3 "$OUT/pytest_kernels.log"
# lanes on another model (a fourth LANES field) are merged apart: one report per model
for m in $(ls "$OUT"/gpu_exactness_*.json 2>/dev/null | sed -n 's/.*gpu_exactness_\(k3[a-z0-9-]*\)__.*/\1/p' | sort -u); do
  mkdir -p "$OUT/$m" && python3 -m k3verify.perf.gpu_exactness --out "$OUT/$m" --merge "$OUT"/gpu_exactness_${m}__*.json \
    && rm -f "$OUT"/gpu_exactness_${m}__*.json
done
python3 -m k3verify.perf.gpu_exactness --out "$OUT" --merge "$OUT"/gpu_exactness_*.json && rm -f "$OUT"/gpu_exactness_*.json
grep -h "exact \|mutants \|drift \|price\|invariance \|control \|approx" "$OUT"/lane_*.log | cut -c1-220
(cd "$OUT" && tar -cf logs.tar ./*.log && rm -f ./*.log)
ls -la "$OUT"
