"""Subcommands of `k3verify`, one module each, found by k3verify.cli at startup.

A command module defines:
    NAME: str                      the subcommand name ("info")
    HELP: str                      one line for `k3verify --help`
    add_arguments(parser) -> None  its argparse options
    run(args) -> int               0 ok, 1 a check failed; raise UsageError/K3Error for bad input (2)
Modules whose name starts with "_" are helpers, not commands.

Output convention (nanoGPT-style): a rich table for people, then with --json one
final line of JSON for machines. The helpers below keep every command alike.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console


def console() -> Console:
    """A rich Console on the current sys.stdout; plain text (no colour codes) when not a TTY."""
    # Built per call so a redirected or captured stdout is honoured. Off a TTY rich would
    # assume 80 columns and fold hashes and paths; logs read better at 120 unless COLUMNS says.
    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120
    return Console(file=sys.stdout, highlight=False, soft_wrap=False, width=width)


def err_console() -> Console:
    return Console(file=sys.stderr, highlight=False)


def add_json_flag(parser) -> None:
    parser.add_argument("--json", action="store_true", help="after the table, print one final line of JSON")


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


def add_device_flag(parser) -> None:
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the model runs (CUDA-only toggles are judged only on cuda); default cpu")


def requested_device(args) -> str:
    """--device, refused with a one-line error when CUDA is asked for and absent."""
    device = getattr(args, "device", "cpu")
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            from k3verify.errors import UsageError
            raise UsageError("--device cuda: torch.cuda.is_available() is False on this machine")
    return device


def served_model(root: str, model_name: str | None = None) -> str:
    """Probe an OpenAI-compatible endpoint's /models (root: http://host:port/v1) and return
    the model to ask for: `model_name`, else the first one listed. A closed port is a
    one-line UsageError naming the URL (clients answer it with a traceback after retries)."""
    import httpx

    from k3verify.errors import UsageError
    root = root.rstrip("/")
    try:
        listing = httpx.get(root + "/models", timeout=30)
    except httpx.HTTPError as e:  # nothing listens: --model-name would not help, so do not suggest it
        raise UsageError(f"cannot reach {root}: {type(e).__name__}: {e}") from None
    if model_name is not None:
        return model_name
    try:
        data = listing.json().get("data") or []
    except (ValueError, AttributeError) as e:
        raise UsageError(f"cannot list models at {root}/models (HTTP {listing.status_code}, "
                         f"{type(e).__name__}); pass --model-name") from None
    if not data:
        raise UsageError(f"{root}/models lists no model; pass --model-name")
    return data[0]["id"]


def emit_json(obj: Any) -> None:
    """The machine-readable last line: compact, sorted, never wrapped or coloured by rich."""
    sys.stdout.write(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str) + "\n")
    sys.stdout.flush()
