"""`k3verify bench`: interleaved A/B timing; a toggle's speedup is *counted* only when its
contract passed in the same run. `--capture-overhead` times hash capture itself.
Writes DIR/report.json (one result per timing, the speedup on it), .md, .html, junit.xml."""
from __future__ import annotations

import time
from pathlib import Path

from rich.table import Table

from k3verify.commands import (add_device_flag, add_json_flag, add_model_flag, command_line, console,
                               emit_json, model_load_options, requested_device)
from k3verify.commands._costs import bench_s
from k3verify.commands._progress import Item, RunProgress
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


def _items(args) -> list[Item]:
    from k3verify.perf import bench
    from k3verify.scenarios import workloads

    items = []
    if args.capture_overhead:
        tokens = bench.scenario_tokens(workloads.build("multi_length", scale=args.scale))
        items.append(Item("capture overhead", "capture", bench_s(tokens, args.repeats)))
    tokens = bench.scenario_tokens(bench.workload(args.workload, args.scale))
    items += [Item(t, "bench", bench_s(tokens, args.repeats)) for t in args.toggle or ()]
    return items


def _overhead_result(row: dict, duration_s: float) -> dict:
    """A measurement, not a toggle's speedup: its ratio is recorded and never counted."""
    from k3verify.suites.run_all import result

    return result(None, "capture_overhead", "pass",
                  f"hash capture costs {row['overhead']:+.1%} time against no capture ({row['repeats']} pairs)",
                  scenario="multi_length", duration_s=duration_s,
                  speedup={"ratio": row["ratio"], "ci": row["ci95"], "counted": False, "workload": "multi_length"})


def run(args) -> int:
    if not args.toggle and not args.capture_overhead:
        raise UsageError("bench needs --toggle T or --capture-overhead")
    if args.repeats < 2:
        raise UsageError(f"--repeats must be >= 2 for an interval, got {args.repeats}")
    from optimized_stack import load_model
    from optimized_stack import toggles as registry

    from k3verify.perf import bench
    from k3verify.kinds import diff as verify
    from k3verify.suites.run_all import bench_result

    for t in args.toggle or ():
        registry.get(t)
    items = _items(args)                       # builds the workloads: a bad --scale is refused here
    device = requested_device(args)
    model = load_model(args.model, device=device, **model_load_options(args))
    hbm = None
    if device == "cuda" and args.workload == "decode":
        from k3verify.perf.gpu_bench import hbm_copy_bandwidth
        hbm = hbm_copy_bandwidth()
    rows, results = [], []
    with RunProgress("bench", items, log_prefix="  timing ") as bar:
        if args.capture_overhead:
            bar.step("capture overhead")
            t0 = time.perf_counter()
            rows.append(bench.capture_overhead(model, scale=args.scale, repeats=args.repeats))
            results.append(_overhead_result(rows[-1], time.perf_counter() - t0))
        for t in args.toggle or ():
            bar.step(f"{t} on {args.workload}")
            t0 = time.perf_counter()
            rows.append(bench.bench_toggle(model, t, workload_name=args.workload, scale=args.scale,
                                           repeats=args.repeats, hbm_bytes_per_s=hbm))
            results.append(bench_result(rows[-1], time.perf_counter() - t0))
    run_id, default_dir = verify.default_report_dir("bench")
    report, paths = verify.write(args.report_dir or default_dir, run_id, command_line(), model, results,
                                 seeds={"scenario_seed": 0, "repeats": args.repeats})
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
