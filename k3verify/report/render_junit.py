"""junit.xml for CI: one <testsuite> per toggle, one <testcase> per result.

fail -> <failure message=reason>, error -> <error message=reason>, skip ->
<skipped message=reason>, inconclusive -> <skipped message="inconclusive: reason"> (a gate
that could not decide is never reported as a passing test), not_exercised -> <skipped
message="not exercised: reason"> (the toggle's code path never ran: never a pass). The
element per status is verdict/result.py STATUS_TABLE's. The body of a failure carries the
comparator's finding text and the first divergence. A run whose verdict is nothing_verified
(every result skipped or not exercised) gets one more testsuite, "k3verify.verdict", holding a
failing testcase with the reason: the run exits 1, and a set of skips alone reads green in CI. Built with ElementTree so attributes and text are
escaped; characters XML 1.0 cannot hold at all (most C0 controls) are replaced.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any, Mapping

from k3verify.report.render_md import failure_details, format_speedup, num
from k3verify.verdict.result import STATUS

_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")
_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _clean(value: Any) -> str:
    return _XML_INVALID.sub("\ufffd", "" if value is None else str(value))


def _seconds(value: Any) -> float:
    x = num(value)
    return x if x is not None and x >= 0 and x != float("inf") else 0.0


def _case_name(r: Mapping[str, Any]) -> str:
    scenario = r.get("scenario")
    return f"{r.get('check', '?')}[{scenario}]" if scenario else str(r.get("check", "?"))


def _failure_body(r: Mapping[str, Any]) -> str:
    where, messages = failure_details(r)
    return "\n\n".join([f"{label}: {text}" for label, text in where] + messages) or str(r.get("reason", ""))


def render_junit(report: Mapping[str, Any]) -> str:
    results = [r for r in report.get("results", []) if isinstance(r, Mapping)]
    by_toggle: dict[str, list[Mapping[str, Any]]] = {}
    for r in results:
        by_toggle.setdefault(str(r.get("toggle", "?")), []).append(r)

    root = ET.Element("testsuites", name=_clean(f"k3verify {report.get('run_id', '')}"))
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time": 0.0}
    for toggle, rows in by_toggle.items():
        counts = {"tests": len(rows),
                  "failures": sum(r.get("status") == "fail" for r in rows),
                  "errors": sum(r.get("status") == "error" for r in rows),
                  "skipped": sum(STATUS[r["status"]].junit == "skipped" for r in rows if r.get("status") in STATUS),
                  "time": sum(_seconds(r.get("duration_s")) for r in rows)}
        for key, value in counts.items():
            totals[key] += value
        suite = ET.SubElement(root, "testsuite", name=_clean(toggle), timestamp=_clean(report.get("created", "")),
                              **{k: (f"{v:.3f}" if k == "time" else str(v)) for k, v in counts.items()})
        props = ET.SubElement(suite, "properties")
        first = rows[0]
        for key in ("kind", "contract"):
            ET.SubElement(props, "property", name=key, value=_clean(first.get(key, "")))
        for r in rows:
            case = ET.SubElement(suite, "testcase", name=_clean(_case_name(r)),
                                 classname=_clean("k3verify." + _ID_UNSAFE.sub("_", toggle)),
                                 time=f"{_seconds(r.get('duration_s')):.3f}")
            status, reason = r.get("status"), _clean(r.get("reason", ""))
            if status == "fail":
                ET.SubElement(case, "failure", message=reason, type="CheckFailed").text = _clean(_failure_body(r))
            elif status == "error":
                ET.SubElement(case, "error", message=reason, type="Error").text = _clean(_failure_body(r))
            elif status == "skip":
                ET.SubElement(case, "skipped", message=reason)
            elif status in STATUS and STATUS[status].junit == "skipped":      # inconclusive, not exercised
                label = STATUS[status].label
                shown = reason if label in reason else f"{label}: {reason}"
                ET.SubElement(case, "skipped", message=shown, type=label.title().replace(" ", ""))
            extra = []
            if r.get("role") == "smoke":
                extra.append("role: smoke (counts toward no verdict; a failure still fails)")
            if r.get("caught") is not None:
                extra.append(f"caught: {r['caught']}")
            if r.get("speedup"):
                extra.append(f"speedup: {format_speedup(r['speedup'])}")
            if extra:
                ET.SubElement(case, "system-out").text = _clean("\n".join(extra))
    summary = report.get("summary") if isinstance(report.get("summary"), Mapping) else {}
    if summary.get("verdict") == "nothing_verified":
        # every testcase above is a skip, which CI reads as green; the run exits 1, so one failing
        # testcase says why (a run that verified nothing is not a pass)
        suite = ET.SubElement(root, "testsuite", name="k3verify.verdict", tests="1", failures="1", errors="0",
                              skipped="0", time="0.000")
        case = ET.SubElement(suite, "testcase", name="run_verdict", classname="k3verify.verdict", time="0.000")
        reason = _clean(summary.get("reason") or "nothing verified")
        ET.SubElement(case, "failure", message=f"nothing_verified: {reason}", type="NothingVerified").text = reason
        totals["tests"] += 1
        totals["failures"] += 1
    for key, value in totals.items():
        root.set(key, f"{value:.3f}" if key == "time" else str(value))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
