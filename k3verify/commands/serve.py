"""`k3verify serve`: the OpenAI-compatible server (k3verify.serve) over the embedded engine.

/v1/models, /v1/completions, /v1/chat/completions (streamed and not), /tokenize;
requests that break K3's API contract get HTTP 400 with a reason. Runs until
interrupted (Ctrl-C exits 130).
"""
from __future__ import annotations

from k3verify.commands import add_model_flag, model_load_options
from k3verify.errors import UsageError

NAME = "serve"
HELP = "serve the embedded model over an OpenAI-compatible HTTP API (K3's request contract enforced)"


def add_arguments(parser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    add_model_flag(parser)


def run(args) -> int:
    from k3verify.serve import serve_main

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    return serve_main(args.model, host=args.host, port=args.port, **model_load_options(args))
