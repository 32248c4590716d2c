"""summary.json of a `k3verify all` run: the figures a release sign-off is read from, in one small file.

Written beside report.json by every `all` run, on any device (issue 26 item 5): the run's wall
seconds (`release_suite_s`: plan written to summary written; a resumed run spans both attempts),
the units' own seconds summed (`suite_s`, more than the wall under --jobs) and per check kind and
model (a resumed run counts each unit once), the units --time-limit left unrun, the models and device, exact verdicts per model, approx toggles with
each gate's status, mutants caught per model, localisation accuracy, and which toggles are counted.
"""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from k3verify.io import ReadError, read_json
from k3verify.suites.run_all import attempt_seconds

SUMMARY_FORMAT = "k3verify.all-summary"
SUMMARY_VERSION = 1


def unit_seconds(plan: dict, run_dir: Path) -> dict[str, float]:
    """Seconds per check kind (kind@model for a check's own model), from checks/<unit>.json."""
    out: dict[str, float] = {}
    for u in plan["units"]:
        try:
            data = read_json(Path(run_dir) / "checks" / f"{u['id']}.json")
        except (OSError, ValueError, ReadError):
            continue                                  # not finished: nothing to count
        key = u["kind"] + (f"@{u['model']}" if u.get("model") else "")
        out[key] = round(out.get(key, 0.0) + float(data.get("duration_s") or 0.0), 2)
    return out


def _model_of(row: dict, plan: dict) -> str:
    return row.get("model") or plan.get("model") or "embedded"


def build_summary(plan: dict, report: dict, run_dir: Path) -> dict[str, Any]:
    from optimized_stack import toggles as registry

    results, verdicts = report["results"], report.get("verdicts", [])
    per_kind = unit_seconds(plan, run_dir)
    exact: dict[str, dict[str, str]] = {}
    approx: dict[str, dict[str, Any]] = {}
    for v in verdicts:
        model = v.get("model") or plan.get("model") or "embedded"
        if v["contract"] == "exact":
            exact.setdefault(model, {})[v["toggle"]] = v["verdict"]
            continue
        rows = [r for r in results if r["toggle"] == v["toggle"] and r.get("model") == v.get("model")]
        gates = {"drift_budget": next((r["status"] for r in rows if r["check"] == "drift_budget"), "not run")}
        for g in registry.get(v["toggle"]).contract.quality:
            mine = [r["status"] for r in rows if r.get("gate") == g and r.get("role") != "smoke"]
            smoke = any(r.get("gate") == g and r.get("role") == "smoke" for r in rows)
            gates[g] = ("fail" if "fail" in mine else "inconclusive" if "inconclusive" in mine
                        else "pass" if "pass" in mine else "smoke only" if smoke else "not run")
        approx.setdefault(model, {})[v["toggle"]] = {"verdict": v["verdict"], "gates": gates}
    mutants: dict[str, dict[str, int]] = {}
    for r in results:
        if r["kind"] == "mutant" and r.get("caught") is not None:
            m = mutants.setdefault(_model_of(r, plan), {"caught": 0, "total": 0})
            m["total"] += 1
            m["caught"] += r["caught"] is True
    not_run = sum(1 for r in results if r.get("not_run") == "time_limit")
    attempts = attempt_seconds(run_dir)
    if attempts:                     # each attempt's own wall: a resumed run is not timed across the gap
        wall = round(sum(a["seconds"] for a in attempts), 1)
    else:
        try:
            created = datetime.fromisoformat(plan["created"])
            wall = round((datetime.now(timezone.utc) - created).total_seconds(), 1)
        except (KeyError, TypeError, ValueError):
            wall = None
    nc = report.get("negative_controls") or {}
    env = report.get("environment") or {}
    return {"format": SUMMARY_FORMAT, "version": SUMMARY_VERSION, "run_id": report["run_id"],
            "suite": (plan.get("suite") or {}).get("name"), "verdict": report["summary"]["verdict"],
            "device": plan.get("device", "cpu"), "dtype": plan.get("dtype", "float32"),
            "cuda_device": (env.get("cuda") or {}).get("device") if isinstance(env.get("cuda"), dict) else None,
            "models": sorted({plan.get("model") or "embedded", *(u["model"] for u in plan["units"] if u.get("model"))}),
            "release_suite_s": wall, "attempts": attempts, "units_not_run_time_limit": not_run,
            "suite_s": round(sum(per_kind.values()), 2), "seconds_per_kind": per_kind,
            "exact_verdicts": exact, "approx_verdicts": approx, "mutants": mutants,
            "localisation": {k: nc.get(k) for k in ("localised", "localisable", "localisation_accuracy", "mislocalised")},
            "counted": sorted(v["toggle"] + (f"@{v['model']}" if v.get("model") else "")
                              for v in verdicts if v["verdict"] == "counted")}
