#!/usr/bin/env bash
# `k3verify all` on the GPU: the one pipeline, with the suite naming its models (e.g. checks/gpu.toml),
# then the sign-off from its report. Carry .whl (fla-core). Results land in $OUT: report.md,
# summary.json, signoff.md and run.tar (the whole run directory: report.json/html, junit.xml, checks/).
#   SUITE=checks/gpu.toml DTYPE=bfloat16 bash scripts/gpu_all.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/k3-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -f /tmp/site/.k3-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.k3-installed
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
RUN="$OUT/run"
t0=$(date +%s)
timeout "${ALL_TIMEOUT_S:-3000}" python3 -m k3verify all --suite "${SUITE:-gpu}" --device cuda --dtype "${DTYPE:-bfloat16}" --report-dir "$RUN" \
  --json > "$OUT/all.json" 2> "$OUT/all.log"
rc=$?
echo "k3verify all rc=$rc in $(( $(date +%s) - t0 )) s"
tail -5 "$OUT/all.log"
RUN_ID=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["run_id"])' "$OUT/all.json" 2>/dev/null)
[ -n "$RUN_ID" ] && python3 -m k3verify signoff --report "$RUN" --out "$OUT/signoff.md" > "$OUT/signoff.log" 2>&1
echo "signoff rc=$?"
cp "$RUN/report.md" "$OUT/" 2>/dev/null
python3 - "$RUN" "$OUT/summary.json" "$t0" <<'PY'
import glob, json, sys, time
run, out, t0 = sys.argv[1], sys.argv[2], float(sys.argv[3])
r = json.load(open(f"{run}/report.json"))
per_kind = {}                       # seconds per (check kind, model), from the finished units
for f in glob.glob(f"{run}/checks/*.json"):
    d = json.load(open(f))
    key = d["unit"]["kind"] + (f"@{d['unit']['model']}" if d["unit"].get("model") else "")
    per_kind[key] = round(per_kind.get(key, 0.0) + d.get("duration_s", 0.0), 1)
json.dump({"run_id": r["run_id"], "verdict": r["summary"]["verdict"], "summary": r["summary"],
           "suite_s": round(time.time() - t0, 1), "seconds_per_kind": per_kind,
           "negative_controls": r.get("negative_controls"),
           "verdicts": [{k: v.get(k) for k in ("toggle", "model", "verdict", "reason")} for v in r["verdicts"]],
           "environment": r.get("environment")}, open(out, "w"), indent=1, default=str)
PY
(cd "$OUT" && tar -cf run.tar run all.log signoff.log 2>/dev/null && rm -rf run all.log signoff.log)
ls -la "$OUT"
exit $rc
