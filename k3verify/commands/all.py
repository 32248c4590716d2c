"""`k3verify all`: run a check suite end to end and write one combined report.

    k3verify all [--suite premerge|release|gpu|FILE] [--model M] [--device cpu|cuda] [--dtype float32|bfloat16]
                 [--report-dir DIR] [--resume RUN_ID]

A suite names its models: a check with `model = "k3-dims"` runs on that model (on the run's
device and dtype), the rest on --model.

Every finished unit is on disk before the next starts, so after a kill (even -9)
`k3verify all --resume RUN_ID` runs only what is missing and writes the same report.
Exit 0 when every check passed, 1 when one failed (a toggle rejected, a mutant not
caught, a gate failed), 2 when the run could not be made (bad suite, unknown toggle).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.table import Table

from k3verify import kinds
from k3verify.commands import (REPORTS_DIR, add_device_flag, add_json_flag, add_model_flag, command_line, console,
                               device_load_options, emit_json, model_load_options)
from k3verify.commands._progress import Item, RunProgress
from k3verify.errors import UsageError
from k3verify.verdict.result import STATUSES

NAME = "all"
HELP = "run a check suite (premerge, release or FILE): every toggle, gate and control; one report, a verdict per toggle"
COLOURS = {"pass": "green", "fail": "red", "skip": "yellow", "error": "magenta", "inconclusive": "yellow",
           "not_exercised": "yellow", "counted": "green", "rejected": "red", "skipped": "yellow"}


def add_arguments(parser) -> None:
    parser.add_argument("--suite", default=None, metavar="NAME|FILE",
                        help="built-in suite (premerge, release) or a suite .toml file (default: premerge)")
    parser.add_argument("--report-dir", type=Path, metavar="DIR",
                        help="run directory (default reports/<run-id>); with --resume, the run directory to resume")
    parser.add_argument("--resume", metavar="RUN_ID", help="finish an interrupted run: skip its finished checks")
    parser.add_argument("--base", nargs="?", const="@merge-base", default=None, metavar="REV",
                        help="add the patch diff against git revision REV (default: the merge base with main) "
                             "for the suite's toggles: `k3verify diff --base`, as a section of this report")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="run the suite's units in N processes (grouped by model and scenario; the cores split "
                             "between them, which changes the numerics key of golden hashes); one report (default 1)")
    parser.add_argument("--shard", default=None, metavar="I/N",
                        help="internal: run shard I of N of a resumed run's units and write no report (a worker "
                             "of --jobs)")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help="start no unit after S seconds: the units left are inconclusive rows naming the "
                             "limit (not recorded, so --resume runs them), the verdict is never pass; a gate "
                             "with a time budget (the GPU release suite: 600 s) still writes its report")
    parser.add_argument("--finish-by", type=float, default=None, metavar="S",
                        help="start a unit only when its expected seconds (the suite's measured priors, else its "
                             "kind's) end before S seconds: a unit that would be killed by a hard stop at S is left "
                             "for --resume instead of run half; the units left are inconclusive rows, as with "
                             "--time-limit")
    parser.add_argument("--only", default=None, metavar="T[,T...]",
                        help="run only the suite's units of these toggles (an approx toggle with its mutants: every "
                             "gate the suite holds it to, before it joins the full run); the report says the run "
                             "was restricted and `signoff` refuses it")
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)   # a worker's: epoch s
    parser.add_argument("--finish-deadline", type=float, default=None, help=argparse.SUPPRESS)  # likewise
    add_model_flag(parser)
    add_device_flag(parser)
    add_json_flag(parser)


class Display:
    """The progress line (units done/total, elapsed, ETA from per-kind costs) and a live
    per-toggle count on a terminal (stderr); off a terminal one plain line per unit on stderr.
    Units report into it as a kinds.base.Progress (note / done / advance)."""

    def __init__(self, units: list):
        items = [Item(u.id, u.kind, kinds.cost_s(u)) for u in units]
        self.counts: dict[str, dict[str, int]] = {}
        self.bar = RunProgress("all", items, extra=self._table)
        self.running = False

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)

    def _table(self) -> Table:
        table = Table(title="so far", show_lines=False)
        for col in ("toggle", *STATUSES):
            table.add_column(col)
        for toggle, n in self.counts.items():
            table.add_row(toggle, *(f"[{COLOURS[s]}]{n[s]}[/]" if n[s] else "0" for s in STATUSES))
        return table

    def start(self, unit) -> None:
        self.running = True
        self.bar.step(f"{unit.id} ...")

    def note(self, message: str) -> None:
        self.bar.note("  " + message)              # off a terminal: indented under its unit's line

    def advance(self, n: int = 1) -> None:         # a unit's own items (questions) are not units
        pass

    def done(self, message: str) -> None:         # a unit's own item finished (a needle case)
        self.note(message)

    def unit_done(self, unit, rows: list[dict]) -> None:
        for r in rows:
            n = self.counts.setdefault(r["toggle"], dict.fromkeys(STATUSES, 0))
            n[r["status"]] += 1
        if self.running:
            self.bar.finish()
        else:                                  # finished in an earlier attempt (--resume)
            self.bar.skip()
        self.running = False


def verdict_table(report: dict) -> Table:
    table = Table(title=f"k3verify all: {report['suite']['name']} ({report['run_id']})")
    for col in ("toggle", "contract", "verdict", "events fired", "counted speedup", "why"):
        table.add_column(col, overflow="fold")
    from k3verify.report.render_md import format_speedup
    for v in report["verdicts"]:
        ev = v.get("events") or {}
        fired = f"{len(ev.get('declared', [])) - len(ev.get('missing', []))}/{len(ev.get('declared', []))}" if ev else "-"
        name = v["toggle"] + (f"@{v['model']}" if v.get("model") else "")
        table.add_row(name, v["contract"], f"[{COLOURS[v['verdict']]}]{v['verdict']}[/]", fired,
                      format_speedup(v.get("speedup")) or "-", v["reason"][:160])
    return table


def _worker_args(args) -> list[str]:
    """The flags a worker needs besides --resume / --shard (device and dtype come from the plan)."""
    return ([*(["--allow-nonfinite-weights"] if args.allow_nonfinite_weights else []),
             *(["--allow-weight-cast"] if args.allow_weight_cast else []),
             *(["--deadline", repr(args.deadline)] if args.deadline is not None else []),
             *(["--finish-deadline", repr(args.finish_deadline)] if args.finish_deadline is not None else [])])


def _run_shard(plan: dict, model, run_dir: Path, shard: tuple[int, int], args) -> int:
    from k3verify.suites import run_all
    from k3verify.suites.shards import assign
    i, n = shard
    mine = assign(run_all.plan_units(plan), n, plan.get("priors"))
    _, ran = run_all.execute(plan, model, run_dir, load_options=model_load_options(args),
                             only=lambda u: mine[u.id] == i, deadline=args.deadline, steal=True,
                             finish_deadline=args.finish_deadline, finish_by_s=args.finish_by)
    print(f"shard {i}/{n} of {plan['run_id']}: {ran} units run", file=sys.stderr)
    return 0


def _run_jobs(plan: dict, model, run_dir: Path, args) -> int:
    """Shards 1..N-1 in worker processes, shard 0 here; returns the units run here. A worker that
    fails is reported; its unfinished units are run by the caller's final pass."""
    import torch

    from k3verify.suites import run_all
    from k3verify.suites.shards import assign, start_workers, threads_per_job
    run_all.write_plan(plan, run_dir)
    run_all.check_finished(plan, run_dir)             # a foreign checks file: exit 2 before starting anyone
    units = run_all.plan_units(plan)
    mine = assign(units, args.jobs, plan.get("priors"))
    run_all.clear_claims(run_dir)                     # claims of an earlier attempt: claimable again
    procs = start_workers(plan["run_id"], run_dir, args.jobs, _worker_args(args))
    torch.set_num_threads(threads_per_job(args.jobs))      # the workers' count: one numerics environment
    try:
        with Display([u for u in units if mine[u.id] == 0]) as display:
            _, ran = run_all.execute(plan, model, run_dir, display=display, load_options=model_load_options(args),
                                     only=lambda u: mine[u.id] == 0, deadline=args.deadline, steal=True,
                                     finish_deadline=args.finish_deadline, finish_by_s=args.finish_by)
    except BaseException:
        for _, proc, _ in procs:            # Ctrl-C or a usage error here: the workers stop too (resumable)
            proc.terminate()
        raise
    finally:
        for i, proc, log in procs:
            rc = proc.wait()
            if rc != 0:
                print(f"k3verify all: worker {i}/{args.jobs} exited {rc} (log: {log}); its unfinished units run here",
                      file=sys.stderr)
    return ran


def _resume_dir(args) -> Path:
    if args.report_dir:
        return args.report_dir
    p = Path(args.resume)
    return p if (p / "plan.json").is_file() else REPORTS_DIR / args.resume


def run(args) -> int:
    from k3verify.report import new_run_id
    from k3verify.suites import run_all, verdicts
    from k3verify.suites.suite import load_suite
    from optimized_stack import load_model

    command = command_line()
    started = time.time()
    if args.time_limit is not None:
        if not (args.time_limit > 0 and args.time_limit < 1e7):      # NaN fails both
            raise UsageError(f"--time-limit must be a number of seconds in (0, 1e7), got {args.time_limit}")
        if args.shard is not None:
            raise UsageError("--time-limit is the parent's; a --shard worker gets its deadline from it")
        args.deadline = time.time() + args.time_limit
    if args.finish_by is not None:
        if not (args.finish_by > 0 and args.finish_by < 1e7):
            raise UsageError(f"--finish-by must be a number of seconds in (0, 1e7), got {args.finish_by}")
        if args.shard is not None:
            raise UsageError("--finish-by is the parent's; a --shard worker gets its deadline from it")
        args.finish_deadline = time.time() + args.finish_by
    if isinstance(args.jobs, bool) or not 1 <= args.jobs <= 64:
        raise UsageError(f"--jobs must be an integer in 1..64, got {args.jobs}")
    only = tuple(dict.fromkeys(t.strip() for t in (args.only or "").split(",") if t.strip()))
    if args.only is not None and not only:
        raise UsageError(f"--only: expected a comma-separated list of toggle names, got {args.only!r}")
    if only and args.resume:
        raise UsageError("--only restricts a new run; a resumed run keeps the units its plan recorded")
    shard = None
    if args.shard is not None:
        from k3verify.suites.shards import parse_shard
        shard = parse_shard(args.shard)
        if not args.resume or args.jobs != 1:
            raise UsageError("--shard I/N is a worker of `all --jobs`: it needs --resume RUN_ID and no --jobs")
    if args.resume:
        run_dir = _resume_dir(args)
        plan = run_all.load_plan(run_dir)
        named_dir = Path(args.resume).resolve() == run_dir.resolve()
        if not named_dir and plan.get("run_id") != args.resume:
            raise UsageError(f"--resume {args.resume}: {run_dir} holds run {plan.get('run_id')!r}, not {args.resume!r}; "
                             f"resume that run by its id or choose its directory")
        ran_as = (plan["suite"]["name"], plan["suite"]["path"], plan["suite"]["name"].split(".")[0])  # release.cuda
        if args.suite and args.suite not in ran_as:
            raise UsageError(f"--resume {plan['run_id']} ran suite {plan['suite']['name']!r}, got --suite {args.suite!r}")
        if args.model and args.model != plan["model"]:
            raise UsageError(f"--resume {plan['run_id']} ran model {plan['model']!r}, got --model {args.model!r}")
        placed = {"device": plan.get("device", "cpu"), "dtype": plan.get("dtype", "float32")}
        asked = {"device": args.device, "dtype": args.dtype}
        if asked != placed and asked != {"device": "cpu", "dtype": "float32"}:
            raise UsageError(f"--resume {plan['run_id']} ran on {placed['device']} {placed['dtype']}, "
                             f"got --device {args.device} --dtype {args.dtype}")
        args.device, args.dtype = placed["device"], placed["dtype"]
        model = load_model(plan["model"], **device_load_options(args), **model_load_options(args))
        run_all.check_model(plan, model)
        run_all.check_finished(plan, run_dir)       # checks files of another model, suite or plan: exit 2 now
    else:
        suite = load_suite(args.suite or "premerge", args.device)
        model = load_model(args.model, **device_load_options(args), **model_load_options(args))
        run_id = new_run_id("all")
        run_dir = args.report_dir or REPORTS_DIR / run_id     # a --report-dir holding a run: refused by the CLI
        plan = run_all.new_plan(suite, args.model, model, run_id, command, device=args.device, dtype=args.dtype,
                                only=only)
    # every value a unit would refuse was refused when the suite was parsed: exit 2 before any work
    if args.base is not None:               # a bad REV: exit 2 before any work
        from k3verify.patch.diff import checkout_root, resolve_base
        resolve_base(checkout_root(None), args.base)
    if shard is not None:                   # a worker: its units only, no report
        return _run_shard(plan, model, run_dir, shard, args)
    run_all.write_plan(plan, run_dir)       # the attempt is on file even if it is killed mid-unit
    run_all.record_attempt(run_dir, started, None)
    if args.jobs > 1:
        _run_jobs(plan, model, run_dir, args)
        run_all.release_device_memory()        # the final pass may rerun a unit deferred for memory, alone
    with Display(run_all.plan_units(plan)) as display:     # all units; what the jobs left is run here
        results, ran = run_all.execute(plan, model, run_dir, display=display, load_options=model_load_options(args),
                                       deadline=args.deadline, time_limit_s=args.time_limit,
                                       finish_deadline=args.finish_deadline, finish_by_s=args.finish_by)
    ran = run_all.units_finished_since(run_dir, started)      # the workers' units too
    con = console()
    patch_line = None
    if args.base is not None:               # issue 21: a section of its own, not a unit of the plan
        from k3verify.patch.report import suite_section
        patch_rows, patch_line = suite_section(plan, run_dir, args.base,
                                               lambda msg: print(f"    {msg}", file=sys.stderr, flush=True))
        results = results + patch_rows
    run_all.record_attempt(run_dir, started, time.time(), ran)      # release_suite_s sums the attempts
    report, paths = verdicts.write_combined(plan, model, run_dir, results)
    con.print(verdict_table(report))
    s, nc = report["summary"], report["negative_controls"]
    counted = sum(v["verdict"] == "counted" for v in report["verdicts"])
    undecided = f", {s['inconclusive']} inconclusive" if s.get("inconclusive") else ""
    if s.get("reason"):
        con.print(f"{s['verdict']}: {s['reason']}")
    con.print(f"verdict: {s['verdict']}  ({s['passed']} pass, {s['failed']} fail, {s['skipped']} skip, "
              f"{s['errors']} error{undecided}; toggles counted {counted}/{len(report['verdicts'])}; "
              f"mutants caught {nc['caught']}/{nc['total']}, localised where they live "
              f"{nc.get('localised', 0)}/{nc.get('localisable', 0)}; {ran} of {len(plan['units'])} units run now)")
    if patch_line:
        con.print(f"patch diff: {patch_line}  ({run_dir / 'patch-diff' / 'summary.md'})")
    con.print(f"report: {paths['md']}  junit: {paths['junit']}  summary: {paths['summary']}  "
              f"resume with: --resume {plan['run_id']}")
    if args.json:
        emit_json({"run_id": plan["run_id"], "verdict": s["verdict"], "report": str(paths["json"]), "summary": s,
                   "verdicts": {v["toggle"]: v["verdict"] for v in report["verdicts"]}})
    return 0 if s["verdict"] == "pass" else 1
