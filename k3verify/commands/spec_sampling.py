"""`k3verify spec-sampling`: sampled speculation's distribution contract (check kind
spec_sampling): the rejection-sampling rule against plain sampling, n seeded sequences per arm,
chi-square at --alpha, and each seeded fault, which must be rejected at the same n. With
--engine-samples N the engine itself is judged too (N requests per arm on the model).
Exit 0 when the rule holds and every fault is caught, 1 otherwise, 2 on bad input.
"""
from __future__ import annotations

from pathlib import Path

from rich.table import Table

from k3verify.commands import add_json_flag, add_model_flag, console, emit_json, model_load_options

NAME = "spec-sampling"
HELP = "sampled speculation (temperature > 0) judged statistically against plain sampling, with its mutants"


def add_arguments(parser) -> None:
    from k3verify.kinds.spec_sampling import OPTIONS
    parser.add_argument("--samples", type=int, default=OPTIONS["samples"], metavar="N",
                        help=f"sequences per arm for the rule (default {OPTIONS['samples']}: power 0.9 for a "
                             "total-variation shift of 0.01 at alpha 1e-3)")
    parser.add_argument("--alpha", type=float, default=OPTIONS["alpha"], help="significance level (default 1e-3)")
    parser.add_argument("--drafter", action="append", choices=("ngram", "model"), default=None,
                        help="the drafter's q: ngram (a point mass) or model; repeatable (default both)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the toy chain and both arms' streams")
    parser.add_argument("--engine-samples", type=int, default=0, metavar="N",
                        help="also judge the engine: N requests per arm on --model (default 0: off)")
    parser.add_argument("--report-dir", type=Path, help="where to write the report (default reports/<run-id>)")
    add_model_flag(parser)
    add_json_flag(parser)


def run(args) -> int:
    from k3verify.commands import _check
    from k3verify.kinds.base import CheckSpec, Context

    spec = CheckSpec("spec_sampling", options={"samples": args.samples, "alpha": args.alpha,
                                                "drafters": args.drafter or ["ngram", "model"],
                                                "seed": args.seed, "engine_samples": args.engine_samples})
    units = _check.plan(spec)
    model = None
    if args.engine_samples:
        from optimized_stack import load_model
        model = load_model(args.model, **model_load_options(args))
    with Context(model, model_arg=args.model) as ctx:
        results = _check.run_units(units, ctx, NAME)
    run_id, report, paths = _check.write(NAME, args.report_dir, model, results, seeds={"seed": args.seed})
    table = Table(title=f"sampled speculation, alpha {args.alpha:g}")
    for col in ("subject", "on", "status", "reason"):
        table.add_column(col, overflow="fold")
    for r in report["results"]:
        table.add_row(r["toggle"], r["scenario"] or "-", r["status"], r["reason"])
    con = console()
    con.print(table)
    verdict = report["summary"]["verdict"]
    con.print(f"verdict: {verdict}  report: {paths['md']}")
    if args.json:
        emit_json({"run_id": run_id, "verdict": verdict, "report": str(paths["json"]),
                   "results": [{"subject": r["toggle"], "kind": r["kind"], "on": r["scenario"], "status": r["status"],
                                "p_values": {k: v["p_value"] for k, v in
                                             r.get("evidence", {}).get("distribution", {}).get("verdicts", {}).items()}}
                               for r in report["results"]]})
    return 0 if verdict == "pass" else 1
