"""`k3verify serve`: the OpenAI-compatible server (k3verify.serving.app) over the embedded model.

`--stack reference` (the default) serves the plain token-by-token loop; `--stack counted` serves
the engine with the fast decode path counted on --device (serving/stack.py), and `--toggle NAME`
(repeatable) the engine with those toggles: concurrent requests share its steps. Every response
names the stack (X-K3verify-Stack, system_fingerprint) and the path events its steps fired.

/v1/models, /v1/completions, /v1/chat/completions (streamed and not), /tokenize, /health;
requests that break K3's API contract get HTTP 400 with a reason. One worker owns the model
and takes requests from a bounded queue (past it: 429 with Retry-After); a client that goes
away cancels its generation. SIGTERM drains and exits 0; Ctrl-C exits 130.
"""
from __future__ import annotations

import re

from k3verify.commands import add_device_flag, add_model_flag, device_load_options, model_load_options
from k3verify.errors import UsageError

NAME = "serve"
HELP = ("serve the embedded model over an OpenAI-compatible HTTP API (K3's request contract enforced), "
        "on the reference path or the engine (--stack counted, --toggle NAME)")
# ServeLimits field -> (flag, argparse dest)
FLAGS = {"max_queue": ("--max-queue", "max_queue"), "max_body_bytes": ("--max-body-bytes", "max_body_bytes"),
         "max_prompt_tokens": ("--max-prompt-tokens", "max_prompt_tokens"),
         "max_model_len": ("--max-model-len", "max_model_len"), "stall_s": ("--stall-timeout", "stall_timeout"),
         "drain_s": ("--drain-timeout", "drain_timeout")}


def add_arguments(parser) -> None:
    from k3verify.serving.validation import ServeLimits

    d = ServeLimits()
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    add_model_flag(parser)
    add_device_flag(parser)
    from k3verify.serving.stack import STACKS
    parser.add_argument("--stack", choices=STACKS, default=None,
                        help="what serves: reference (the plain token-by-token loop, the default) or counted "
                             "(the engine with the fast decode path that counts as a speedup on --device: "
                             "batched_decode, plus cuda_graphs on cuda), concurrent requests batched")
    parser.add_argument("--toggle", action="append", default=[], metavar="NAME",
                        help="serve through the engine with these toggles applied (repeatable; their requires "
                             "are added); instead of --stack")
    limits = parser.add_argument_group("limits (past each: the HTTP status in brackets)")
    limits.add_argument("--max-queue", type=int, default=d.max_queue, metavar="N",
                        help=f"requests waiting behind the one generating [429 + Retry-After] (default {d.max_queue})")
    limits.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, metavar="B",
                        help=f"request body size [413] (default {d.max_body_bytes})")
    limits.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, metavar="T",
                        help=f"prompt length after the chat template [400] (default {d.max_prompt_tokens})")
    limits.add_argument("--max-model-len", type=int, default=d.max_model_len, metavar="T",
                        help=f"prompt + max_tokens [400] (default {d.max_model_len})")
    limits.add_argument("--stall-timeout", type=float, default=d.stall_s, metavar="S",
                        help="seconds busy without a new token before /health calls the worker wedged [503]; "
                             f"keep it above the longest prefill (default {d.stall_s:g})")
    limits.add_argument("--drain-timeout", type=float, default=d.drain_s, metavar="S",
                        help="on SIGTERM, seconds in-flight work may run before it is cancelled "
                             f"(default {d.drain_s:g})")


def run(args) -> int:
    from k3verify.serving.lifecycle import serve_main
    from k3verify.serving.validation import ServeLimits
    from optimized_stack.errors import K3Error

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    values = {field: getattr(args, dest) for field, (_, dest) in FLAGS.items()}
    try:
        limits = ServeLimits(**values)
    except K3Error as e:  # the same rule, worded with the flags the user typed
        message = str(e)
        for field, (flag, _) in FLAGS.items():
            message = re.sub(rf"\b{field}\b", flag, message)
        raise UsageError(message) from None
    stack = stack_of(args)
    return serve_main(args.model, host=args.host, port=args.port, limits=limits, stack=stack,
                      **device_load_options(args), **model_load_options(args))


def stack_of(args):
    """--stack / --toggle on --device -> a ServeStack, checked before the model loads (UsageError)."""
    from k3verify.serving.stack import serve_stack
    from optimized_stack.errors import K3Error

    device = args.device
    try:
        return serve_stack(args.stack, args.toggle, device)
    except K3Error as e:
        raise UsageError(f"--stack/--toggle: {e}") from None
