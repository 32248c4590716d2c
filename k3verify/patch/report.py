"""The report of `k3verify diff --base REV` and its CLI glue; the section `k3verify all --base` adds.

Writes the usual four files (report.json schema v1 with a "patch_diff" block, report.md and
report.html with the summary line on top, junit.xml) and summary.md: a Markdown summary
short enough for a merge-request comment (`--summary` prints it).
"""
from __future__ import annotations

import json
import sys
from html import escape
from pathlib import Path
from typing import Any, Callable

from ..errors import UsageError
from ..io import atomic_write_json, atomic_write_text
from .diff import Options, run

SUMMARY_FILE = "summary.md"
MAX_TABLE_ROWS = 15
MAX_FAILURES = 5


def _cell(x: Any) -> str:
    return str("" if x is None else x).replace("|", "\\|").replace("\n", " ")


def _num(x: Any, spec: str = ".2g") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else ""


def summary_markdown(result: dict, verdict: str, report_md: str | None = None) -> str:
    """A merge-request comment: verdict, the summary line, what moved, why it failed."""
    meta, summary, rows = result["meta"], result["summary"], result["rows"]
    base, head = meta["base"], meta["head"]
    dirty = " + uncommitted changes" if head.get("dirty") else ""
    lines = [f"### k3verify patch diff: {verdict.upper()}", "", f"**{summary['line']}**", "",
             f"REV `{base['short']}` ({base['how']}) -> working tree `{(head.get('commit') or '?')[:10]}`{dirty}; "
             f"model `{str(meta.get('model_id'))[:23]}`; numerics `{meta.get('env_key')}`"]
    changed = [r for r in rows if (r.get("evidence") or {}).get("change") == "changed"]
    if changed:
        lines += ["", "| toggle | scenario | tensor | first divergence | max ULP | max abs | KL max | argmax flips "
                      "| status |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in changed[:MAX_TABLE_ROWS]:
            f = (r.get("findings") or [{}])[0]
            first = r.get("first_divergence") or {}
            where = ", ".join(f"{k} {first[k]}" for k in ("request", "position", "num_tokens", "layer", "step")
                              if first.get(k) is not None and not (k == "step" and first[k] < 0))
            flips = f"{f['argmax_flips']}/{f['n_rows']}" if "n_rows" in f else ""
            lines.append("| " + " | ".join(_cell(c) for c in (
                r["toggle"], r["scenario"], r["check"].removeprefix("base_diff."), where, f.get("max_ulp"),
                _num(f.get("max_abs")), _num(f.get("kl_max")), flips, r["status"])) + " |")
        if len(changed) > MAX_TABLE_ROWS:
            lines.append(f"| ... {len(changed) - MAX_TABLE_ROWS} more changed rows in the report | | | | | | | | |")
    bad = [r for r in rows if r["status"] in ("fail", "error")]
    if bad:
        lines += ["", "Failures:"]
        lines += [f"- {r['toggle']} / {r['check']} / {r.get('scenario') or '-'}: {_cell(r['reason'])[:300]}"
                  for r in bad[:MAX_FAILURES]]
        if len(bad) > MAX_FAILURES:
            lines.append(f"- ... {len(bad) - MAX_FAILURES} more in the report")
    c, t = meta["cache"], meta["timings"]
    base_how = (f"{c['hits']} units from the cache" if not c["computed"] else
                f"{c['computed']} units run, {c['hits']} from the cache")
    lines += ["", f"REV side: {base_how} ({t.get('base_s', 0):.1f} s); working tree {t.get('head_s', 0):.1f} s; "
                  f"contracts {t.get('contracts_s', 0):.1f} s; total {t.get('total_s', 0):.1f} s"
              + (f". Full report: `{report_md}`" if report_md else "")]
    return "\n".join(lines) + "\n"


def write(out_dir: Path, run_id: str, command: str, result: dict) -> tuple[dict, dict]:
    """The four report files plus summary.md; report.json is the last file written."""
    from ..report import build_report, environment_fingerprint, write_report
    from ..report.environment import git_state

    meta = result["meta"]
    env = environment_fingerprint(seeds={"scenario_seed": result["plan"]["seed"]}, extra={
        "numerics_key": meta["env_key"], "model": meta["model"], "git": git_state(meta["root"]),
        "dtype": (meta.get("model") or {}).get("dtype")})
    report = build_report(run_id, command, env, result["rows"])
    report["patch_diff"] = {"summary": result["summary"], "base": meta["base"], "head": meta["head"],
                            "plan": result["plan"], "cache": meta["cache"], "timings": meta["timings"],
                            "model_id": meta["model_id"], "base_model_id": meta["base_model_id"],
                            "env_key": meta["env_key"], "base_env_key": meta["base_env_key"]}
    paths = write_report(out_dir, report)
    safe = json.loads(paths["json"].read_text(encoding="utf-8"))
    verdict = safe["summary"]["verdict"]
    line = result["summary"]["line"]
    section = f"## Patch diff vs REV {meta['base']['short']}\n\n**{line}**\n\n"
    md = paths["md"].read_text(encoding="utf-8")
    atomic_write_text(paths["md"], md.replace("## Results", section + "## Results", 1))
    page = paths["html"].read_text(encoding="utf-8")
    atomic_write_text(paths["html"], page.replace(
        "<h2>Results</h2>", f"<h2>Patch diff vs REV {escape(meta['base']['short'])}</h2><p><b>{escape(line)}</b></p>"
                            "<h2>Results</h2>", 1))
    paths["summary"] = Path(out_dir) / SUMMARY_FILE
    atomic_write_text(paths["summary"], summary_markdown(result, verdict, str(paths["md"])))
    atomic_write_json(paths["json"], safe, allow_nan=False)
    return safe, paths


def options_from_args(args, progress: Callable[[str], None]) -> Options:
    if getattr(args, "world_size", 1) != 1:
        raise UsageError(f"--base runs at world size 1, got --world-size {args.world_size}")
    if getattr(args, "backend", "embedded") != "embedded":
        raise UsageError(f"--base compares the embedded stack, got --backend {args.backend}")
    return Options(repo=getattr(args, "repo", None), base=args.base, toggles=args.toggle, scenarios=args.scenario,
                   scale=args.scale, seed=args.seed, model=args.model, device=getattr(args, "device", "cpu"),
                   progress=progress)


def run_command(args) -> int:
    """`k3verify diff --base [REV]`: 0 the patch's changes are allowed, 1 not, 2 bad input."""
    from rich.table import Table

    from ..commands import REPORTS_DIR, console, emit_json
    from ..report import new_run_id

    progress = (lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    result = run(options_from_args(args, progress))
    run_id = new_run_id("patch-diff")
    out_dir = args.report_dir or REPORTS_DIR / run_id
    report, paths = write(out_dir, run_id, "k3verify " + " ".join(sys.argv[1:]), result)
    con = console()
    table = Table(title=f"diff --base {result['meta']['base']['short']}")
    for col in ("toggle", "scenario", "changed", "status", "reason"):
        table.add_column(col, overflow="fold")
    groups: dict[tuple, list[dict]] = {}
    for r in result["rows"]:
        groups.setdefault((r["toggle"], r["scenario"]), []).append(r)
    colour = {"pass": "green", "fail": "red", "skip": "yellow", "error": "magenta", "inconclusive": "yellow"}
    for (label, scenario), rs in groups.items():
        moved = [r["check"].removeprefix("base_diff.") for r in rs
                 if (r.get("evidence") or {}).get("change") == "changed"]
        worst = next((s for s in ("error", "fail", "pass", "skip") if any(r["status"] == s for r in rs)), "skip")
        mine = [r for r in rs if r["status"] == worst]
        why = next((r["reason"] for r in mine if (r.get("evidence") or {}).get("change") == "changed"),
                   mine[0]["reason"] if mine else "")
        table.add_row(label, scenario or "", ", ".join(moved) or "-", f"[{colour[worst]}]{worst}[/]", why[:200])
    con.print(table)
    con.print(result["summary"]["line"])
    verdict = report["summary"]["verdict"]
    con.print(f"verdict: {verdict}  report: {paths['md']}  summary: {paths['summary']}")
    if getattr(args, "summary", False):
        sys.stdout.write(paths["summary"].read_text(encoding="utf-8"))
    if args.json:
        emit_json({"run_id": run_id, "verdict": verdict, "report": str(paths["json"]), "summary": report["summary"],
                   "patch_diff": result["summary"]["line"], "summary_md": str(paths["summary"])})
    return 0 if verdict == "pass" else 1


# ---- `k3verify all --base REV` ------------------------------------------------------------

def suite_scope(plan: dict) -> tuple[list[str] | None, list[str] | None, float]:
    """(toggles, scenarios, scale) a suite names. A suite that runs the selftest covers every
    toggle on the scenarios that exercise it (None, None); otherwise the toggles and scenarios
    of its diff/drift units. The scale is the largest the suite uses, so what it exercises
    (eviction, preemption at full scale) is exercised here too."""
    units = [u for u in plan["units"] if u["kind"] in ("diff", "drift", "selftest")]
    scale = max((float(u["options"].get("scale", 1.0)) for u in units), default=1.0)
    if not units or any(u["kind"] == "selftest" for u in units):
        return None, None, scale
    toggles = list(dict.fromkeys(u["toggle"] for u in units if u.get("toggle")))
    scenarios = list(dict.fromkeys(u["scenario"] for u in units if u.get("scenario")))
    return toggles or None, scenarios or None, scale


def suite_section(plan: dict, run_dir: Path, base: str, progress: Callable[[str], None],
                  repo: str | None = None) -> tuple[list[dict], str]:
    """(results for the combined report, the summary line): the patch diff against `base` over
    what the suite names, its own report in run_dir/patch-diff/. Rows are filed under the toggle
    "patch-diff" (the label moves into the check name), so they fail the run when they fail but
    never count as a toggle's contract evidence. A resumed run reuses the section when it was
    made against the same REV."""
    from .diff import checkout_root, resolve_base

    out = run_dir / "patch-diff"
    root = checkout_root(repo)
    sha = resolve_base(root, base)["sha"]
    try:
        done = json.loads((out / "report.json").read_text(encoding="utf-8"))
        if done["patch_diff"]["base"]["sha"] == sha:
            return _section_rows(done["results"]), done["patch_diff"]["summary"]["line"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    toggles, scenarios, scale = suite_scope(plan)
    result = run(Options(repo=str(root), base=base, toggles=toggles, scenarios=scenarios, scale=scale,
                         model=plan.get("model"), progress=progress))
    report, _ = write(out, f"{plan['run_id']}-patch-diff", f"{plan['command']}  # patch diff", result)
    return _section_rows(report["results"]), result["summary"]["line"]


def _section_rows(rows: list[dict]) -> list[dict]:
    return [{**r, "toggle": "patch-diff", "check": f"{r['toggle']}/{r['check']}", "section": "patch_diff",
             "section_report": "patch-diff/report.md"} for r in rows]
