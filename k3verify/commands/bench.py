"""`k3verify bench`: interleaved A/B timing; a toggle's speedup is *counted* only when its
contract passed in the same run. `--capture-overhead` times hash capture itself."""
from __future__ import annotations

from rich.table import Table

from k3verify.commands import (add_device_flag, add_json_flag, add_model_flag, console, emit_json,
                               model_load_options, requested_device)
from k3verify.errors import UsageError

NAME = "bench"
HELP = "interleaved A/B speed of a toggle vs the reference (counted only if its contract held)"


def add_arguments(parser) -> None:
    parser.add_argument("--toggle", action="append", metavar="T", help="toggle to time (repeatable)")
    parser.add_argument("--workload", default="decode", choices=("agentic", "decode", "prefill"))
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--capture-overhead", action="store_true", help="time hash capture against no capture")
    add_model_flag(parser)
    add_device_flag(parser)
    add_json_flag(parser)


def run(args) -> int:
    if not args.toggle and not args.capture_overhead:
        raise UsageError("bench needs --toggle T or --capture-overhead")
    if args.repeats < 2:
        raise UsageError(f"--repeats must be >= 2 for an interval, got {args.repeats}")
    from optimized_stack import load_model
    from optimized_stack import toggles as registry

    from k3verify import bench

    for t in args.toggle or ():
        registry.get(t)
    device = requested_device(args)
    model = load_model(args.model, device=device, **model_load_options(args))
    hbm = None
    if device == "cuda" and args.workload == "decode":
        from k3verify.gpu_bench import hbm_copy_bandwidth
        hbm = hbm_copy_bandwidth()
    rows = []
    if args.capture_overhead:
        rows.append(bench.capture_overhead(model, scale=args.scale, repeats=args.repeats))
    for t in args.toggle or ():
        rows.append(bench.bench_toggle(model, t, workload_name=args.workload, scale=args.scale,
                                       repeats=args.repeats, hbm_bytes_per_s=hbm))
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
    console().print(table)
    if args.json:
        emit_json(rows)
    return 0
