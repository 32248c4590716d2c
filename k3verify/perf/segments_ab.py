"""One engine step that prefills K prompts together, with and without prefill_batched_mixers, in one
process (issue 27 item 3: a fast prefill for many requests, the agentic and GSM8K shape).

    python -m k3verify.perf.segments_ab --out DIR [--model k3-mini] [--device cpu] [--dtype float32]
        [--prompts 1,4,16] [--tokens 64] [--repeats 5] [--base batched_decode] [--cold]

Each cell builds an engine over `base` (+ prefill_batched_mixers on the candidate side), prefills and
finishes a first batch of K other prompts untimed, then adds K prompts of `tokens` tokens and times the
step that prefills all of them in one forward_batch (K segments); `--cold` times a fresh engine's
first step instead (the engine's set-up inside both arms). Interleaved A/B (perf/ab.py) after an
untimed warm pair; the candidate's event count in the timed step
proves its path ran (K segments a KDA or MLA layer). Speed only: whether the speedup counts is the
gates' verdict (`k3verify diff --toggle prefill_batched_mixers`). Writes DIR/segments_ab.json and
prints a table, then one line of JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from optimized_stack import load_model, toggles
from optimized_stack.engine.engine import Engine
from optimized_stack.engine.options import EngineOptions, SamplingParams

from ..io import atomic_write_json
from .ab import interleaved
from .gpu_bench import sync


def prefill_step(model, names: list[str], prompts: list[list[int]], warm: bool = True) -> tuple[float, int]:
    """(seconds of the engine step that prefills every prompt, prefill_batched_mixers events fired in
    it). `warm` (the default): the timed step is the engine's second prefill of a batch like it, after
    a first batch of other prompts was prefilled and finished untimed, so the engine's first-step
    set-up (pools, the paged cache, the first forward's host work) stays out of both arms. Cold (the
    form before 2026-12-07's device call): the fresh engine's first step, whose fixed cost sits in both
    arms and pulls the ratio toward 1 (k3-small on the H100: 185 ms for one 256-token prompt)."""
    with toggles.applied(names) as ap:
        opts = EngineOptions.from_dict({**ap.engine_for(model.device), "max_num_seqs": len(prompts),
                                        "kda_pool_slots": len(prompts),
                                        "token_budget": sum(len(p) for p in prompts) + len(prompts)})
    eng = Engine(model, opts)
    with torch.no_grad():
        if warm:                             # other tokens, the same lengths: no shared prefix to reuse
            for i, p in enumerate(prompts):
                eng.add_request([(t + 1) % 256 for t in p], SamplingParams(max_new_tokens=1, ignore_eos=True),
                                request_id=f"w{i}")
            eng.run()
        before = eng.events.get("prefill_batched_mixers", 0)
        for i, p in enumerate(prompts):
            eng.add_request(p, SamplingParams(max_new_tokens=2, ignore_eos=True), request_id=f"p{i}")
        sync()
        t0 = time.perf_counter()
        out = eng.step()
        sync()
        seconds = time.perf_counter() - t0
    assert len(out) == len(prompts) and all(o.num_tokens == len(p) for o, p in zip(out, prompts)), \
        "the step did not prefill every prompt whole: the arms would time different work"
    return seconds, eng.events.get("prefill_batched_mixers", 0) - before


def cell(model, base: list[str], k: int, tokens: int, repeats: int, warm: bool = True) -> dict:
    gen = torch.Generator().manual_seed(k)
    prompts = [torch.randint(0, 256, (tokens,), generator=gen).tolist() for _ in range(k)]
    fired: list[int] = []

    def candidate() -> float:
        s, n = prefill_step(model, base + ["prefill_batched_mixers"], prompts, warm)
        fired.append(n)
        return s
    ab = interleaved(lambda: prefill_step(model, base, prompts, warm)[0], candidate, repeats=repeats,
                     tokens=k * tokens, labels=("per segment", "batched mixers"), self_timed=True)
    layers = len(model.config.layer_kinds)
    return {"prompts": k, "tokens": tokens, "warm": warm, **ab.to_dict(), "events_per_step": fired[-1],
            "events_expected": k * layers if k > 1 else 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3verify.perf.segments_ab", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="k3-mini")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--base", default="batched_decode", help="the `+`-joined toggles both arms run on")
    ap.add_argument("--cold", action="store_true", help="time a fresh engine's first step (the form before "
                    "2026-12-07), not a warm engine's second prefill")
    args = ap.parse_args(argv)
    try:
        ks = [int(x) for x in args.prompts.split(",") if x.strip()]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1 or args.tokens < 1 or args.repeats < 2:
        print(f"error: expected --prompts like 1,4,16 (each >= 1), --tokens >= 1, --repeats >= 2; got "
              f"{args.prompts!r}, {args.tokens}, {args.repeats}", file=sys.stderr)
        return 2
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        print(f"error: --device {args.device}: expected cpu, or cuda where torch.cuda.is_available()", file=sys.stderr)
        return 2
    base = [n for n in args.base.split("+") if n]
    try:
        for n in base:
            toggles.get(n)
        model = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    except Exception as exc:   # noqa: BLE001 - a bad toggle or model name is the caller's: one line
        print(f"error: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    rows = []
    for k in ks:
        rows.append(cell(model, base, k, args.tokens, args.repeats, warm=not args.cold))
        atomic_write_json(args.out / "segments_ab.json", {"model": args.model, "device": args.device,
                                                          "dtype": args.dtype, "base": base, "cells": rows})
    print(f"{'a fresh engine' if args.cold else 'a warm engine'}'s step prefilling K prompts x {args.tokens} tokens, "
          f"{args.model} {args.dtype} {args.device}, "
          f"base {'+'.join(base)}: per segment vs prefill_batched_mixers ({args.repeats} interleaved rounds)")
    print("| K | per segment ms | batched ms | speedup [95% CI] | events / expected |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompts']} | {1e3 * r['median_s_a']:.1f} | {1e3 * r['median_s_b']:.1f} | {r['ratio']:.2f}x "
              f"[{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}] | {r['events_per_step']} / {r['events_expected']} |")
    print(json.dumps({"cells": [{k: r[k] for k in ("prompts", "ratio", "ci95")} for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
