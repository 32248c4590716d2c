#!/usr/bin/env bash
# The fourth release run's two open questions, answered in ~2-4 min before anything changes
# (k3verify/perf/gpu_probes.py): which _scaled_mm shapes/scalings the device accepts, and how far
# fla's chunk_kda is from fp32 under each TRITON_F32_DEFAULT. Carry .whl (fla-core):
#   run(command="bash scripts/gpu_probes.sh", carry=[".whl"], timeout_s=420)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/k3-probes-out}
mkdir -p "$OUT"
source scripts/gpu_env.sh
env_log "$OUT/env.log"
timeout "${PROBES_TIMEOUT_S:-400}" python3 -m k3verify.perf.gpu_probes --out "$OUT" > "$OUT/probes.log" 2>&1
echo "gpu_probes rc=$?"
tail -60 "$OUT/probes.log"
