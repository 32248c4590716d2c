"""Release sign-off: one Markdown document from a `k3verify all` report, and the verdict
views (Markdown / HTML) that the combined report embeds.

Signed off exactly when:
- the report is a `k3verify all` report (it carries the suite and the verdicts);
- no result failed or errored (the report's own verdict is pass);
- every [[check]] of the suite passed: a check skipped as a whole (a quality gate not
  available in this build, golden hashes missing for this environment) is not evidence;
- no toggle was rejected.
Skipped single results and skipped toggles do not block, but every one is listed under
open risks with its reason, and a skipped toggle's speedup is never counted.
"""
from __future__ import annotations

import hashlib
import html
import json
from typing import Any, Mapping

from k3verify.report.render_md import format_mapping, format_speedup, interval, num

VERDICT_ORDER = {"rejected": 0, "skipped": 1, "counted": 2}


def _cell(value: Any) -> str:
    return ("" if value is None else str(value)).replace("|", "\\|").replace("\n", " ")


def _verdict_rows(report: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for v in sorted(report.get("verdicts", []), key=lambda v: (VERDICT_ORDER.get(v["verdict"], 9), v["toggle"])):
        evidence = v["reason"]
        if v.get("first_divergence"):
            evidence += f" (first divergence: {format_mapping(v['first_divergence'])})"
        ev = v.get("events") or {}
        if ev.get("declared"):
            fired = ", ".join(f"{e}={n}" for e, n in ev.get("fired", {}).items())
            evidence += f" [events {len(ev['declared']) - len(ev.get('missing', []))}/{len(ev['declared'])}: {fired}]"
        rows.append([v["toggle"] + (f"@{v['model']}" if v.get("model") else ""), v["contract"], v["verdict"].upper() if v["verdict"] == "rejected" else v["verdict"],
                     evidence, format_speedup(v.get("speedup")) or "-", v.get("report") or ""])
    return rows


def verdict_markdown(report: Mapping[str, Any]) -> str:
    """'## Toggle verdicts' and '## Suite checks' sections (ends with a blank line)."""
    lines = ["## Toggle verdicts", "", "| toggle | contract | verdict | evidence | counted speedup | diff report |",
             "|---|---|---|---|---|---|"]
    for row in _verdict_rows(report):
        row[5] = f"[{row[5]}]({row[5]})" if row[5] else ""
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    nc = report.get("negative_controls") or {}
    if nc.get("total"):
        lines += ["", f"Negative controls: {nc['caught']}/{nc['total']} mutants caught."]
    suite = report.get("suite") or {}
    lines += ["", f"## Suite checks ({suite.get('name', '?')} v{suite.get('version', '?')})", "",
              "| check | kind | status | pass | fail | skip | error | reason |", "|---|---|---|---|---|---|---|---|"]
    for c in suite.get("checks", []):
        n = c.get("counts", {})
        lines.append("| " + " | ".join(_cell(x) for x in (c["name"], c["kind"], c["status"], n.get("pass"), n.get("fail"),
                                                           n.get("skip"), n.get("error"), c.get("reason"))) + " |")
    return "\n".join(lines) + "\n\n"


def verdict_html(report: Mapping[str, Any]) -> str:
    colour = {"counted": "#1a7f37", "REJECTED": "#cf222e", "skipped": "#9a6700"}
    out = ["<h2>Toggle verdicts</h2>", "<table><tr><th>toggle</th><th>contract</th><th>verdict</th>"
           "<th>evidence</th><th>counted speedup</th><th>diff report</th></tr>"]
    for row in _verdict_rows(report):
        link = f'<a href="{html.escape(row[5])}">{html.escape(row[5])}</a>' if row[5] else ""
        cells = [html.escape(c) for c in row[:5]]
        cells[2] = f'<b style="color:{colour.get(row[2], "#000")}">{cells[2]}</b>'
        out.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + f"<td>{link}</td></tr>")
    out.append("</table>")
    nc = report.get("negative_controls") or {}
    if nc.get("total"):
        out.append(f"<p>Negative controls: {nc['caught']}/{nc['total']} mutants caught.</p>")
    return "\n".join(out) + "\n"


def report_sha256(report: Mapping[str, Any]) -> str:
    """sha256 of the report's content (canonical JSON: sorted keys, no whitespace)."""
    return hashlib.sha256(json.dumps(report, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def problems(report: Mapping[str, Any]) -> list[str]:
    """Why the report cannot be signed off; empty when it can."""
    if "suite" not in report or "verdicts" not in report:
        return ["not a `k3verify all` report (no suite or verdicts in it)"]
    out = []
    s = report["summary"]
    if s["verdict"] != "pass":
        out.append(f"{s['failed']} checks failed, {s['errors']} errored and "
                   f"{s.get('inconclusive', 0)} were inconclusive")
    for c in report["suite"].get("checks", []):
        if c["status"] != "pass":
            out.append(f"suite check {c['name']!r} ({c['kind']}) {c['status']}" + (f": {c['reason']}" if c.get("reason") else ""))
    out += [f"toggle {v['toggle']}{'@' + v['model'] if v.get('model') else ''} rejected: {v['reason']}"
            for v in report["verdicts"] if v["verdict"] == "rejected"]
    return out


def _quality_lines(results: list[Mapping[str, Any]]) -> list[str]:
    lines = []
    for r in results:
        if not r.get("gate"):
            continue
        acc = r.get("accuracy")
        text = ""
        if isinstance(acc, Mapping) and "acc_ref" in acc:
            text = (f"reference {num(acc.get('acc_ref')):.4f}, candidate {num(acc.get('acc_cand')):.4f}, "
                    f"paired d {acc.get('d')}, lower bound {acc.get('lower_bound')} vs margin -{acc.get('margin')}, "
                    f"McNemar p {acc.get('mcnemar_p')}, n {acc.get('n')}"
                    + (f", MDE {acc['mde']}" if acc.get("mde") is not None else ""))
        elif isinstance(acc, list):
            parts = []
            for a in acc:
                if isinstance(a, Mapping):
                    lo, hi = interval(a)
                    val = num(a.get("value", a.get("accuracy")))
                    ci = f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else ""
                    parts.append(f"{a.get('name', a.get('label', ''))} {val if val is None else f'{val:.3f}'}{ci}".strip())
            text = "; ".join(parts)
        lines.append(f"| {_cell(r['gate'])} | {_cell(r['toggle'])} | {_cell(r['check'])} | {_cell(r.get('scenario') or '')} "
                     f"| {r['status']} | {_cell(text or r['reason'])} |")
    return lines


def render_signoff(report: Mapping[str, Any]) -> tuple[str, bool]:
    """(Markdown document, signed off?)."""
    why_not = problems(report)
    signed = not why_not
    env = report.get("environment", {})
    model = env.get("model") or {}
    git = env.get("git") or {}
    cpu = env.get("cpu") or {}
    suite = report.get("suite") or {}
    results = report.get("results", [])
    lines = [f"# Release sign-off: {suite.get('name', '?')} suite, run `{report['run_id']}`", "",
             f"**{'SIGNED-OFF' if signed else 'NOT SIGNED-OFF'}**", "",
             f"- report: created {report['created']}, sha256 `{report_sha256(report)}`",
             f"- command: `{report['command']}`",
             f"- suite: {suite.get('name')} v{suite.get('version')} ({suite.get('path')}, sha256 {str(suite.get('sha256'))[:16]})",
             "", "## Model and environment", "",
             f"- model: {model.get('source') or '?'}" + (f", weights sha256 `{model['sha256']}`" if model.get("sha256") else ""),
             f"- config: {format_mapping(model.get('config'))}, dtype {env.get('dtype')}",
             f"- git: {git.get('commit') or 'unknown'}{' (dirty tree)' if git.get('dirty') else ''}",
             f"- python {env.get('python')}, torch {env.get('torch')}, numpy {env.get('numpy')}",
             f"- cpu: {cpu.get('model')} ({cpu.get('capability')}), {env.get('num_threads')} threads; "
             f"cuda: {env.get('cuda_device') or 'none'}",
             f"- numerics key (golden hashes): {env.get('numerics_key')}", ""]
    own = [f"{c['name']} on {c['model']}" for c in (report.get("suite") or {}).get("checks", []) if c.get("model")]
    if own:          # checks that name their own model (verdicts `toggle@model`)
        lines[-1:] = [f"- checks on their own model (same device; the run's dtype unless the model says "
                      f"`:float32` or `:bfloat16`): {', '.join(own)}", ""]
    lines += [verdict_markdown(report).rstrip(), ""]
    golden = [r for r in results if r["check"] == "golden"]
    if golden:
        lines += ["## Golden reference hashes", ""]
        lines += [f"- {r.get('scenario') or 'all'}: {r['status']}: {r['reason']}" for r in golden]
        lines.append("")
    quality = _quality_lines(results)
    lines += ["## Quality gates", ""]
    if quality:
        lines += ["| gate | toggle | check | cell | status | result (intervals) |", "|---|---|---|---|---|---|", *quality]
    else:
        lines.append("No quality gate ran in this suite.")
    risks = list(dict.fromkeys(f"{r['toggle']} / {r['check']}" + (f" / {r['scenario']}" if r.get("scenario") else "")
                               + f": {r['reason']}" for r in results if r["status"] == "skip"))
    risks += [f"toggle {v['toggle']}{'@' + v['model'] if v.get('model') else ''} not counted: {v['reason']}"
              for v in report.get("verdicts", [])
              if v["verdict"] == "skipped"]
    if git.get("dirty"):
        risks.append("the working tree had uncommitted changes when the run was made")
    lines += ["", "## Open risks", ""]
    lines += [f"- {_cell(r)}" for r in risks] or ["- none"]
    lines += ["", "## Decision", ""]
    lines += [f"- blocks sign-off: {_cell(p)}" for p in why_not] or ["- every check the suite requires passed"]
    lines += ["", "SIGNED-OFF" if signed else "NOT SIGNED-OFF"]
    return "\n".join(lines) + "\n", signed
