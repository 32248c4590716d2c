"""`k3verify bench`: interleaved A/B timing; a toggle's speedup is *counted* only when its
contract passed in the same run. `--capture-overhead` times hash capture itself."""
from __future__ import annotations

from rich.table import Table

from k3verify.commands import add_json_flag, add_model_flag, console, emit_json
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
    model = load_model(args.model)
    rows = []
    if args.capture_overhead:
        rows.append(bench.capture_overhead(model, scale=args.scale, repeats=args.repeats))
    for t in args.toggle or ():
        rows.append(bench.bench_toggle(model, t, workload_name=args.workload, scale=args.scale,
                                       repeats=args.repeats))
    table = Table(title=f"interleaved A/B ({args.repeats} pairs, warm-up excluded)")
    for col in ("A", "B", "tok/s A", "tok/s B", "A/B time ratio", "95% CI", "counted"):
        table.add_column(col)
    for r in rows:
        counted = ("yes" if r["counted"] else f"no: {r['why']}") if "counted" in r else f"overhead {r['overhead']:+.1%}"
        table.add_row(r["a"], r["b"], f"{r['tokens_per_s_a']:.1f}", f"{r['tokens_per_s_b']:.1f}",
                      f"{r['ratio']:.3f}", f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]", counted)
    console().print(table)
    if args.json:
        emit_json(rows)
    return 0
