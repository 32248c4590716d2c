"""The run report's shape (report.json), version 1, and its validator.

report.json is the machine-readable truth; the Markdown, HTML and JUnit views are
rendered from the same dict. The validator checks structure before anything is
written: required keys and their types, closed vocabularies (kind, status,
verdict), and that the summary counts agree with the results. Extra keys are
allowed (a result may carry "per_step", "accuracy", "contract_detail" ...), so
the gate can add evidence without a schema bump; removing or retyping a key
needs SCHEMA_VERSION + 1.

The fields of a result and the statuses come from one place, verdict/result.py (the
Result every check returns); this module only reads them.

Verdict rule: "fail" when a result failed or errored; else "inconclusive" when a
result is inconclusive (a gate that ran but could not decide, e.g. too few questions
for its margin) and counts; else "nothing_verified" when every result was skipped or not
exercised (or there is none): no check compared anything, so the run proves nothing and is
not a pass (the summary's "reason" says so: "no check compared anything: 4 not exercised,
0 passed"); else "pass". Every verdict but "pass" exits 1. Skips and not-exercised results
beside at least one pass do not fail a run, but they are counted, never as a pass, and each
states its reason; so does every inconclusive result.

A result may carry "role": "smoke" (ROLES): a smoke test whose pass or inconclusive
counts toward no verdict (its inconclusive leaves the run's verdict alone); its fail
or error still fails the run, since a smoke test that breaks is broken.

Version-1 reports written before "inconclusive" or "not_exercised" existed have no such
summary count; the validator reads a missing count as 0.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Iterable, Mapping

from k3verify.verdict.result import KINDS, ROLES, STATUS_TABLE, STATUSES, schema_fields

SCHEMA_VERSION = 1

VERDICTS = ("pass", "fail", "inconclusive", "nothing_verified")
# statuses that compared nothing: a run made only of these verified nothing
UNVERIFIED = ("skip", "not_exercised")

# key -> (accepted types, nullable)
_TOP_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "schema_version": ((int,), False),
    "run_id": ((str,), False),
    "created": ((str,), False),
    "command": ((str,), False),
    "environment": ((dict,), False),
    "results": ((list,), False),
    "summary": ((dict,), False),
}
_RESULT_FIELDS = schema_fields()         # verdict/result.py: the Result dataclass is the field list
# summary key -> the status it counts
SUMMARY_COUNTS = {s.summary_key: s.name for s in STATUS_TABLE}
# absent from reports written before the status existed (read as 0)
_OPTIONAL_COUNTS = ("inconclusive", "not_exercised")
_SUMMARY_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    **{key: ((int,), False) for key in SUMMARY_COUNTS if key not in _OPTIONAL_COUNTS},
    "verdict": ((str,), False),
}


def _type_name(types: tuple[type, ...]) -> str:
    names = {"str": "string", "int": "integer", "float": "number", "dict": "object", "list": "array", "bool": "boolean"}
    return " or ".join(dict.fromkeys(names.get(t.__name__, t.__name__) for t in types))


def _check_fields(obj: Mapping[str, Any], fields: dict[str, tuple[tuple[type, ...], bool]], where: str) -> None:
    for key, (types, nullable) in fields.items():
        if key not in obj:
            raise ValueError(f"{where}: missing required field {key!r}")
        value = obj[key]
        if value is None and nullable:
            continue
        # bool is an int in Python; a count or a version that arrives as true/false is still wrong.
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            expected = _type_name(types) + (" or null" if nullable else "")
            raise ValueError(f"{where}.{key}: expected {expected}, got {type(value).__name__} {value!r:.60}")


def _check_choice(value: str, allowed: Iterable[str], where: str) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{where}: expected one of {', '.join(allowed)}, got {value!r}")


def summarize(results: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The summary block that matches `results` (what validate_report expects)."""
    results = list(results)
    statuses = [r.get("status") for r in results]
    out: dict[str, Any] = {key: statuses.count(status) for key, status in SUMMARY_COUNTS.items()}
    undecided = any(r.get("status") == "inconclusive" and r.get("role") != "smoke" for r in results)
    if out["failed"] or out["errors"]:
        out["verdict"] = "fail"
    elif undecided:
        out["verdict"] = "inconclusive"
    elif all(s in UNVERIFIED for s in statuses):
        out["verdict"] = "nothing_verified"
        out["reason"] = nothing_verified_reason(out)
    else:
        out["verdict"] = "pass"
    return out


def nothing_verified_reason(summary: Mapping[str, Any]) -> str:
    """'no check compared anything: 4 not exercised, 0 passed' (skips named when there are any)."""
    parts = [f"{summary.get('not_exercised', 0)} not exercised"]
    if summary.get("skipped"):
        parts.insert(0, f"{summary['skipped']} skipped")
    return f"no check compared anything: {', '.join(parts)}, {summary.get('passed', 0)} passed"


def validate_result(result: Any, where: str = "result") -> None:
    if not isinstance(result, dict):
        raise ValueError(f"{where}: expected object, got {type(result).__name__}")
    _check_fields(result, _RESULT_FIELDS, where)
    _check_choice(result["kind"], KINDS, f"{where}.kind")
    _check_choice(result["status"], STATUSES, f"{where}.status")
    if result["duration_s"] < 0:
        raise ValueError(f"{where}.duration_s: expected >= 0, got {result['duration_s']}")
    if result.get("role") is not None:
        _check_choice(result["role"], ROLES, f"{where}.role")
    if result["status"] != "pass" and not result["reason"].strip():
        article = "an" if result["status"][0] in "aeiou" else "a"
        raise ValueError(f"{where}.reason: {article} {result['status']} must state its reason, got an empty string")
    for j, finding in enumerate(result["findings"]):
        if not isinstance(finding, dict):
            raise ValueError(f"{where}.findings[{j}]: expected object, got {type(finding).__name__}")


def validate_report(obj: Any) -> None:
    """Raise ValueError with a one-line reason when obj is not a valid version-1 report."""
    if not isinstance(obj, dict):
        raise ValueError(f"report: expected object, got {type(obj).__name__}")
    _check_fields(obj, _TOP_FIELDS, "report")
    if obj["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"report.schema_version: expected {SCHEMA_VERSION}, got {obj['schema_version']!r}")
    if not obj["run_id"]:
        raise ValueError("report.run_id: expected a non-empty string, got ''")
    try:
        datetime.fromisoformat(obj["created"].replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"report.created: expected an ISO 8601 timestamp, got {obj['created']!r}") from None
    for i, result in enumerate(obj["results"]):
        validate_result(result, f"report.results[{i}]")
    summary = obj["summary"]
    _check_fields(summary, _SUMMARY_FIELDS, "report.summary")
    _check_choice(summary["verdict"], VERDICTS, "report.summary.verdict")
    expected = summarize(obj["results"])
    for key in _OPTIONAL_COUNTS:
        if key in summary and (not isinstance(summary[key], int) or isinstance(summary[key], bool)):
            raise ValueError(f"report.summary.{key}: expected integer, got {type(summary[key]).__name__}")
    for key in (*SUMMARY_COUNTS, "verdict"):
        got = summary.get(key, 0) if key in _OPTIONAL_COUNTS else summary[key]
        if got != expected[key]:
            raise ValueError(f"report.summary.{key}: results give {expected[key]!r}, summary says {got!r}")
