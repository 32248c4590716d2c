#!/usr/bin/env bash
# Pack a device run's directory for the way back (scripts/gpu_all.sh): in OUT, `run/` and the logs
# become two gzipped archives, and the loose files go.
#   resume.tar.gz  what `k3verify all --resume` reads: run/plan.json, run/attempts.json, run/checks/
#                  (a few MB), so a later call can finish the run (RESUME_TAR) even when
#   run.tar.gz     the whole run directory and the logs (html and per-toggle reports too) is over
#                  the 16 MiB a file may come back with, as the third release run's 30 MB run.tar was
#                  (2026-12-02, session 10).
#   bash scripts/pack_run.sh OUT [LOG ...]     (LOG: files in OUT to add to run.tar.gz; a quoted
#                                               pattern such as 'warm-*.log' is expanded in OUT)
set -uo pipefail
OUT=${1:?usage: pack_run.sh OUT [LOG ...]}
shift
cd "$OUT" || exit 2
[ -f run/plan.json ] || { echo "pack_run.sh: no run/plan.json in $OUT" >&2; exit 2; }
kit=(run/plan.json run/checks)
[ -f run/attempts.json ] && kit+=(run/attempts.json)
tar -czf resume.tar.gz "${kit[@]}" || exit 1
logs=()
for pattern in "$@"; do
  for f in $pattern; do [ -e "$f" ] && logs+=("$f"); done        # unquoted: the glob expands here, in OUT
done
tar -czf run.tar.gz run "${logs[@]}" || exit 1
rm -rf run "${logs[@]}"
