#!/usr/bin/env bash
# Does CUDA MPS shorten `k3verify all --jobs N` on one GPU? One device call, before MPS becomes the
# release run's default:
#   run(command="bash scripts/gpu_mps_ab.sh", carry=[".whl", ".gpu-cache"], timeout_s=600)
# Why: on the fifth H200 release run (golden/reports/gpu-2026-12-04-h200-release-5/) 14 processes
# shared the GPU. A k3-mini prefill step alone keeps the device busy ~12% of its wall clock (5.4 of
# 46.7 ms, session 10's step profile), the reference's token-by-token loop no more, so 14 such
# processes ask for more device time than one GPU gives when it serves one context at a time (and
# every unit ran several times slower than alone: mut_fast_pad_shares_table on k3-small's
# multi_length took 13.2 s in a one-process run, golden/reports/gpu-2026-12-02-h200-all/, and 66.0 s
# beside 13 others here); MPS lets the contexts' small kernels run side by side.
# Prediction (written before the run): the same units with MPS take 1.5-3x less wall and unit work,
# every result's status identical (MPS moves timing, never bits: each kernel's arithmetic and launch
# configuration are its own, the device reports the same SM count to every heuristic).
# What it runs: release.cuda.toml's exact-contracts check alone (61 units on k3-mini, ~2,600 s of
# unit work at 14 processes without MPS), twice in one call: MPS on first, then off, so Triton's JIT
# cache, warm from the first, favours the run without MPS and an MPS gain, if seen, is not an
# order effect. Each run's wall, unit work, and whether every unit's statuses match, in mps_ab.json.
# Results in $OUT: mps_ab.json, on.tar.gz / off.tar.gz (each run's report, units.tsv, log), env.log,
# warm.log, triton-cache.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/k3-mps-ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/gpu_env.sh
env_log "$OUT/env.log"
JOBS=${JOBS:-14}
PER_RUN_S=${PER_RUN_S:-240}
python3 scripts/gpu_warm_fla.py 16 4 > "$OUT/warm.log" 2>&1
python3 - "$OUT/ab.toml" <<'PY'
import sys
from k3verify.suites.suite import load_suite
release = load_suite("release", device="cuda")
check = next(c for c in release.checks if c.name == "exact-contracts")
body = ["version = 2", 'description = "MPS A/B: release.cuda exact-contracts alone"', "[[check]]",
        f'name = "{check.name}"', f'kind = "{check.kind}"', 'contract = "exact"']
open(sys.argv[1], "w").write("\n".join(body) + "\n")
PY
ab_run() {   # ab_run NAME: one `all` of the A/B suite into $OUT/NAME, its wall in $OUT/NAME/wall_s
  local t0 rc
  t0=$(date +%s.%N)
  timeout "$PER_RUN_S" python3 -m k3verify all --suite "$OUT/ab.toml" --device cuda --dtype bfloat16 \
    --jobs "$JOBS" --report-dir "$OUT/$1/run" --time-limit $(( PER_RUN_S - 40 )) --json > "$OUT/$1/all.json" 2> "$OUT/$1/all.log"
  rc=$?
  python3 -c "import sys,time; print(round(time.time() - float(sys.argv[1]), 1))" "$t0" > "$OUT/$1/wall_s"
  [ "$rc" = 124 ] && pkill -TERM -f -- "--shard [0-9]+/"
  python3 -m k3verify.perf.unit_times "$OUT/$1/run" --out "$OUT/$1/units.tsv" > "$OUT/$1/unit_times.log" 2>&1
  echo "$1: rc=$rc wall $(cat "$OUT/$1/wall_s") s; $(head -1 "$OUT/$1/unit_times.log")"
}
mkdir -p "$OUT/on" "$OUT/off"
if mps_start; then
  ab_run on
  mps_stop
else
  echo "mps could not start: no A/B" > "$OUT/on/all.log"
fi
ab_run off
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
doc = {"format": "k3verify.mps-ab", "suite": "release.cuda exact-contracts"}
rows = {}
for arm in ("on", "off"):
    checks = out / arm / "run" / "checks"
    units = {}
    for f in sorted(checks.glob("*.json")) if checks.is_dir() else []:
        d = json.loads(f.read_text())
        units[d["unit"]["id"]] = (d["duration_s"], sorted(r["status"] for r in d["results"]))
    rows[arm] = units
    wall = (out / arm / "wall_s").read_text().strip() if (out / arm / "wall_s").exists() else None
    doc[arm] = {"wall_s": float(wall) if wall else None, "units": len(units),
                "unit_work_s": round(sum(v[0] for v in units.values()), 1)}
both = sorted(set(rows["on"]) & set(rows["off"]))
doc["units_in_both"] = len(both)
doc["statuses_differ"] = [u for u in both if rows["on"][u][1] != rows["off"][u][1]]
if both:
    on_s, off_s = (sum(rows[a][u][0] for u in both) for a in ("on", "off"))
    doc["unit_work_ratio_off_over_on"] = round(off_s / on_s, 3) if on_s else None
(out / "mps_ab.json").write_text(json.dumps(doc, indent=1))
print(json.dumps(doc, indent=1))
PY
for arm in on off; do
  [ -d "$OUT/$arm" ] && (cd "$OUT" && tar -czf "$arm.tar.gz" "$arm" && rm -rf "$arm")
done
rm -f "$OUT/ab.toml"
triton_cache_save "$OUT"      # the release call after this one carries it as .gpu-cache/
ls -la "$OUT"
