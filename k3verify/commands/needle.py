"""`k3verify needle`: RULER-style needle recall per (length, depth) cell on the embedded model.

Each cell's prompt (k3verify.quality.evals.needle, lengths in byte-tokenizer tokens) is
prefilled, then up to 12 tokens are greedy-decoded and the 7-digit value is
matched exactly. --fast runs with kda_chunked + mla_sdpa (chunked KDA, fused
SDPA attention with O(T) memory); above 16K tokens that choice is made
automatically, printed, and recorded in the report with its reason. With
--toggle T the candidate (T on top of the same base) must not recall less than
the reference on any cell.
"""
from __future__ import annotations

import sys
from pathlib import Path

from rich.table import Table

from k3verify.commands import add_device_flag, add_json_flag, add_model_flag, device_load_options, console, emit_json, model_load_options
from k3verify.errors import UsageError
from k3verify.kinds.needle import MAX_LENGTH_TOKENS

NAME = "needle"
HELP = "needle-in-a-haystack recall per (length, depth) cell; with --toggle the candidate must not recall less"
DEFAULT_LENGTHS = (4096, 8192)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v.strip().replace("_", "")) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--lengths must be comma-separated token counts like 4096,8192, got {text!r}") from None
    if not values or any(not 256 <= v <= MAX_LENGTH_TOKENS for v in values):   # the exact minimum: validate()
        raise UsageError(f"--lengths must be token counts in [256, {MAX_LENGTH_TOKENS}], got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--depths must be comma-separated fractions like 0.1,0.5,0.9, got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise UsageError(f"--depths must be fractions in [0, 1], got {text!r}")
    return values


def add_arguments(parser) -> None:
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), metavar="L,L,...",
                        help=f"prompt lengths in tokens (default {','.join(map(str, DEFAULT_LENGTHS))}; "
                             "the K3 claim is about 108000)")
    parser.add_argument("--depths", default=",".join(map(str, DEFAULT_DEPTHS)), metavar="D,D,...",
                        help="needle depths as fractions of the haystack (default 0.1,0.5,0.9)")
    parser.add_argument("--seed", type=int, default=0, help="case seed (default 0)")
    parser.add_argument("--samples", type=int, default=1, metavar="N",
                        help="cases per cell, seeds S..S+N-1 (default 1)")
    parser.add_argument("--distractors", type=int, default=0, metavar="N", help="distractor needles per case")
    parser.add_argument("--toggle", default=None, metavar="T", help="candidate toggle judged against the reference")
    parser.add_argument("--fast", action="store_true",
                        help="run both sides with kda_chunked + mla_sdpa (automatic above 16K tokens)")
    parser.add_argument("--min-recall", type=float, default=None, metavar="R",
                        help="without --toggle: fail a cell whose recall is below R (fraction)")
    parser.add_argument("--report-dir", type=Path, help="where to write the report (default reports/<run-id>)")
    add_model_flag(parser)
    add_device_flag(parser)
    add_json_flag(parser)


def cells_table(results: list[dict], toggle: str | None) -> Table:
    table = Table(title="needle recall per cell" + (f" ({toggle})" if toggle else ""))
    for col in ("length", "depth", "reference", "candidate", "prefill s", "decode s", "output", "status"):
        table.add_column(col)
    for r in results:
        if "reference_cases" not in r:                # a skip (the toggle does not run here)
            table.add_row("-", "-", "-", "-", "-", "-", "-", f"[yellow]{r['status']}[/]")
            continue
        cases = r["reference_cases"] + r.get("candidate_cases", [])
        found = [f"{sum(o['found'] for o in r['reference_cases'])}/{len(r['reference_cases'])}"]
        found.append(f"{sum(o['found'] for o in r['candidate_cases'])}/{len(r['candidate_cases'])}"
                     if "candidate_cases" in r else "-")
        colour = "green" if r["status"] == "pass" else "red"
        table.add_row(str(r["length_tokens"]), f"{r['depth']:g}", *found,
                      f"{sum(o['prefill_s'] for o in cases):.1f}", f"{sum(o['decode_s'] for o in cases):.1f}",
                      repr(r["reference_cases"][0]["text"])[:24], f"[{colour}]{r['status']}[/]")
    return table


def spec_of(args):
    from k3verify.kinds.base import CheckSpec
    return CheckSpec(NAME, options={"toggles": None if args.toggle is None else [args.toggle],
                                    "lengths": _int_list(args.lengths), "depths": _float_list(args.depths),
                                    "seed": args.seed, "samples": args.samples, "distractors": args.distractors,
                                    "fast": args.fast, "min_recall": args.min_recall})


def run(args) -> int:
    from k3verify.commands import _check
    from k3verify.commands._progress import Item
    from k3verify.kinds import needle as kind
    from k3verify.kinds.base import Context
    from k3verify.quality.needle_gate import choose_fast
    from optimized_stack import load_model

    spec = spec_of(args)
    (unit,) = _check.plan(spec)
    cases = kind.cases(spec.options)                 # a length too short for its needles is refused here
    fast, auto_reason = choose_fast(max(c.length_tokens for c in cases), args.fast, getattr(args, "device", "cpu"))
    if auto_reason:                                  # the gate makes (and records) the same choice
        print(f"note: {auto_reason} (recorded in the report)", file=sys.stderr)
    model = load_model(args.model, **device_load_options(args), **model_load_options(args))
    sides = 2 if args.toggle else 1                  # the reference, then the candidate, case by case
    items = [Item(c.name, NAME, kind.case_s(c.length_tokens)) for _ in range(sides) for c in cases]
    with Context(model, model_arg=args.model) as ctx:
        results = _check.run_units([unit], ctx, NAME, items=items, log_prefix="  ")
    run_id, report, paths = _check.write(NAME, args.report_dir, model, results,
                                         seeds={"needle_seed": args.seed, "samples": args.samples})
    rows = report["results"]
    con = console()
    con.print(cells_table(rows, args.toggle))
    verdict = report["summary"]["verdict"]
    con.print(f"verdict: {verdict}  report: {paths['md']}")
    if args.json:
        emit_json({"run_id": run_id, "verdict": verdict, "report": str(paths["json"]), "fast": fast,
                   "automatic_choices": rows[0].get("automatic_choices", []),
                   "cells": [{"length": r.get("length_tokens"), "depth": r.get("depth"), "status": r["status"],
                              "recall": [a["value"] for a in r.get("accuracy", [])], "seconds": r["duration_s"]}
                             for r in rows]})
    return 0 if verdict == "pass" else 1
