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

A release configuration (the suite's `ships`, or `k3verify signoff --ships`) signs what a release
turns on instead of everything the gate judged. A toggle that ships must be counted (on one model
at least) and rejected on none. A judged toggle that does not ship may fail or stay undecided: that
is the gate keeping it off, and the document lists it as off in this release with its reason. What
still blocks, whatever ships: an errored result (never a verdict), a unit the run did not reach (an
incomplete run is not the suite), a mutant not caught (the gate is blind to it), a failed or
undecided row of anything but a non-shipped optimization (the reference, the served endpoint, an
invariance control), and a suite check skipped as a whole.
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


def configuration(report: Mapping[str, Any], ships: list[str] | tuple[str, ...] | None = None) -> tuple[str, ...] | None:
    """The configuration a sign-off signs: `ships` when given, else the suite's, else None (all)."""
    if ships is not None:
        return tuple(ships)
    declared = (report.get("suite") or {}).get("ships")
    return tuple(declared) if declared is not None else None


def _not_run(r: Mapping[str, Any]) -> bool:
    """A unit the run did not reach (run_all.out_of_time tags its row, as suites/summary.py counts it)."""
    return r.get("not_run") is not None


def _by_toggle(report: Mapping[str, Any]) -> dict[str, list[Mapping[str, Any]]]:
    """toggle -> its verdicts, one per model it was judged on."""
    out: dict[str, list[Mapping[str, Any]]] = {}
    for v in report.get("verdicts", []):
        out.setdefault(v["toggle"], []).append(v)
    return out


def _label(v: Mapping[str, Any]) -> str:
    return v["toggle"] + (f"@{v['model']}" if v.get("model") else "")


def configuration_problems(report: Mapping[str, Any], ships: tuple[str, ...]) -> list[str]:
    """Why `ships` cannot be signed off from this report; empty when it can (module docstring)."""
    from optimized_stack import toggles as registry
    optimizations = {t.name for t in registry.all_toggles("optimization")}
    results = report.get("results", [])
    out = []
    errors = [r for r in results if r["status"] == "error"]
    if errors:
        out.append(f"{len(errors)} results errored, first {errors[0]['toggle']} / {errors[0]['check']}: "
                   f"{str(errors[0].get('reason', ''))[:200]}")
    not_run = [r for r in results if _not_run(r)]
    if not_run:
        units = sorted({r.get("unit") or f"{r['toggle']}/{r['check']}" for r in not_run})
        out.append(f"the run is incomplete: {len(units)} units not run ({str(not_run[0]['reason'])[:160]})")
    nc = report.get("negative_controls") or {}
    if nc.get("total") and nc.get("caught", 0) < nc["total"]:
        out.append(f"{nc['total'] - nc.get('caught', 0)} of {nc['total']} mutants not caught: the gate is blind to them")
    shipped = set(ships)
    for r in results:
        if r["status"] not in ("fail", "inconclusive", "not_exercised") or _not_run(r):
            continue
        if r.get("kind") == "optimization" and r["toggle"] in optimizations and r["toggle"] not in shipped:
            continue       # the gate keeping a toggle that does not ship off: listed, not blocking
        where = f"{r['toggle']}{'@' + r['model'] if r.get('model') else ''} / {r['check']}" + \
                (f" / {r['scenario']}" if r.get("scenario") else "")
        out.append(f"{where}: {r['status']}: {str(r.get('reason', ''))[:200]}")
    for c in (report.get("suite") or {}).get("checks", []):
        if c["status"] == "skip":
            out.append(f"suite check {c['name']!r} ({c['kind']}) skipped as a whole" + (f": {c['reason']}" if c.get("reason") else ""))
    verdicts = _by_toggle(report)
    for name in ships:
        vs = verdicts.get(name, [])
        if not vs:
            out.append(f"shipped toggle {name}: no verdict in this report (the suite never judged it)")
            continue
        out += [f"shipped toggle {_label(v)} rejected: {v['reason']}" for v in vs if v["verdict"] == "rejected"]
        if not any(v["verdict"] == "counted" for v in vs):
            out.append(f"shipped toggle {name} counted on no model: " + "; ".join(f"{_label(v)}: {v['reason']}" for v in vs))
    return list(dict.fromkeys(out))


def problems(report: Mapping[str, Any], ships: list[str] | tuple[str, ...] | None = None) -> list[str]:
    """Why the report cannot be signed off; empty when it can. With a configuration (`ships`, or the
    suite's), the rules of configuration_problems; without one, every judged toggle must hold."""
    if "suite" not in report or "verdicts" not in report:
        return ["not a `k3verify all` report (no suite or verdicts in it)"]
    if report["suite"].get("only"):
        return [f"the run judged part of suite {report['suite'].get('name')!r} (--only "
                f"{','.join(report['suite']['only'])}): a release is signed from a run of the whole suite"]
    config = configuration(report, ships)
    if config is not None:
        return configuration_problems(report, config)
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


def configuration_markdown(report: Mapping[str, Any], ships: tuple[str, ...], source: str) -> list[str]:
    """'## Release configuration': what ships with its verdicts, and every judged toggle kept off."""
    verdicts = _by_toggle(report)
    lines = ["## Release configuration", "", f"Signed for these toggles on ({source}); every other judged toggle is off "
             "in this release.", "", "| ships | verdicts |", "|---|---|"]
    for name in ships:
        lines.append(f"| {name} | " + _cell("; ".join(f"{_label(v)}: {v['verdict']}" for v in verdicts.get(name, []))
                                            or "not judged") + " |")
    off = [(name, vs) for name, vs in verdicts.items() if name not in ships]
    if off:
        lines += ["", "| off in this release | verdict | why |", "|---|---|---|"]
        for name, vs in sorted(off, key=lambda kv: (min(VERDICT_ORDER.get(v["verdict"], 9) for v in kv[1]), kv[0])):
            for v in vs:
                lines.append(f"| {_cell(_label(v))} | {v['verdict']} | {_cell(v['reason'])} |")
    return lines + [""]


def render_signoff(report: Mapping[str, Any], ships: list[str] | tuple[str, ...] | None = None) -> tuple[str, bool]:
    """(Markdown document, signed off?); `ships` as in problems()."""
    why_not = problems(report, ships)
    signed = not why_not
    config = configuration(report, ships)
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
    if config is not None:
        lines += configuration_markdown(report, config, "`k3verify signoff --ships`" if ships is not None
                                        else "the suite's `ships`")
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
    lines += [f"- blocks sign-off: {_cell(p)}" for p in why_not] or (
        [f"- every toggle that ships is counted, every mutant caught, and nothing else failed: signed for "
         f"{', '.join(config)}"] if config is not None else ["- every check the suite requires passed"])
    lines += ["", "SIGNED-OFF" if signed else "NOT SIGNED-OFF"]
    return "\n".join(lines) + "\n", signed
