"""Whole-prompt prefill speed of named toggle sets against the reference path, in one process
(issue 27 item 3: a fast prefill).

    python -m k3verify.perf.prefill_ab --out DIR [--model k3-small] [--device cuda] [--dtype bfloat16]
        [--tokens 4096,32768] [--repeats 5] [--sets "mla_flash_bf16;mla_sdpa;phase"] [--peer]

Each set is a `+`-joined list of toggles; `phase` is the GPU prefill phase's set (the CUDA toggles
that name "prefill" in their `phases`), and `phase/X` is that set with its attention form replaced
by toggle X, so a new attention kernel is timed beside the rest of the fast prefill as it would
ship. Every (length, set) pair is an interleaved A/B against the reference (perf/ab.py) after an
untimed warm pair; the sets share the process, so fla and Triton pick their tiles once for all
of them. --peer adds transformers' KimiLinear at the model's dims (perf/transformers_kimi.py, no
mask, no cache: its fastest whole-prompt forward) as an interleaved A/B against the last set, in
the same process and after the same warm pair (issue 27's fair baseline). Speed only: whether a
set's speedup counts is the gates' verdict (`k3verify all`).
Writes DIR/prefill_ab.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from optimized_stack import load_model, toggles as toggle_registry
from optimized_stack.errors import K3Error

from ..io import atomic_write_json
from . import gpu_bench
from .gpu_suite import phase_set

# the prefill phase's attention slot: a set `phase/X` swaps these for X
_ATTENTION_FORMS = ("mla_sdpa", "mla_flash_bf16")


def resolve_set(text: str) -> tuple[str, ...]:
    """'a+b', 'phase' or 'phase/X' -> the toggle names, each a registered toggle."""
    text = text.strip()
    if text == "phase" or text.startswith("phase/"):
        names = [n for n in phase_set("prefill")]
        if "/" in text:
            swap = text.split("/", 1)[1]
            names = [n for n in names if n not in _ATTENTION_FORMS] + [swap]
    else:
        names = [n for n in text.split("+") if n]
    if not names:
        raise K3Error(f"prefill set {text!r}: names no toggle")
    for n in names:
        toggle_registry.get(n)                       # raises K3Error naming the unknown toggle
    return tuple(names)


def run(model, tokens: list[int], sets: list[str], repeats: int, log=print) -> list[dict[str, Any]]:
    rows = []
    for n in tokens:
        for label in sets:
            names = resolve_set(label)
            r = gpu_bench.bench_prefill(model, n, names, repeats=repeats)
            r.update({"set": label, "toggles": list(names)})
            log(f"prefill {n:>6} {label:<24} {gpu_bench.fmt_ratio(r)}")
            rows.append(r)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def peer_rows(model, dtype: torch.dtype, tokens: list[int], against: str, repeats: int, log=print) -> list[dict[str, Any]]:
    """transformers' whole-prompt forward vs the set `against`, interleaved (ratio > 1: ours faster)."""
    from .ab import interleaved
    from .transformers_kimi import KimiLinearPeer
    names = resolve_set(against)
    peer = KimiLinearPeer(model.config, dtype, str(model.device), max(tokens))
    rows = []
    for n in tokens:
        ids = gpu_bench._ids(n, model.config.vocab_size, 7).to(model.device)
        ours = gpu_bench._timed_fn(names, lambda: model.logits(ids))
        theirs = lambda: (peer.prefill(n), gpu_bench.sync())
        d = interleaved(theirs, ours, repeats=repeats, tokens=n, labels=("transformers", against)).to_dict()
        r = {"workload": f"prefill {n}", "tokens": n, "set": f"{against} vs transformers", "toggles": list(names),
             "reference": "transformers", "reference_s": d["median_s_a"], "candidate_s": d["median_s_b"],
             "tokens_per_s_reference": d["tokens_per_s_a"], "tokens_per_s_candidate": d["tokens_per_s_b"],
             "ratio": d["ratio"], "ci95": d["ci95"], "repeats": repeats, "peer": peer.info}
        log(f"prefill {n:>6} {r['set']:<24} {gpu_bench.fmt_ratio(r)}")
        rows.append(r)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| tokens | set | baseline | baseline tok/s | set tok/s | speedup [95% CI] | repeats |",
           "|---:|---|---|---:|---:|---|---:|"]
    for r in rows:
        lo, hi = r["ci95"]
        out.append(f"| {r['tokens']} | {r['set']} | {r.get('reference', 'reference path')} | "
                   f"{r['tokens_per_s_reference']:.0f} | "
                   f"{r['tokens_per_s_candidate']:.0f} | {r['ratio']:.2f}x [{lo:.2f}, {hi:.2f}] | {r['repeats']} |")
    return "\n".join(out)


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive token counts, got {text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3verify.perf.prefill_ab", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="k3-small")
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--tokens", type=_ints, default=[4096, 32768])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sets", default="mla_flash_bf16;mla_sdpa;phase;phase/mla_flash_bf16")
    ap.add_argument("--peer", action="store_true", help="also transformers' KimiLinear against the last set")
    a = ap.parse_args(argv)
    try:
        if a.repeats < 1:
            raise K3Error(f"--repeats must be >= 1, got {a.repeats}")
        sets = [s for s in a.sets.split(";") if s.strip()]
        for s in sets:
            resolve_set(s)                           # bad input fails before the model loads
        if a.device == "cuda" and not torch.cuda.is_available():
            raise K3Error("--device cuda: no CUDA device here")
        model = load_model(a.model, device=a.device, dtype=getattr(torch, a.dtype))
    except K3Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log = lambda m: print(m, file=sys.stderr, flush=True)
    rows = run(model, a.tokens, sets, a.repeats, log=log)
    if a.peer:
        rows += peer_rows(model, getattr(torch, a.dtype), a.tokens, sets[-1], a.repeats, log=log)
    doc = {"model": a.model, "device": a.device, "dtype": a.dtype,
           "cuda_device": torch.cuda.get_device_name() if a.device == "cuda" else None,
           "tokens": a.tokens, "sets": sets, "rows": rows}
    atomic_write_json(a.out / "prefill_ab.json", doc)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
