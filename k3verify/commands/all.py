"""`k3verify all`: run a check suite end to end and write one combined report.

    k3verify all [--suite premerge|release|FILE] [--model M] [--report-dir DIR] [--resume RUN_ID]

Every finished unit is on disk before the next starts, so after a kill (even -9)
`k3verify all --resume RUN_ID` runs only what is missing and writes the same report.
Exit 0 when every check passed, 1 when one failed (a toggle rejected, a mutant not
caught, a gate failed), 2 when the run could not be made (bad suite, unknown toggle).
"""
from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from k3verify.commands import add_json_flag, add_model_flag, console, emit_json
from k3verify.errors import UsageError

NAME = "all"
HELP = "run a check suite (premerge, release or FILE): every toggle, gate and control; one report, a verdict per toggle"
REPO = Path(__file__).resolve().parents[2]
COLOURS = {"pass": "green", "fail": "red", "skip": "yellow", "error": "magenta", "inconclusive": "yellow",
           "counted": "green", "rejected": "red", "skipped": "yellow"}
STATUSES = ("pass", "fail", "skip", "error", "inconclusive")  # report/schema.py STATUSES


def add_arguments(parser) -> None:
    parser.add_argument("--suite", default=None, metavar="NAME|FILE",
                        help="built-in suite (premerge, release) or a suite .toml file (default: premerge)")
    parser.add_argument("--report-dir", type=Path, metavar="DIR",
                        help="run directory (default reports/<run-id>); with --resume, the run directory to resume")
    parser.add_argument("--resume", metavar="RUN_ID", help="finish an interrupted run: skip its finished checks")
    parser.add_argument("--base", nargs="?", const="@merge-base", default=None, metavar="REV",
                        help="add the patch diff against git revision REV (default: the merge base with main) "
                             "for the suite's toggles: `k3verify diff --base`, as a section of this report")
    add_model_flag(parser)
    add_json_flag(parser)


class Display:
    """Progress bar and a live per-toggle summary on a terminal; one line per unit otherwise."""

    def __init__(self, plan: dict, con):
        self.con, self.units = con, plan["units"]
        self.counts: dict[str, dict[str, int]] = {}
        self.live_mode = con.is_terminal
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=con)
        self.task = self.progress.add_task("starting", total=len(self.units))
        self.live = Live(self._render(), console=con, refresh_per_second=4) if self.live_mode else None

    def __enter__(self):
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live:
            self.live.__exit__(*exc)

    def _render(self):
        table = Table(title="so far", show_lines=False)
        for col in ("toggle", *STATUSES):
            table.add_column(col)
        for toggle, n in self.counts.items():
            table.add_row(toggle, *(f"[{COLOURS[s]}]{n[s]}[/]" if n[s] else "0" for s in STATUSES))
        return Group(self.progress, table)

    def start(self, unit: dict) -> None:
        self.progress.update(self.task, description=f"{unit['id']}")
        if not self.live_mode:
            print(f"  {unit['id']} ...", file=sys.stderr, flush=True)

    def step(self, message: str) -> None:
        self.progress.update(self.task, description=message[:70])
        if not self.live_mode:
            print(f"    {message}", file=sys.stderr, flush=True)

    def done(self, unit: dict, rows: list[dict]) -> None:
        for r in rows:
            n = self.counts.setdefault(r["toggle"], dict.fromkeys(STATUSES, 0))
            n[r["status"]] += 1
        self.progress.advance(self.task)
        if self.live:
            self.live.update(self._render())


def verdict_table(report: dict) -> Table:
    table = Table(title=f"k3verify all: {report['suite']['name']} ({report['run_id']})")
    for col in ("toggle", "contract", "verdict", "counted speedup", "why"):
        table.add_column(col, overflow="fold")
    from k3verify.report.render_md import format_speedup
    for v in report["verdicts"]:
        table.add_row(v["toggle"], v["contract"], f"[{COLOURS[v['verdict']]}]{v['verdict']}[/]",
                      format_speedup(v.get("speedup")) or "-", v["reason"][:160])
    return table


def _resume_dir(args) -> Path:
    if args.report_dir:
        return args.report_dir
    p = Path(args.resume)
    return p if (p / "plan.json").is_file() else REPO / "reports" / args.resume


def run(args) -> int:
    from optimized_stack import load_model

    from k3verify import run_all
    from k3verify.report import new_run_id
    from k3verify.suites import load_suite

    command = "k3verify " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["all"] else "k3verify all"
    if args.resume:
        run_dir = _resume_dir(args)
        plan = run_all.load_plan(run_dir)
        if args.suite and args.suite not in (plan["suite"]["name"], plan["suite"]["path"]):
            raise UsageError(f"--resume {plan['run_id']} ran suite {plan['suite']['name']!r}, got --suite {args.suite!r}")
        if args.model and args.model != plan["model"]:
            raise UsageError(f"--resume {plan['run_id']} ran model {plan['model']!r}, got --model {args.model!r}")
        model = load_model(plan["model"])
        run_all.check_model(plan, model)
    else:
        suite = load_suite(args.suite or "premerge")
        model = load_model(args.model)
        run_id = new_run_id("all")
        run_dir = args.report_dir or REPO / "reports" / run_id
        if (run_dir / "plan.json").is_file():
            raise UsageError(f"{run_dir} already holds a run; pass --resume to finish it or choose another --report-dir")
        plan = run_all.new_plan(suite, args.model, model, run_id, command)
    for unit in plan["units"]:               # bad gate arguments: exit 2 before any work
        if unit["kind"] in ("gsm8k", "needle", "kvv"):
            run_all.gate_args(unit, plan["model"], run_dir / "gates" / unit["id"])
    if args.base is not None:               # a bad REV: exit 2 before any work
        from k3verify.patch_diff import checkout_root, resolve_base
        resolve_base(checkout_root(None), args.base)
    con = console()
    with Display(plan, con) as display:
        results, ran = run_all.execute(plan, model, run_dir, display=display)
    patch_line = None
    if args.base is not None:               # issue 21: a section of its own, not a unit of the plan
        from k3verify.patch_report import suite_section
        patch_rows, patch_line = suite_section(plan, run_dir, args.base,
                                               lambda msg: print(f"    {msg}", file=sys.stderr, flush=True))
        results = results + patch_rows
    report, paths = run_all.write_combined(plan, model, run_dir, results)
    con.print(verdict_table(report))
    s, nc = report["summary"], report["negative_controls"]
    counted = sum(v["verdict"] == "counted" for v in report["verdicts"])
    undecided = f", {s['inconclusive']} inconclusive" if s.get("inconclusive") else ""
    con.print(f"verdict: {s['verdict']}  ({s['passed']} pass, {s['failed']} fail, {s['skipped']} skip, "
              f"{s['errors']} error{undecided}; toggles counted {counted}/{len(report['verdicts'])}; "
              f"mutants caught {nc['caught']}/{nc['total']}; {ran} of {len(plan['units'])} units run now)")
    if patch_line:
        con.print(f"patch diff: {patch_line}  ({run_dir / 'patch-diff' / 'summary.md'})")
    con.print(f"report: {paths['md']}  junit: {paths['junit']}  resume with: --resume {plan['run_id']}")
    if args.json:
        emit_json({"run_id": plan["run_id"], "verdict": s["verdict"], "report": str(paths["json"]), "summary": s,
                   "verdicts": {v["toggle"]: v["verdict"] for v in report["verdicts"]}})
    return 0 if s["verdict"] == "pass" else 1
