"""`k3verify selftest`: prove every check can fail (each mutant caught and localised) and
every real toggle passes (the `selftest` check kind: kinds/selftest.py). Exit 0 only if all hold."""
from __future__ import annotations

from pathlib import Path

from rich.table import Table

from k3verify.commands import (add_device_flag, device_load_options, add_json_flag, add_model_flag, console, emit_json,
                               model_load_options)

NAME = "selftest"
HELP = "run every toggle and every seeded-fault mutant; exit 0 only if all mutants are caught"


def add_arguments(parser) -> None:
    parser.add_argument("--report-dir", type=Path, help="where to write the report (default reports/<run-id>)")
    parser.add_argument("--scale", type=float, default=1.0, help="scenario size multiplier")
    add_model_flag(parser)
    add_device_flag(parser)
    add_json_flag(parser)


def run(args) -> int:
    from k3verify.commands import _check
    from k3verify.kinds.base import CheckSpec, Context
    from optimized_stack import load_model

    units = _check.plan(CheckSpec(NAME, options={"scale": args.scale}))
    model = load_model(args.model, **device_load_options(args), **model_load_options(args))
    with Context(model, model_arg=args.model) as ctx:
        results = _check.run_units(units, ctx, "selftest", log_prefix="  selftest ")
    run_id, report, paths = _check.write("selftest", args.report_dir, model, results)
    table = Table(title="selftest")
    from k3verify.report.render_md import events_cell
    for col in ("toggle", "kind", "scenario", "status", "caught", "events", "localised to", "reason"):
        table.add_column(col, overflow="fold")
    rows = report["results"]
    for r in rows:
        loc = (r.get("localization") or {}).get("component") or ""
        caught = "" if r["caught"] is None else str(r["caught"]).lower()
        table.add_row(r["toggle"], r["kind"], r["scenario"] or "", r["status"], caught, events_cell(r), loc,
                      r["reason"][:70])
    con = console()
    con.print(table)
    verdict = report["summary"]["verdict"]
    mutants = [r for r in rows if r["kind"] == "mutant" and r["status"] != "skip"]
    from k3verify.suites.verdicts import localisation
    loc = localisation(rows)
    acc = "-" if loc["localisation_accuracy"] is None else f"{100 * loc['localisation_accuracy']:.0f}%"
    con.print(f"mutants caught: {sum(bool(r['caught']) for r in mutants)}/{len(mutants)}  localised where they live: "
              f"{loc['localised']}/{loc['localisable']} ({acc})  verdict: {verdict}  report: {paths['md']}")
    if args.json:
        emit_json({"run_id": run_id, "verdict": verdict, "report": str(paths["json"]), "summary": report["summary"],
                   "localisation": loc,
                   "events": {r["toggle"]: (r.get("evidence") or {}).get("events", {}) for r in rows}})
    return 0 if verdict == "pass" else 1
