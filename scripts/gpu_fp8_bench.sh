#!/usr/bin/env bash
# The FP8 toggles' ops against the reference ops they replace (issue 28 item 1), one device call:
#   run(command="bash scripts/gpu_fp8_bench.sh", carry=[".whl"], timeout_s=300)
# python -m k3verify.perf.fp8_bench (one process): k3-small in bf16 (load_model, ~30 s), its first
# MLA layer and first MoE layer, prompt lengths T = 4096 and 32768 (FP8_LENGTHS). Per T, the
# mla_prefill slot: the op table's default (decompress + the Triton blocked attention),
# mla_fp8_prefill (e4m3 casts, the same Triton attention in fp32), mla_fp8_prefill_scaled
# (torch._scaled_mm, row-wise scales, bf16 scores); the moe_experts slot: MoE.routed and
# moe_fp8_stage2. Each arm warmed untimed, then FP8_REPEATS (6) interleaved rounds: median ms, its
# 95% interval, the speedup over the reference with its interval, and max|d| of each FP8 arm's
# output against the reference's. Not measured yet: the 32768 cells' length is a guess (the
# reference attention at 32K on one layer, a few 100 ms a call), so the bench starts no new cell
# after FP8_BUDGET_S (150) and the hard timeout FP8_TIMEOUT_S (200) bounds the call; every finished
# cell is already on file (fp8_bench.json is rewritten after each) and in the log.
# Results in $OUT: fp8_bench.json, bench.log, env.log. FP8_ARGS adds flags (e.g. "--ops mla").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/k3-fp8-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/gpu_env.sh     # carried wheels (.whl/) and PYTHONPATH
env_log "$OUT/env.log"
t0=$(date +%s)
# shellcheck disable=SC2086
timeout "${FP8_TIMEOUT_S:-200}" python3 -m k3verify.perf.fp8_bench --out "$OUT" --device cuda \
  --lengths "${FP8_LENGTHS:-4096,32768}" --repeats "${FP8_REPEATS:-6}" --budget-s "${FP8_BUDGET_S:-150}" \
  ${FP8_ARGS:-} > "$OUT/bench.log" 2>&1
echo "fp8_bench rc=$? in $(( $(date +%s) - t0 )) s"
tail -30 "$OUT/bench.log"
ls -la "$OUT"
