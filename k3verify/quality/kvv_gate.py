"""The KVV gates: one result per KVV contract check or imported benchmark score, plus an
inconclusive result when none of them passed (all skipped: no evidence either way).
"""
from __future__ import annotations

from k3verify.quality.gate_run import GateRun
from k3verify.verdict.result import Result, Subject
from optimized_stack.errors import K3Error


def _nothing_passed(subject: Subject, check: str, what: str, results: list[Result], scenario: str) -> list[Result]:
    """[an inconclusive result] when no result passed and none failed: all skipped is no evidence."""
    statuses = [r.status for r in results]
    if "pass" in statuses or "fail" in statuses or "error" in statuses:
        return []
    reasons = "; ".join(dict.fromkeys(r.reason for r in results))[:300]
    return [Result.inconclusive(subject, check, f"inconclusive: none of the {len(results)} {what} passed, every "
                                                f"one was skipped ({reasons})", scenario=scenario)]


def kvv_gate(kvv_out: dict, seconds: float = 0.0) -> GateRun:
    """run_kvv's output -> one result per contract check (pass / fail / skip with its reason)."""
    checks = kvv_out["checks"]
    if not checks:
        raise K3Error("run_kvv returned no checks; expected at least one")
    each = seconds / len(checks)
    scenario = f"{kvv_out['model']} @ {kvv_out['endpoint']}"
    endpoint = Subject("endpoint", contract="KVV API contract")
    results = [Result.make(c["status"], endpoint, f"kvv/{c['name']}", c["reason"] or c["status"], scenario=scenario,
                           duration_s=each) for c in checks]
    results += _nothing_passed(endpoint, "kvv/any-check", "KVV contract checks", results, scenario)
    return GateRun("kvv", results, {k: kvv_out[k] for k in ("endpoint", "model", "summary", "passed")})


def kvv_import_gate(imported: dict) -> GateRun:
    """import_kvv_results's output -> one result per benchmark held against its vendor range."""
    results = [Result.make(b["status"], Subject("kvv-import", contract=f"vendor range [{b['low']:g}, {b['high']:g}]"),
                           f"kvv/{b['name']}", b["reason"], scenario=imported["source"], score=b["score"],
                           low=b["low"], high=b["high"])
               for b in imported["benchmarks"]]
    results += _nothing_passed(Subject("kvv-import", contract="vendor ranges"), "kvv/any-benchmark",
                               "imported benchmark scores", results, imported["source"])
    return GateRun("kvv-import", results, {k: imported[k] for k in ("source", "ranges_version", "summary", "passed")})
