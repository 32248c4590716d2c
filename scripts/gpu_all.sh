#!/usr/bin/env bash
# `k3verify all` on the GPU: the one pipeline, with the suite naming its models (e.g. checks/gpu.toml),
# then the sign-off from its report. Carry .whl (fla-core). Results land in $OUT: report.md,
# summary.json (seconds per kind, verdicts per model, mutants, localisation), signoff.md, resume.tar.gz
# (what --resume needs) and run.tar.gz (the whole run directory: report.json/html, junit.xml, checks/).
#   SUITE=checks/gpu.toml DTYPE=bfloat16 JOBS=6 bash scripts/gpu_all.sh   (JOBS processes: the work is dispatch-bound)
#   SUITE=release TIME_LIMIT=480 JOBS=8 bash scripts/gpu_all.sh           (the release gate; carry .whl from scripts/gpu_wheels.sh)
#   SUITE=release ONLY=mla_flash_bf16 bash scripts/gpu_all.sh  (that toggle's units only, its mutants with it:
#                                 `all --only`; scripts/gpu_toggle_gates.sh; never a sign-off)
#   RESUME_TAR=.gpu-resume/resume.tar.gz TIME_LIMIT=480 bash scripts/gpu_all.sh  (finish it on the next call; carry .gpu-resume too)
#   MPS=0 ...                     (the default, MPS=1, has the processes share the GPU through CUDA MPS)
#   CALL_S=590 (default): the device call's own limit less a margin. `all` is stopped in time for the
#   report, sign-off and packing to finish inside it (the call's hard kill returns nothing but $OUT's
#   first 8 files: session 14's release call lost its report so).
#   carry .gpu-cache too (triton-cache.tar.gz from an earlier call): fla's kernels are not compiled again
set -uo pipefail
cd "$(dirname "$0")/.."
T_CALL=$(date +%s)
OUT=${OUT:-/tmp/k3-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/gpu_env.sh     # carried wheels (.whl/) and PYTHONPATH
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
RUN="$OUT/run"
# MPS=1 (the default): the run's processes share the GPU through CUDA MPS (gpu_env.sh mps_start; off
# again, with the reason, when the daemon or a client fails); the report's environment records it
# (cuda_mps). Measured (scripts/gpu_mps_ab.sh, one H100, 14 processes, the exact selftest): 3.9x less
# unit work with it, every unit's statuses identical.
if [ "${MPS:-1}" = 1 ]; then
  mps_start && trap mps_stop EXIT
fi
t0=$(date +%s)
# fla tunes its KDA kernels on first call; tune each head size once, in parallel, before the workers
# start (gpu_env.sh keeps the choice on disk for them). WARM_DIMS="" skips it; DIM:HEADS per model
# (k3-mini 16:4, golden/k3-dims 128:2, k3-small 128:8).
for dh in ${WARM_DIMS-16:4 128:2 128:8}; do
  python3 scripts/gpu_warm_fla.py "${dh%%:*}" "${dh##*:}" > "$OUT/warm-${dh/:/x}.log" 2>&1 &
done
wait
echo "fla warm (${WARM_DIMS-16:4 128:2 128:8}) in $(( $(date +%s) - t0 )) s"
# RESUME_TAR: an earlier call's resume.tar.gz or run.tar.gz (carried back): finish that run, timed as the sum of its attempts
if [ -n "${RESUME_TAR:-}" ]; then
  tar -xf "$RESUME_TAR" -C "$OUT" run
  WHAT=(--resume "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["run_id"])' "$RUN/plan.json")")
else
  WHAT=(--suite "${SUITE:-gpu}" --device cuda --dtype "${DTYPE:-bfloat16}" ${ONLY:+--only "$ONLY"})
fi
# TIME_LIMIT: no unit starts after it (the units left are inconclusive rows; the report is still written).
# FINISH_BY (default: ALL_TIMEOUT_S less 25 s): no unit starts whose expected seconds (the suite's
# measured priors) would end past it, so the hard stop does not cut units half-run (the fifth release
# run's first call lost the work of every unit in flight at its 400 s kill)
# ALL_TIMEOUT_S: at most what the call has left after the warm-up, less POST_S for what follows `all`
# (the report of finished units after a stop, sign-off, packing, the cache: ~20-40 s measured)
left=$(( ${CALL_S:-590} - ($(date +%s) - T_CALL) - ${POST_S:-60} ))
ALL_TIMEOUT_S=${ALL_TIMEOUT_S:-$left}
[ "$ALL_TIMEOUT_S" -gt "$left" ] && ALL_TIMEOUT_S=$left
if [ "$ALL_TIMEOUT_S" -lt 60 ]; then
  echo "gpu_all.sh: only ${ALL_TIMEOUT_S} s of the call's CALL_S=${CALL_S:-590} left for k3verify all; not started" >&2
  exit 2
fi
echo "k3verify all: stopped at ${ALL_TIMEOUT_S} s (call limit ${CALL_S:-590} s, ${POST_S:-60} s kept for the report)"
FINISH_BY=${FINISH_BY:-$(( ALL_TIMEOUT_S - 25 ))}
timeout "$ALL_TIMEOUT_S" python3 -m k3verify all "${WHAT[@]}" --jobs "${JOBS:-6}" --report-dir "$RUN" \
  ${TIME_LIMIT:+--time-limit "$TIME_LIMIT"} ${FINISH_BY:+--finish-by "$FINISH_BY"} \
  --json > "$OUT/all.json" 2> "$OUT/all.log"
rc=$?
echo "k3verify all rc=$rc in $(( $(date +%s) - t0 )) s"
if [ "$rc" = 124 ]; then
  # ALL_TIMEOUT_S ended it mid-unit: stop its workers, then write the report of what finished (the
  # rest are inconclusive `not_run` rows, never a pass; `--resume` on a later call runs them)
  pkill -TERM -f -- "--shard [0-9]+/" ; sleep 2
  RID=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["run_id"])' "$RUN/plan.json")
  python3 -m k3verify all --resume "$RID" --report-dir "$RUN" --time-limit 0.001 --json > "$OUT/all.json" 2>> "$OUT/all.log"
  echo "report of the finished units: rc=$?"
fi
tail -5 "$OUT/all.log"
RUN_ID=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["run_id"])' "$OUT/all.json" 2>/dev/null)
[ -n "$RUN_ID" ] && python3 -m k3verify signoff --report "$RUN" --out "$OUT/signoff.md" > "$OUT/signoff.log" 2>&1
echo "signoff rc=$?"
cp "$RUN/report.md" "$OUT/" 2>/dev/null
cp "$RUN/summary.json" "$OUT/summary.json" 2>/dev/null     # k3verify all writes it (suites/summary.py)
# resume.tar.gz (what --resume reads) beside run.tar.gz (everything): scripts/pack_run.sh
bash scripts/pack_run.sh "$OUT" all.log signoff.log 'warm-*.log'
triton_cache_save "$OUT"     # the next call carries it as .gpu-cache/ (gpu_env.sh)
# a call returns at most 8 files from $OUT: anything beyond the known ones goes into extra.tar.gz
known="all.json report.md summary.json signoff.md resume.tar.gz run.tar.gz triton-cache.tar.gz"
extra=()
for f in "$OUT"/*; do
  name=$(basename "$f"); case " $known " in *" $name "*) ;; *) extra+=("$name") ;; esac
done
if [ "${#extra[@]}" -gt 0 ]; then
  tar -czf "$OUT/extra.tar.gz" -C "$OUT" "${extra[@]}" && (cd "$OUT" && rm -rf "${extra[@]}")
fi
echo "call: $(( $(date +%s) - T_CALL )) s of CALL_S=${CALL_S:-590}"
ls -la "$OUT"
exit $rc
