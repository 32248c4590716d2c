"""`k3verify kvv`: the Kimi Vendor Verifier API-contract checks, or KVV benchmark scores held to range.

    k3verify kvv --base-url http://127.0.0.1:8000/v1 [--model-name NAME]
    k3verify kvv --self                  # against `k3verify serve` started in-process
    k3verify kvv import results.json     # OCRBench / MMMU-Pro Vision / BEAM 1M / DeepSWE vs vendor ranges

Each check becomes one report result, pass / fail / skip with its reason; a skip
says what it would need (most often a real K3 endpoint). The API key, if any, is
read from OPENAI_API_KEY.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from rich.table import Table

from k3verify.commands import (add_json_flag, add_model_flag, command_line, console, emit_json, model_load_options,
                               served_model)
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
    parser.add_argument("--model-name", default=None, metavar="NAME",
                        help="model name to request (default: the first id from /models)")
    parser.add_argument("--only", action="append", metavar="PREFIX",
                        help="run only checks whose name starts with PREFIX (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of plain requests (default 16)")
    parser.add_argument("--structured-max-tokens", type=int, default=2048,
                        help="max_tokens of tool-call / JSON requests (default 2048)")
    parser.add_argument("--report-dir", type=Path, help="where to write the report (default reports/<run-id>)")
    add_model_flag(parser)
    add_json_flag(parser)


def results_table(results, title: str) -> Table:
    table = Table(title=title)
    for col in ("check", "status", "reason"):
        table.add_column(col, overflow="fold")
    colour = {"pass": "green", "fail": "red", "skip": "yellow"}
    for r in results:
        table.add_row(r["check"], f"[{colour.get(r['status'], 'magenta')}]{r['status']}[/]", r["reason"])
    return table


def _check_endpoint(args, base_url: str):
    from k3verify.quality import gates as quality
    from k3verify.quality.evals.kvv import run_kvv

    name = args.model_name or served_model(base_url)
    started = time.perf_counter()
    out = run_kvv(base_url, name, os.environ.get("OPENAI_API_KEY") or None, max_tokens=args.max_tokens,
                  structured_max_tokens=args.structured_max_tokens, only=args.only)
    return quality.kvv_gate(out, time.perf_counter() - started), f"kvv {name} @ {base_url}"


def validate(args) -> None:
    """Every check run() makes before it starts a server or sends a request (`k3verify all`
    calls it in its pre-check)."""
    from urllib.parse import urlparse

    if args.action == "import":
        if args.file is None:
            raise UsageError("kvv import needs a FILE (KVV results as JSON or CSV), got none")
        if args.base_url or args.self_serve:
            raise UsageError("kvv import reads a file; --base-url / --self do not apply")
        return
    if args.file is not None:
        raise UsageError(f"unexpected argument {str(args.file)!r}; did you mean `kvv import {args.file}`?")
    if (args.base_url is None) == (not args.self_serve):
        raise UsageError("kvv needs exactly one of --base-url URL or --self (or `kvv import FILE`)")
    url = urlparse(args.base_url or "http://127.0.0.1/v1")
    if url.scheme not in ("http", "https") or not url.netloc:
        raise UsageError(f"--base-url must be an http(s) URL like http://127.0.0.1:8000/v1, got {args.base_url!r}")
    for flag, value in (("--max-tokens", args.max_tokens), ("--structured-max-tokens", args.structured_max_tokens)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.only:
        import types

        from k3verify.quality.evals.kvv import _plan       # the check names run_kvv matches --only against:
        stub = types.SimpleNamespace(base_url="http://127.0.0.1/v1", model="m")   # building the plan sends nothing
        names = [n for n, _ in _plan(stub, False, args.max_tokens, args.structured_max_tokens)]
        unknown = [p for p in args.only if not any(n.startswith(p) for n in names)]
        if unknown:
            raise UsageError(f"--only {unknown[0]!r}: no KVV check starts with it; names are like {names[1]!r}")


def run(args) -> int:
    from k3verify.quality import gates as quality
    from k3verify.kinds import diff as verify

    validate(args)
    if args.action == "import":
        from k3verify.quality.evals.kvv_ranges import import_kvv_results
        gate, title = quality.kvv_import_gate(import_kvv_results(args.file)), f"kvv import {args.file}"
    else:
        if args.self_serve:
            from k3verify.serving.lifecycle import ServerThread, build_embedded_app
            with ServerThread(build_embedded_app(args.model, **model_load_options(args))) as server:
                gate, title = _check_endpoint(args, server.base_url)
        else:
            gate, title = _check_endpoint(args, args.base_url)
    run_id, default_dir = verify.default_report_dir("kvv")
    report, paths = verify.write(args.report_dir or default_dir, run_id, command_line(),
                                 None, gate.results, seeds={})
    con = console()
    con.print(results_table(gate.results, title))
    verdict = report["summary"]["verdict"]
    s = report["summary"]
    con.print(f"verdict: {verdict} ({s['passed']} pass, {s['failed']} fail, {s['skipped']} skip)  report: {paths['md']}")
    if args.json:
        emit_json({"run_id": run_id, "verdict": verdict, "report": str(paths["json"]), "summary": s})
    return 0 if verdict == "pass" else 1
