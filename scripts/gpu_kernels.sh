#!/usr/bin/env bash
# The fused decode kernels on an H200 in one call (issue 27 item 2), before the release suite spends
# its time on them:
#   run(command="bash scripts/gpu_kernels.sh", carry=[".whl"], timeout_s=600)
# 1. their verdicts: `k3verify all --suite checks/kernels.cuda.toml` (each kernel's exact contract
#    and its mutants caught, on k3-mini and k3-small, bf16);
# 2. their gain: perf/step_profile on k3-small at B = 64 and 256, the stacks side by side in one
#    process (graphs, + the fused kernels, + moe_grouped_static, + moe_grouped_static and the fused
#    conv): engine step ms, graph replay ms, device activities per step;
# 3. where a prefill's time goes (issue 27 item 3, GSM8K's five-shot prompts): the prefill step of
#    a 2,112-token prompt on k3-small, k3-mini and golden/k3-dims, profiled, the fused stack beside
#    it with prefill_sorted_experts;
# 4. the capture's overhead on the counted engine (perf/capture_bench.py), into logs.tar.
# Every stage writes as it goes (the call's limit is a hard kill). Results in $OUT (8 files at most):
# report.md, summary.json, all.json, step_profile.json, step_kernels.txt, prefill-*.json, logs.tar.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/k3-kernels-out}
mkdir -p "$OUT" "$OUT/logs"
export PYTHONUNBUFFERED=1
source scripts/gpu_env.sh
t0=$(date +%s)
since() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# one deadline for the whole call (BUDGET_S from the start, leaving the tar its seconds): each stage
# gets its own limit or what is left, whichever is less
DEADLINE=$(( t0 + ${BUDGET_S:-550} ))
limit() { local left=$(( DEADLINE - $(date +%s) )); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }
env_log "$OUT/logs/env.log"
for dh in 16:4 128:8 128:2; do
  python3 scripts/gpu_warm_fla.py "${dh%%:*}" "${dh##*:}" > "$OUT/logs/warm-${dh/:/x}.log" 2>&1 &
done
wait
since "fla warm"
# --time-limit: no unit starts in the last 50 s, so the report is written before the kill
S=$(limit "${SUITE_TIMEOUT_S:-220}")
timeout "$S" python3 -m k3verify all --suite "${SUITE:-checks/kernels.cuda.toml}" --device cuda \
  --dtype bfloat16 --time-limit $(( S > 60 ? S - 50 : 10 )) --jobs "${JOBS:-2}" --report-dir "$OUT/run" --json > "$OUT/all.json" 2> "$OUT/logs/all.log"
since "verdicts rc=$?"
cp "$OUT/run/report.md" "$OUT/run/summary.json" "$OUT/" 2>/dev/null
grep -E "fused|mut_fused" "$OUT/run/report.md" | head -20
timeout "$(limit "${PROFILE_TIMEOUT_S:-170}")" python3 -m k3verify.perf.step_profile --out "$OUT" --model k3-small \
  --batches "${BATCHES:-64,256}" --stacks cuda_graphs,+fused,+moe_grouped_static,+moe_grouped_static+fused_conv \
  --prefill 2112 > "$OUT/logs/profile.log" 2>&1
since "step profile rc=$?"
grep '^{' "$OUT/logs/profile.log" | cut -c1-400
for m in k3-mini golden/k3-dims; do
  timeout "$(limit 80)" python3 -m k3verify.perf.step_profile --out "$OUT/prefill-${m//\//-}" --model "$m" --batches "" \
    --prefill 2112 > "$OUT/logs/prefill-${m//\//-}.log" 2>&1
  since "prefill profile $m rc=$?"
  cp "$OUT/prefill-${m//\//-}/step_profile.json" "$OUT/prefill-${m//\//-}.json" 2>/dev/null
  cat "$OUT/prefill-${m//\//-}/step_kernels.txt" >> "$OUT/logs/prefill-kernels.txt" 2>/dev/null
  rm -rf "$OUT/prefill-${m//\//-}"
done
# 4. what the verifier's capture costs the counted engine (issue 27's <= 5% goal), if time is left;
#    its JSON goes into logs.tar (the call returns 8 files at most)
timeout "$(limit 90)" python3 -m k3verify.perf.capture_bench --out "$OUT/logs" --model k3-small --batch 64 \
  --new-tokens 32 --repeats 6 > "$OUT/logs/capture.log" 2>&1
since "capture bench rc=$?"
tail -1 "$OUT/logs/capture.log"
(cd "$OUT" && tar -cf logs.tar logs run && rm -rf logs run)
ls -la "$OUT"
