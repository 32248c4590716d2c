#!/usr/bin/env bash
# A new approx CUDA toggle before it joins the release run, in one device call: its prefill speed
# against the reference in one process (perf/prefill_ab.py), then every gate the GPU release suite
# holds it to: `k3verify all --suite release --device cuda --only TOGGLES` (the release suite's own
# units of those toggles and their mutants, under their release ids and priors; the report says the
# run was restricted and `signoff` refuses it).
#   run(command="TOGGLES=mla_flash_bf16 bash scripts/gpu_toggle_gates.sh", carry=[".whl", ".gpu-cache"],
#       timeout_s=600)
# PREFILL_SETS ("" skips the A/B): perf/prefill_ab.py --sets; PREFILL_TOKENS (default 4096,32768);
# PEER=1 adds transformers' prefill against the last set (--peer). Results in $OUT: report.md,
# summary.json, run.tar.gz and extra.tar.gz (prefill_ab/, its table and log).
# Measured 2026-12-07 on one H100 for mla_flash_bf16: the A/B 59 s, the 8 gate units 225 s at 8 jobs.
set -uo pipefail
cd "$(dirname "$0")/.."
T_CALL=$(date +%s)
OUT=${OUT:-/tmp/k3-gates-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
: "${TOGGLES:?TOGGLES=name[,name] names the toggles to judge}"
source scripts/gpu_env.sh
SETS=${PREFILL_SETS-mla_flash_bf16;mla_sdpa;phase;phase/mla_sdpa}
if [ -n "$SETS" ]; then
  timeout "${PREFILL_S:-150}" python3 -m k3verify.perf.prefill_ab --out "$OUT/prefill_ab" --model k3-small \
    --tokens "${PREFILL_TOKENS:-4096,32768}" --repeats "${PREFILL_REPEATS:-5}" --sets "$SETS" \
    $([ "${PEER:-0}" = 1 ] && echo --peer) > "$OUT/prefill_ab.md" 2> "$OUT/prefill_ab.log"
  echo "prefill A/B rc=$? in $(( $(date +%s) - T_CALL )) s"
  cat "$OUT/prefill_ab.md"
fi
# the gates get what is left of the call
CALL_S=$(( ${CALL_S:-590} - ($(date +%s) - T_CALL) )) SUITE=release ONLY="$TOGGLES" JOBS="${JOBS:-8}" OUT="$OUT" \
  exec bash scripts/gpu_all.sh
