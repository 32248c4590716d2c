"""`k3verify bench`: interleaved A/B timing; a toggle's speedup is *counted* only when its
contract passed in the same run (the `bench` check kind: kinds/bench.py). `--capture-overhead`
times hash capture itself. Writes DIR/report.json (one result per timing, the speedup on it),
.md, .html, junit.xml."""
from __future__ import annotations

from pathlib import Path

from rich.table import Table

from k3verify.commands import (add_device_flag, device_load_options, add_json_flag, add_model_flag, console, emit_json, model_load_options)
from k3verify.errors import UsageError

NAME = "bench"
HELP = "interleaved A/B speed of a toggle vs the reference (counted only if its contract held)"


def add_arguments(parser) -> None:
    parser.add_argument("--toggle", action="append", metavar="T", help="toggle to time (repeatable)")
    parser.add_argument("--workload", default="decode", choices=("agentic", "decode", "prefill"))
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--capture-overhead", action="store_true", help="time hash capture against no capture")
    parser.add_argument("--report-dir", type=Path, help="where to write the report (default reports/<run-id>)")
    add_model_flag(parser)
    add_device_flag(parser)
    add_json_flag(parser)


def spec_of(args):
    from k3verify.kinds.base import CheckSpec

    if not args.toggle and not args.capture_overhead:
        raise UsageError("bench needs --toggle T or --capture-overhead")
    return CheckSpec(NAME, options={"toggles": list(args.toggle) if args.toggle else None, "workload": args.workload,
                                    "scale": args.scale, "repeats": args.repeats,
                                    "capture_overhead": args.capture_overhead})


def run(args) -> int:
    from k3verify.commands import _check
    from k3verify.kinds.base import Context
    from optimized_stack import load_model

    units = _check.plan(spec_of(args))             # builds the workloads: a bad --scale is refused here
    model = load_model(args.model, **device_load_options(args), **model_load_options(args))
    with Context(model, model_arg=args.model) as ctx:
        results = _check.run_units(units, ctx, NAME, log_prefix="  timing ")
    run_id, report, paths = _check.write(NAME, args.report_dir, model, results,
                                         seeds={"scenario_seed": 0, "repeats": args.repeats})
    rows = [r["row"] for r in report["results"]]
    table = Table(title=f"interleaved A/B ({args.repeats} pairs, warm-up excluded)")
    for col in ("A", "B", "tok/s A", "tok/s B", "A/B time ratio", "95% CI", "HBM roofline A / B", "counted"):
        table.add_column(col)
    for r in rows:
        counted = ("yes" if r["counted"] else f"no: {r['why']}") if "counted" in r else f"overhead {r['overhead']:+.1%}"
        roof = (f"{r['roofline_reference']['roofline_fraction']:.2%} / {r['roofline_candidate']['roofline_fraction']:.2%}"
                if "roofline_candidate" in r else "-")
        if r.get("ratio") is None:                 # not timed (the toggle does not run here)
            table.add_row(r["a"], r["b"], "-", "-", "-", "-", "-", counted)
            continue
        table.add_row(r["a"], r["b"], f"{r['tokens_per_s_a']:.1f}", f"{r['tokens_per_s_b']:.1f}",
                      f"{r['ratio']:.3f}", f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]", roof, counted)
    con = console()
    con.print(table)
    con.print(f"report: {paths['md']}")
    if args.json:             # the rows, as before (the report's path is in --report-dir or on stderr)
        emit_json(rows)
    return 0
