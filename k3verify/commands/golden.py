"""`k3verify golden record|update|check`: has the reference path itself drifted?

record/update: run the reference path on the fixed golden scenarios and write their
capture hashes to golden/hashes/<numerics-env>.json with the reason (required).
check: re-run and compare; exit 0 when bit-identical, 1 with the first divergent
location (scenario, request, position/step, tensor, layer) when not. A numerics
environment with no recorded hashes is a skip with the reason (bits legitimately differ
across torch builds, SIMD levels, devices, dtypes and thread counts), and an entry with no
scenarios compares nothing: both verify nothing, so the verdict is nothing_verified, exit 1
(report/schema.py summarize). A --dir that does not exist is a typo: exit 2, before any work;
record/update refuse a --dir they could not write, before any work.
"""
from __future__ import annotations

from pathlib import Path

from rich.table import Table

from k3verify.commands import add_json_flag, add_model_flag, console, emit_json, model_load_options
from k3verify.errors import UsageError

NAME = "golden"
HELP = "record or check the reference path's golden capture hashes for this numerics environment"


def add_arguments(parser) -> None:
    parser.add_argument("action", choices=("record", "update", "check"),
                        help="record/update: (re)write this environment's hashes; check: compare against them")
    parser.add_argument("--reason", default=None, help="why the hashes are (re)recorded (required for record/update)")
    parser.add_argument("--dir", type=Path, default=None, metavar="DIR", help="golden hash directory (default golden/hashes)")
    add_model_flag(parser)
    add_json_flag(parser)


def run(args) -> int:
    from k3verify.compare import golden
    from optimized_stack import load_model

    from k3verify.io import check_writable_dir
    from k3verify.kinds import golden as golden_kind
    from k3verify.report.schema import summarize

    directory = args.dir or golden.GOLDEN_DIR
    # refused before the model loads and the reference runs (~2 min at K3 dims): a typo in --dir
    # is not an environment without hashes, and a record into a read-only --dir would die at its end
    if args.action == "check":
        golden.check_dir(directory)
    else:
        check_writable_dir(directory, "--dir")
    model = load_model(args.model, **model_load_options(args))
    con = console()
    key = golden.env_key(golden.numerics_environment(model))
    if args.action in ("record", "update"):
        if not args.reason:
            raise UsageError(f"golden {args.action} needs --reason TEXT: say why the reference hashes change")
        path = golden.record(model, args.reason, directory)
        con.print(f"recorded golden hashes for {golden.model_id(model)[:30]} on {key}: {path}")
        if args.json:
            emit_json({"action": args.action, "env_key": key, "path": str(path)})
        return 0
    gc = golden.check(model, directory)
    table = Table(title=f"golden check ({key})")
    for col in ("scenario", "status", "reason"):
        table.add_column(col, overflow="fold")
    for v in gc.scenarios:
        table.add_row(v.scenario, v.status, v.reason)
    if gc.scenarios:
        con.print(table)
    con.print(f"golden: {gc.status}: {gc.reason}")
    # the run's verdict by the report's rule: a skip or an empty entry compared nothing (exit 1)
    summary = summarize(r.to_dict() for r in golden_kind.results(gc))
    verdict = summary["verdict"]
    con.print(f"verdict: {verdict}" + (f" ({summary['reason']})" if summary.get("reason") else ""))
    if args.json:
        emit_json({"status": gc.status, "reason": gc.reason, "env_key": gc.env_key, "path": gc.path,
                   "verdict": verdict,
                   "scenarios": [{"scenario": v.scenario, "status": v.status, "first_divergence": v.first_divergence}
                                 for v in gc.scenarios]})
    return 0 if verdict == "pass" else 1
