#!/usr/bin/env bash
# One device call when starts are scarce: the release run first (scripts/gpu_all.sh, the whole call's
# budget is its own), then, with whatever the call has left, the warm call's GPU tests and benches
# (scripts/gpu_warm_tests.sh: the rows-form test first, then the tile probes, the capture bench...).
#   run(command="bash scripts/gpu_release_call.sh", carry=[".whl", ".gpu-cache"], timeout_s=600)
# $OUT keeps gpu_all.sh's files, except resume.tar.gz (run.tar.gz holds the same run directory), and
# gains warm.tar (the warm script's logs.tar): 8 files, a call's limit.
# Env: SUITE (default release), JOBS (14), CALL_S (590, the call's own limit less a margin); the warm
# part takes the warm script's knobs (CAPTURE_B, AFTER_STEP_B, STEP_SITES, SEGMENTS_AB...).
set -uo pipefail
cd "$(dirname "$0")/.."
CALL_S=${CALL_S:-590}
OUT=${OUT:-/tmp/k3-release-call}
mkdir -p "$OUT"
SUITE=${SUITE:-release} JOBS=${JOBS:-14} CALL_S=$CALL_S OUT=$OUT bash scripts/gpu_all.sh
rc=$?
left=$(( CALL_S - SECONDS - 20 ))       # 20 s for the tar below
echo "release call: gpu_all.sh rc=$rc at ${SECONDS} s; ${left} s left for the warm tests"
if [ "$left" -ge 60 ]; then
  WARM_OUT=/tmp/k3-warm-after-release
  OUT=$WARM_OUT BUDGET_S=$left WARM_DIMS="" bash scripts/gpu_warm_tests.sh > "$WARM_OUT.log" 2>&1
  echo "warm tests rc=$?"
  tail -25 "$WARM_OUT.log"
  if [ -f "$WARM_OUT/logs.tar" ]; then
    cp "$WARM_OUT/logs.tar" "$OUT/warm.tar" && rm -f "$OUT/resume.tar.gz"
  fi
fi
ls -la "$OUT"
exit $rc
