#!/usr/bin/env bash
# The one device command of the engine run (issue 20) on an nvidia-h200 (carry .whl: fla-core):
#   run(command="bash scripts/gpu_engine_bench.sh", carry=[".whl"], timeout_s=600)
# Under 10 minutes; results in $OUT (7 files): engine_bench.json, summary.json (issue 20 item 6's
# fields), gpu_exactness_fast.json (the exact verdicts and mutants), pytest_fast.log, env.log,
# logs.tar (bench.log, lane_fast.log).
#   background (k3-mini, bf16; tiny GPU work beside the bench, one CPU core each):
#     - the GPU-only tests of the fast path and the paged kernel, natively;
#     - k3verify.perf.gpu_exactness: batched_decode and cuda_graphs bitwise on the GPU reference on
#       every default + tagged scenario, every mutant of both (caught?);
#   foreground: python -m k3verify.perf.fast_bench (k3-small bf16): the stack, each row
#     counted only after its contract held in this run, decode B = 1, 8, 64, 256 x context 512 and
#     8K, prefill 4K and 32K, transformers' Kimi Linear bf16 / fp32, the HBM roofline, agentic.
# BENCH_ALONE=1 runs the background lanes after the bench instead (clean timings, longer);
# NO_LANES=1 runs the bench alone.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/k3-engine-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
source scripts/gpu_env.sh     # carried wheels (.whl/) and PYTHONPATH
{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, fla, transformers; print("torch", torch.__version__, "triton", triton.__version__, "fla", fla.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0))'
  nproc
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

lanes() {
  (timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_fast_gpu.py tests/test_fast_paged_kernel.py \
     tests/test_triton_mla_attention.py > "$OUT/pytest_fast.log" 2>&1; echo "pytest rc=$?" >> "$OUT/pytest_fast.log") &
  (timeout 450 python3 -m k3verify.perf.gpu_exactness --out "$OUT" --budget-s 420 --tag fast --sections exact,mutants \
     --only batched_decode,cuda_graphs > "$OUT/lane_fast.log" 2>&1; echo "lane rc=$?" >> "$OUT/lane_fast.log") &
  # MUTANTS_ONLY=t1,t2: also every mutant of those exact toggles (re-verifying fixed mutants)
  if [ -n "${MUTANTS_ONLY:-}" ]; then
    (timeout 450 python3 -m k3verify.perf.gpu_exactness --out "$OUT" --budget-s 420 --tag mut --sections mutants \
       --only "$MUTANTS_ONLY" > "$OUT/lane_mut.log" 2>&1; echo "lane rc=$?" >> "$OUT/lane_mut.log") &
  fi
}
bench() {
  timeout "${BENCH_TIMEOUT_S:-500}" python3 -m k3verify.perf.fast_bench --out "$OUT" \
    --budget-s "${BENCH_BUDGET_S:-420}" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
}
if [ -n "${NO_LANES:-}" ]; then                # the bench alone (the lanes' verdicts from an earlier run)
  bench
elif [ -n "${BENCH_ALONE:-}" ]; then
  bench; lanes; wait
else
  lanes; bench; wait
fi
[ -f "$OUT/pytest_fast.log" ] && tail -4 "$OUT/pytest_fast.log"
grep -h "exact \|exact_mutants \|rc=" "$OUT"/lane_*.log 2>/dev/null | cut -c1-220
tail -12 "$OUT/bench.log"
(cd "$OUT" && tar -cf logs.tar bench.log $(ls lane_*.log 2>/dev/null) && rm -f bench.log lane_*.log)
ls -la "$OUT"
