#!/usr/bin/env bash
# The fair transformers baseline (issue 27 item 1) on an nvidia-h200, one device call:
#   run(command="bash scripts/gpu_fair_bench.sh", carry=[".whl"], timeout_s=600)
# k3-small bf16, B = 1, 64, 256, context 512, N = 128 decode tokens, k = 8, 6 interleaved rounds,
# every transformers arm (dynamic, masked, static, static_compiled), prefill 4096. Results in
# $OUT: fair_baseline.json, summary.json, bench.log, env.log. FAIR_ARGS adds/overrides flags.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/k3-fair-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -f /tmp/site/.k3-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.k3-installed
fi
export PYTHONPATH=/tmp/site:$PWD
{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, fla, transformers; print("torch", torch.__version__, "triton", triton.__version__, "fla", fla.__version__, "transformers", transformers.__version__)'
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
# shellcheck disable=SC2086
timeout "${FAIR_TIMEOUT_S:-540}" python3 -m k3verify.perf.fair_bench --out "$OUT" --budget-s "${FAIR_BUDGET_S:-300}" \
  ${FAIR_ARGS:-} > "$OUT/bench.log" 2>&1
echo "fair_bench rc=$?"
grep -v "falling back" "$OUT/bench.log" | tail -40
