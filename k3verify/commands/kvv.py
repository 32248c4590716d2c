"""`k3verify kvv`: the Kimi Vendor Verifier API-contract checks, or KVV benchmark scores held to range.

    k3verify kvv --base-url http://127.0.0.1:8000/v1 [--model-name NAME]
    k3verify kvv --self                  # against `k3verify serve` started in-process
    k3verify kvv --self --stack counted  # ... serving the engine's fast path (its rows name the stack)
    k3verify kvv import results.json     # OCRBench / MMMU-Pro Vision / BEAM 1M / DeepSWE vs vendor ranges

Each check becomes one report result, pass / fail / skip with its reason; a skip
says what it would need (most often a real K3 endpoint). The API key, if any, is
read from OPENAI_API_KEY.
"""
from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.table import Table

from k3verify.commands import add_device_flag, add_json_flag, add_model_flag, device_load_options, console, emit_json, model_load_options
from k3verify.errors import UsageError

NAME = "kvv"
HELP = "Kimi Vendor Verifier: API-contract checks against an endpoint, or `kvv import FILE` of benchmark scores"


def add_arguments(parser) -> None:
    parser.add_argument("action", nargs="?", choices=("import",), default=None,
                        help="`import FILE`: hold KVV benchmark scores against the vendor ranges")
    parser.add_argument("file", nargs="?", type=Path, default=None, metavar="FILE",
                        help="KVV results (JSON or CSV) for `import`")
    parser.add_argument("--base-url", default=None, metavar="URL", help="OpenAI-compatible endpoint ending in /v1")
    parser.add_argument("--self", dest="self_serve", action="store_true",
                        help="start `k3verify serve` in-process on a free loopback port and check it")
    parser.add_argument("--stack", choices=("reference", "counted"), default=None,
                        help="with --self: serve the reference path (default) or the engine's counted fast path")
    parser.add_argument("--toggle", action="append", default=None, metavar="NAME",
                        help="with --self: serve through the engine with these toggles applied (repeatable)")
    parser.add_argument("--model-name", default=None, metavar="NAME",
                        help="model name to request (default: the first id from /models)")
    parser.add_argument("--only", action="append", metavar="PREFIX",
                        help="run only checks whose name starts with PREFIX (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of plain requests (default 16)")
    parser.add_argument("--structured-max-tokens", type=int, default=2048,
                        help="max_tokens of tool-call / JSON requests (default 2048)")
    parser.add_argument("--report-dir", type=Path, help="where to write the report (default reports/<run-id>)")
    add_model_flag(parser)
    add_device_flag(parser)
    add_json_flag(parser)


def results_table(results, title: str) -> Table:
    table = Table(title=title)
    for col in ("check", "status", "reason"):
        table.add_column(col, overflow="fold")
    colour = {"pass": "green", "fail": "red", "skip": "yellow"}
    for r in results:
        # escaped: a stack label such as engine[batched_decode] would otherwise read as rich markup
        table.add_row(escape(r["check"]), f"[{colour.get(r['status'], 'magenta')}]{r['status']}[/]", escape(r["reason"]))
    return table


def spec_of(args):
    """The flags as a kvv CheckSpec (kinds/kvv.py validates the values, spelled as flags)."""
    from k3verify.kinds.base import CheckSpec

    if args.action == "import":
        if args.file is None:
            raise UsageError("kvv import needs a FILE (KVV results as JSON or CSV), got none")
        if args.base_url or args.self_serve:
            raise UsageError("kvv import reads a file; --base-url / --self do not apply")
    elif args.file is not None:
        raise UsageError(f"unexpected argument {str(args.file)!r}; did you mean `kvv import {args.file}`?")
    elif (args.base_url is None) == (not args.self_serve):
        raise UsageError("kvv needs exactly one of --base-url URL or --self (or `kvv import FILE`)")
    if (args.stack is not None or args.toggle) and not args.self_serve:
        raise UsageError("--stack / --toggle pick what `kvv --self` serves; they need --self")
    if args.stack is not None or args.toggle:
        from k3verify.commands.serve import stack_of
        stack_of(args)                  # a stack that cannot be served on --device: one line, exit 2
    return CheckSpec(NAME, options={
        "base_url": args.base_url, "model_name": args.model_name, "only": args.only, "max_tokens": args.max_tokens,
        "structured_max_tokens": args.structured_max_tokens,
        "import_file": None if args.file is None else str(args.file), "stack": args.stack, "toggles": args.toggle})


def run(args) -> int:
    from k3verify.commands import _check
    from k3verify.kinds.base import Context

    (unit,) = _check.plan(spec_of(args))
    with Context(None, model_arg=args.model, load_options=model_load_options(args),
                 placement=device_load_options(args)) as ctx:
        results = _check.run_units([unit], ctx, NAME, items=[])     # a short run: no progress line
    run_id, report, paths = _check.write(NAME, args.report_dir, None, results, seeds={})
    con = console()
    title = f"kvv import {args.file}" if args.action == "import" else f"kvv {report['results'][0]['scenario']}"
    con.print(results_table(report["results"], title))
    verdict = report["summary"]["verdict"]
    s = report["summary"]
    con.print(f"verdict: {verdict} ({s['passed']} pass, {s['failed']} fail, {s['skipped']} skip)  report: {paths['md']}")
    if args.json:
        emit_json({"run_id": run_id, "verdict": verdict, "report": str(paths["json"]), "summary": s})
    return 0 if verdict == "pass" else 1
