"""The combined report of `k3verify all`: a verdict per optimization toggle, a status per suite
check, the negative controls, and the per-toggle reports the verdicts link to.

Verdict per optimization toggle (mutants are negative controls, not verdicts):
- rejected: a contract check failed or errored (which check, first divergence, link);
- counted:  its contract held: every check that ran passed, and for an approx toggle
            every quality gate its contract names passed too (a gate passes when one of
            its results passed, none was inconclusive, and it was not only a smoke test);
            the bench speedup (if measured) is counted;
- skipped:  not counted: nothing proved the contract here (skipped or not exercised), a
            declared path event fired on none of its scenarios, or a quality gate was
            inconclusive or ran only as a smoke test (the reasons).
Each verdict carries `events`: the toggle's declared path events, how often each fired summed
over its scenario set, and those that never fired (the set passes only with none missing).
"""
from __future__ import annotations

from typing import Any

import json
from pathlib import Path

from k3verify.compare import golden
from k3verify.io import atomic_write_json
from k3verify.report import build_report, environment_fingerprint, validate_report, write_report
from k3verify.verdict.result import STATUSES
from optimized_stack import toggles as toggle_registry
from optimized_stack.errors import K3Error

# a check's status over its units: the first of these any unit has (a not-exercised unit keeps
# a check from passing; skip only when every unit skipped)
_PRECEDENCE = ("error", "fail", "inconclusive", "not_exercised", "pass")


def _status_of(rows: list[dict]) -> str:
    statuses = {r["status"] for r in rows}
    return next((s for s in _PRECEDENCE if s in statuses), "skip")


def _reasons(rows: list[dict], status: str = "skip") -> str:
    return "; ".join(dict.fromkeys(r["reason"] for r in rows if r["status"] == status))


def toggle_verdicts(results: list[dict]) -> list[dict]:
    """One verdict per optimization toggle that appears in the results (see module docstring)."""
    # a toggle has one verdict per model a suite judges it on (rows tagged `model` by a check that
    # names its own; untagged rows are the run's model)
    names = list(dict.fromkeys((r["toggle"], r.get("model")) for r in results if r["kind"] == "optimization"))
    out = []
    for name, model in names:
        try:
            t = toggle_registry.get(name)
        except K3Error:
            continue                                    # "(reference)", "reference": gates, not toggles
        rows = [r for r in results if r["toggle"] == name and r.get("model") == model]
        contract_rows = [r for r in rows if not r.get("gate") and r["check"] != "bench"]
        gate_rows = [r for r in rows if r.get("gate")]
        bench = [r for r in rows if r["check"] == "bench" and r.get("speedup")]
        v = {"toggle": name, "contract": t.contract.describe(), "verdict": "skipped", "reason": "",
             "checks": {s: sum(r["status"] == s for r in rows) for s in STATUSES},
             "scenarios": sorted({r["scenario"] for r in contract_rows if r["scenario"] and r["status"] == "pass"}),
             "speedup": None, "failed_check": None, "first_divergence": None, "localization": None,
             "report": f"toggles/{toggle_dir(name, model)}/report.md", **({"model": model} if model else {})}
        v["events"] = set_events(t, contract_rows)
        bad = [r for r in contract_rows + gate_rows if r["status"] in ("fail", "error")]
        passed = [r for r in contract_rows if r["status"] == "pass"]
        if bad:
            b = bad[0]
            where = b.get("scenario") or b.get("gate") or "its check"
            v.update(verdict="rejected", failed_check=b["check"], first_divergence=b.get("first_divergence"),
                     localization=b.get("localization"),
                     reason=f"{b['check']} {'errored' if b['status'] == 'error' else 'failed'} on {where}: {b['reason']}")
        elif not passed:
            v["reason"] = (_reasons(contract_rows) or _reasons(contract_rows, "not_exercised")
                           or "no check in this suite ran its contract")
        elif v["events"]["missing"]:
            v["reason"] = (f"not exercised: {', '.join(v['events']['missing'])} fired on none of "
                           f"{', '.join(sorted({r['scenario'] for r in contract_rows if r['scenario']}))}")
        else:
            missing = []
            for g in t.contract.quality if t.contract.kind == "approx" else ():
                mine = [r for r in gate_rows if r["gate"] == g]
                counting = [r for r in mine if r.get("role") != "smoke"]   # a smoke test never proves a gate
                undecided = [r for r in counting if r["status"] == "inconclusive"]
                # the paired verdict's own line, not the whole evidence paragraph of a gsm8k reason
                short = "; ".join(dict.fromkeys(
                    r["accuracy"].get("verdict_reason", r["reason"]) if isinstance(r.get("accuracy"), dict)
                    else r["reason"] for r in (undecided or mine)))
                if undecided:
                    missing.append(f"{g} inconclusive ({short})")
                elif any(r["status"] == "pass" for r in counting):
                    continue
                elif mine and not counting:
                    missing.append(f"{g} ran only as a smoke test, which counts toward no verdict ({short})")
                else:
                    missing.append(f"{g} ({_reasons(mine) or 'not in this suite'})")
            on = ", ".join(v["scenarios"]) or "its scenarios"
            if missing:
                v["reason"] = (f"drift budget held on {on}, but the contract's quality gates did not pass here: "
                               + "; ".join(missing))
            else:
                v.update(verdict="counted", reason=f"contract {t.contract.describe()} held: {len(passed)} checks "
                                                   f"passed on {on}" + (", quality gates passed" if gate_rows else ""))
                if bench:
                    v["speedup"] = {**bench[0]["speedup"], "counted": True}
        out.append(v)
    return out


def toggle_dir(name: str, model: str | None) -> str:
    """toggles/<name>/ for the run's model, toggles/<name>@<model>/ for a check's own model."""
    return name if not model else f"{name}@{''.join(c if c.isalnum() or c in '-_.' else '_' for c in model)}"


def set_events(toggle, rows: list[dict]) -> dict:
    """The toggle's declared events over a set of result rows: counts summed (each scenario's
    run counted once) and the ones that fired nowhere."""
    fired = dict.fromkeys(toggle.events, 0)
    seen, cannot = set(), set()
    for r in rows:
        cannot |= set((r.get("evidence") or {}).get("events_impossible") or {})
        ev = (r.get("evidence") or {}).get("events") or {}
        key = (r.get("scenario"), r.get("suite_check"), r.get("unit"))
        if not ev or key in seen:
            continue
        seen.add(key)
        for e in fired:
            fired[e] += int(ev.get(e, 0))
    return {"declared": list(toggle.events), "fired": fired,
            "missing": [e for e, n in fired.items() if not n and e not in cannot],
            **({"impossible_on_grid": sorted(cannot)} if cannot else {})}


def check_statuses(plan: dict, results: list[dict]) -> list[dict]:
    """Per [[check]] of the suite: one status over all its units (what sign-off requires)."""
    out = []
    for c in plan["suite"]["checks"]:
        rows = [r for r in results if r.get("suite_check") == c["name"]]
        status = _status_of(_set_judged(rows))
        out.append({"index": c["index"], "name": c["name"], "kind": c["kind"], "status": status,
                    **({"model": c["model"]} if c.get("model") else {}),
                    "counts": {s: sum(r["status"] == s for r in rows) for s in STATUSES},
                    "reason": _reasons(rows, status)[:500] if status in ("skip", "inconclusive", "not_exercised")
                    else ""})
    return out


def _set_judged(rows: list[dict]) -> list[dict]:
    """Rows for a check's status: a toggle's `not exercised` scenarios do not hold the check back
    when the toggle passed somewhere in the check and every declared event fired in its set
    (a prefix toggle on `single` proves nothing, and need not: multi_turn proved it)."""
    out = []
    for r in rows:
        if r["status"] == "not_exercised" and r["kind"] == "optimization":
            mine = [x for x in rows if x["toggle"] == r["toggle"]]
            try:
                t = toggle_registry.get(r["toggle"])
            except K3Error:
                out.append(r)
                continue
            if any(x["status"] == "pass" for x in mine) and not set_events(t, mine)["missing"]:
                continue
        out.append(r)
    return out


def negative_controls(results: list[dict]) -> dict[str, Any]:
    mutants = [r for r in results if r["kind"] == "mutant" and r.get("caught") is not None]
    return {"caught": sum(r["caught"] is True for r in mutants), "total": len(mutants), **localisation(results)}


def localisation(results: list[dict]) -> dict[str, Any]:
    """Localisation accuracy, with the mutants' own `lives_in` as the oracle: of the caught mutants
    that name where they live, how many the check localised there (issue 26: >= 0.9)."""
    judged = [(r.get("evidence") or {}).get("localisation") for r in results
              if r["kind"] == "mutant" and r.get("caught") is True]
    judged = [j for j in judged if j and j.get("lives_in")]
    exact = sum(bool(j["exact"]) for j in judged)
    return {"localised": exact, "localisable": len(judged),
            "localisation_accuracy": round(exact / len(judged), 4) if judged else None,
            "mislocalised": sorted(f"{j['lives_in']} -> {j['found']}" for j in judged if not j["exact"])}


def write_combined(plan: dict, model, run_dir: Path, results: list[dict]) -> tuple[dict, dict]:
    """Per-toggle reports, then the combined report with suite, verdicts and negative controls."""
    from k3verify.suites.signoff import verdict_html, verdict_markdown

    env = environment_fingerprint(model=model, seeds={"scenario_seed": 0}, extra={
        "numerics_key": golden.env_key(golden.numerics_environment(model))})
    verdicts = toggle_verdicts(results)
    for v in verdicts:
        rows = [r for r in results if r["toggle"] == v["toggle"] and r.get("model") == v.get("model")]
        write_report(run_dir / "toggles" / toggle_dir(v["toggle"], v.get("model")),
                     build_report(f"{plan['run_id']}-{toggle_dir(v['toggle'], v.get('model'))}",
                                  f"{plan['command']}  # toggle {v['toggle']}{' on ' + v['model'] if v.get('model') else ''}",
                                  env, rows))
    report = build_report(plan["run_id"], plan["command"], env, results)
    report.update(suite={**plan["suite"], "checks": check_statuses(plan, results)}, verdicts=verdicts,
                  negative_controls=negative_controls(results), model_id=plan["model_id"])
    validate_report(report)

    def sections(safe: dict, views: dict[str, str]) -> None:     # in memory: the report is written as one set
        views["md"] = views["md"].replace("## Results", verdict_markdown(safe) + "## Results", 1)
        views["html"] = views["html"].replace("<h2>Results</h2>", verdict_html(safe) + "<h2>Results</h2>", 1)

    paths = write_report(run_dir, report, decorate=sections)
    safe = json.loads(paths["json"].read_text(encoding="utf-8"))
    from k3verify.suites.summary import build_summary
    paths["summary"] = atomic_write_json(run_dir / "summary.json", build_summary(plan, safe, run_dir))
    return safe, paths
