"""Subcommands of `k3verify`, one module each, found by k3verify.cli at startup.

A command module defines:
    NAME: str                      the subcommand name ("info")
    HELP: str                      one line for `k3verify --help`
    add_arguments(parser) -> None  its argparse options
    run(args) -> int               0 ok, 1 a check failed; raise UsageError/K3Error for bad input (2)
Modules whose name starts with "_" are helpers, not commands.

Output convention: a rich table for people on stdout; with --json, stdout carries exactly
one JSON document (emit_json) and the tables go to stderr (gh, kubectl, pip and ruff do
the same), so `k3verify toggles --json | jq` works. The CLI dispatcher sets this up once
for every command (json_output); a command only prints through console() and emit_json.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Iterator, TextIO

from rich.console import Console

from k3verify import REPO_ROOT

REPORTS_DIR = REPO_ROOT / "reports"     # default parent of reports/<run-id>/


class _JsonSink:
    """Where --json's one document goes (the real stdout) and how many were written."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.count = stream, 0


_SINK: _JsonSink | None = None


@contextlib.contextmanager
def json_output(enabled: bool) -> Iterator[_JsonSink | None]:
    """With enabled, everything written to sys.stdout goes to stderr except emit_json's document.

    Nested json_output(False) (a gate command run inside `k3verify all`) restores plain
    behaviour, so its emit_json writes to whatever sys.stdout is there (its log)."""
    global _SINK
    saved = _SINK
    _SINK = _JsonSink(sys.stdout) if enabled else None
    try:
        if enabled:
            with contextlib.redirect_stdout(sys.stderr):
                yield _SINK
        else:
            yield None
    finally:
        _SINK = saved


def interactive() -> bool:
    """True when a person watches: the real stdout and stderr are both terminals (progress lines then)."""
    out = _SINK.stream if _SINK is not None else sys.stdout
    return _isatty(out) and _isatty(sys.stderr)    # not all(): the `all` command module shadows it here


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):     # closed or not a file
        return False


_ARGV: list[str] | None = None       # what the dispatcher parsed (main(argv) in tests, not pytest's argv)


def record_argv(argv: list[str]) -> None:
    global _ARGV
    _ARGV = list(argv)


def command_line() -> str:
    """`k3verify ARGS` as invoked, for reports; argv bytes that are not UTF-8 (surrogate escapes)
    are shown as \\xNN so the report stays writable as UTF-8."""
    argv = sys.argv[1:] if _ARGV is None else _ARGV
    words = [a.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") for a in argv]
    return " ".join(["k3verify", *words])


def console() -> Console:
    """A rich Console on the current sys.stdout (stderr under --json); plain text (no colour codes) when not a TTY."""
    # Built per call so a redirected or captured stdout is honoured. Off a TTY rich would
    # assume 80 columns and fold hashes and paths; logs read better at 120 unless COLUMNS says.
    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120
    return Console(file=sys.stdout, highlight=False, soft_wrap=False, width=width)


def err_console() -> Console:
    return Console(file=sys.stderr, highlight=False)


def add_json_flag(parser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print only one JSON document on stdout (the tables go to stderr)")


def add_model_flag(parser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        metavar="M",
        help="model directory (config.json + model.safetensors) or preset name (k3-mini, ...); default: the embedded model",
    )
    parser.add_argument("--allow-nonfinite-weights", action="store_true",
                        help="load a checkpoint with NaN/inf weights (a poisoned model for the run-time checks)")
    parser.add_argument("--allow-weight-cast", action="store_true",
                        help="cast float16/float64 checkpoint weights to the model's dtype instead of refusing them")


def model_load_options(args) -> dict[str, bool]:
    """load_model keyword arguments from the flags add_model_flag declares (every command's one source)."""
    return {"allow_nonfinite": getattr(args, "allow_nonfinite_weights", False),
            "allow_dtype_cast": getattr(args, "allow_weight_cast", False)}


DTYPES = ("float32", "bfloat16")


def add_device_flag(parser) -> None:
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the model runs (CUDA-only toggles are judged only on cuda); default cpu")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="the model's weights and activations (bfloat16: the GPU profile's, with its declared "
                             "bf16 budgets for approx toggles); default float32")


def device_load_options(args) -> dict:
    """load_model's device and dtype from --device / --dtype (CUDA refused where it is absent)."""
    import torch
    return {"device": requested_device(args), "dtype": getattr(torch, getattr(args, "dtype", "float32") or "float32")}


def requested_device(args) -> str:
    """--device, refused with a one-line error when CUDA is asked for and absent."""
    device = getattr(args, "device", "cpu")
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            from k3verify.errors import UsageError
            raise UsageError("--device cuda: torch.cuda.is_available() is False on this machine")
    return device


def emit_json(obj: Any) -> None:
    """The machine-readable document: compact, sorted, one line, never wrapped or coloured by rich.

    Under --json it goes to the real stdout, once: a second call is a bug in the command."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str) + "\n"
    sink = _SINK
    if sink is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    if sink.count:
        raise TypeError("emit_json called twice under --json: stdout must hold exactly one JSON document")
    sink.count += 1
    sink.stream.write(text)
    sink.stream.flush()
