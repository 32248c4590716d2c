"""Where a `k3verify all` run's time went, one row per unit, from the run directory's own files.

    python -m k3verify.perf.unit_times RUN_DIR [--out units.tsv]

A run directory's checks/<unit>.json holds each finished unit's results and its `duration_s`; a
GSM8K unit's rows also carry the engine's prefill / decode seconds and where its reference answers
came from (computed here, another worker's file, this process). The release gate's <= 600 s target
is a question of unit work per process, so each H200 release run is read this way (NOTES.md).

Columns: unit, status (the unit's worst result), seconds, then for GSM8K units prefill_s, decode_s,
prefill_tokens and reference_source (blank elsewhere). Sorted by seconds, longest first. Written
atomically to --out (default RUN_DIR/units.tsv) and printed with the per-check totals.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from ..errors import UsageError
from ..io import ReadError, atomic_write_text, read_json

COLUMNS = ("unit", "status", "seconds", "prefill_s", "decode_s", "prefill_tokens", "reference_source")
# worst first: a unit's status is the worst of its results
SEVERITY = ("error", "fail", "inconclusive", "not_exercised", "skip", "pass")


def unit_rows(run_dir: Path) -> list[dict]:
    """One dict per finished unit (checks/*.json), longest first."""
    checks = run_dir / "checks"
    if not checks.is_dir():
        raise UsageError(f"{run_dir}: no checks/ directory (not a `k3verify all` run directory)")
    rows = []
    for path in sorted(checks.glob("*.json")):
        try:
            doc = read_json(path)
        except (OSError, ValueError, ReadError) as exc:
            raise UsageError(f"{path}: unreadable unit file ({exc})") from None
        if not isinstance(doc, dict) or "duration_s" not in doc or "unit" not in doc:
            raise UsageError(f"{path}: not a unit file (no unit / duration_s)")
        results = doc.get("results") or []
        statuses = {r.get("status") for r in results}
        status = next((s for s in SEVERITY if s in statuses), "none")
        row = {"unit": doc["unit"].get("id", path.stem), "check": doc["unit"].get("check", ""),
               "status": status, "seconds": float(doc["duration_s"])}
        engine = next((r["engine"] for r in results if isinstance(r.get("engine"), dict)), None)
        if engine and isinstance(engine.get("timing"), dict):
            timing = engine["timing"]
            row.update(prefill_s=timing.get("prefill_s"), decode_s=timing.get("decode_s"),
                       prefill_tokens=timing.get("prefill_tokens"),
                       reference_source=next((r.get("reference_source") for r in results
                                              if r.get("reference_source")), None))
        rows.append(row)
    rows.sort(key=lambda r: (-r["seconds"], r["unit"]))
    return rows


def to_tsv(rows: list[dict]) -> str:
    def cell(v) -> str:
        if v is None:
            return ""
        return f"{v:.1f}" if isinstance(v, float) else str(v)
    return "\n".join(["\t".join(COLUMNS)] + ["\t".join(cell(r.get(c)) for c in COLUMNS) for r in rows]) + "\n"


def per_check(rows: list[dict]) -> dict[str, tuple[int, float]]:
    """check -> (units, seconds)."""
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for r in rows:
        out[r["check"]][0] += 1
        out[r["check"]][1] += r["seconds"]
    return {k: (n, s) for k, (n, s) in sorted(out.items(), key=lambda kv: -kv[1][1])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3verify.perf.unit_times", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="default: RUN_DIR/units.tsv")
    args = ap.parse_args(argv)
    try:
        rows = unit_rows(args.run_dir)
        if not rows:
            raise UsageError(f"{args.run_dir}: no finished units in checks/")
        out = args.out or args.run_dir / "units.tsv"
        atomic_write_text(out, to_tsv(rows))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    total = sum(r["seconds"] for r in rows)
    print(f"{len(rows)} units, {total:.0f} s of unit work -> {out}")
    for check, (n, s) in per_check(rows).items():
        print(f"  {check:32s} {n:4d} units {s:8.0f} s  ({s / total:5.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
