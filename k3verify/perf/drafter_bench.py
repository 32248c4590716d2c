"""Acceptance of each drafter, and what it buys: prompt lookup vs the trained draft model.

    python -m k3verify.perf.drafter_bench [--device cpu|cuda] [--prompts 50 --max-new 64 --k 3]
                                          [--batch 1,8,64] [--workloads gsm8k,agentic]

Workloads (greedy, so speculation is exact and every run's tokens are checked against the plain
run's):
- gsm8k: gsm8k-synth test questions (seed 0) in lm-eval's few-shot prompt, shots from the train
  split at seed 0 (the eval's own draw; the drafter trains on other seeds);
- agentic: the `agentic` scenario's prompts (sessions re-sending their history with the model's
  real answers, subagent forks), each as its own request.
Per (workload, batch size B = max_num_seqs): one plain run (no speculation), then one run per
drafter with ReplaySSM rollback and k drafts. Columns: acceptance length (tokens emitted per
verification: accepted drafts + the bonus, SpecStats.acceptance_length), drafts accepted per
verification, tokens/step (generated tokens per engine step), wall seconds and the speedup over
the plain run (median wall of --repeats rounds in alternating order, after one untimed run of
every arm with --warm; one cold run each by default, a rough CPU figure). Prints a table, then one line of JSON.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from k3verify.quality.evals import gsm8k_synth
from k3verify.scenarios import workloads
from k3verify.scenarios.answers import realized
from optimized_stack import load_model
from optimized_stack.engine.engine import Engine
from optimized_stack.engine.options import DRAFTERS, EngineOptions, SamplingParams
from optimized_stack.errors import K3Error

WORKLOADS = ("gsm8k", "agentic")


def gsm8k_prompts(n: int, shots: int) -> list[list[int]]:
    """lm-eval's gsm8k prompt: the shots with their answers, then the question."""
    pool = gsm8k_synth.generate("train", 200, seed=0)
    rng = random.Random(1234)
    out = []
    for row in gsm8k_synth.generate("test", n, seed=0):
        parts = [f"Question: {s['question']}\nAnswer: {s['answer']}" for s in rng.sample(pool, shots)]
        out.append(list("\n\n".join(parts + [f"Question: {row['question']}\nAnswer:"]).encode()))
    return out


def agentic_prompts(model, n: int) -> list[list[int]]:
    sc = realized(model, workloads.build("agentic", vocab=model.config.vocab_size))
    return [list(r.prompt_ids) for r in sc.requests][:n]


def run_once(model, prompts: list[list[int]], max_new: int, batch: int, drafter: str | None, k: int,
             drafter_checkpoint: str | None = None) -> dict:
    spec = {} if drafter is None else {"speculative": "replay_ssm", "num_draft_tokens": k, "drafter": drafter,
                                       "drafter_checkpoint": drafter_checkpoint if drafter == "model" else None}
    eng = Engine(model, EngineOptions(continuous_batching=True, max_num_seqs=batch, **spec))
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(max_new_tokens=max_new, ignore_eos=True), request_id=f"p{i}")
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = eng.run()
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    s = eng.spec.stats if eng.spec is not None else None
    m = eng.metrics
    return {"drafter": drafter or "none", "tokens": {rid: r.tokens for rid, r in out.items()}, "wall_s": wall,
            "steps": m.steps, "generated": m.generated_tokens, "tokens_per_step": m.generated_tokens / max(1, m.steps),
            "acceptance_length": s.acceptance_length if s else 1.0, "mean_accepted": s.mean_accepted if s else 0.0,
            "verify_steps": s.verify_steps if s else 0, "drafted": s.drafted if s else 0,
            "accepted": s.accepted if s else 0}


def bench(model, workload: str, prompts: list[list[int]], max_new: int, batches: list[int],
          drafters: list[str], k: int, drafter_checkpoint: str | None = None, repeats: int = 1,
          warm: bool = False, checkpoint=lambda rows: None) -> list[dict]:
    """Per batch size: the plain run and one run per drafter, `repeats` rounds in alternating
    order, the median wall each. `warm` first runs every arm once untimed: on a GPU the first
    run of a process pays for kernel compiles and allocator growth, which read as a speedup of
    whatever runs second."""
    rows = []
    for b in batches:
        arms = [None] + list(drafters)
        def one(d, what: str) -> dict:
            out = run_once(model, prompts, max_new, b, d, k, drafter_checkpoint)
            # a line per run, warm ones too: a device call's timeout then still says how far it got
            print(f"[{workload} B={b}] {what} {d or 'none'}: {out['wall_s']:.2f}s, {out['steps']} steps, "
                  f"acceptance length {out['acceptance_length']:.3f}", file=sys.stderr, flush=True)
            return out
        if warm:
            for d in arms:
                one(d, "warm")
        runs: dict[str | None, list[dict]] = {d: [] for d in arms}
        for r in range(repeats):
            for d in (arms if r % 2 == 0 else arms[::-1]):
                runs[d].append(one(d, f"round {r + 1}"))
        plain_tokens = runs[None][0]["tokens"]
        plain_wall = statistics.median(x["wall_s"] for x in runs[None])
        for d in arms:
            walls = [x["wall_s"] for x in runs[d]]
            r = {**runs[d][0], "wall_s": statistics.median(walls), "wall_runs": walls}
            rows.append({**r, "workload": workload, "batch": b, "speedup": plain_wall / r["wall_s"],
                         "exact": all(x["tokens"] == plain_tokens for x in runs[d])})
            checkpoint(rows)
            if d is not None:
                print(f"[{workload} B={b}] {d}: acceptance length {r['acceptance_length']:.3f} "
                      f"(median {r['wall_s']:.2f}s of {len(walls)}, plain {plain_wall:.2f}s: "
                      f"{plain_wall / r['wall_s']:.2f}x)", file=sys.stderr, flush=True)
    return rows


def _summary(args, rows: list[dict]) -> dict:
    return {"device": args.device, "dtype": args.dtype, "model": args.model or "golden/k3-mini", "k": args.k,
            "prompts": args.prompts, "max_new": args.max_new, "shots": args.shots, "repeats": args.repeats,
            "warm": args.warm, "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3verify.perf.drafter_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target checkpoint dir or preset (default: golden/k3-mini)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--workloads", default="gsm8k,agentic")
    ap.add_argument("--drafters", default="ngram,model")
    ap.add_argument("--drafter-checkpoint", default=None, help="drafter dir (default: golden/drafters/<target>)")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--shots", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", default="1", help="comma list of max_num_seqs, e.g. 1,8,64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds per arm, alternating order (median)")
    ap.add_argument("--warm", action="store_true", help="run every arm once untimed first (the GPU run does)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    try:
        wls = [w for w in args.workloads.split(",") if w]
        drafters = [d for d in args.drafters.split(",") if d]
        batches = [int(x) for x in args.batch.split(",") if x]
        bad = [w for w in wls if w not in WORKLOADS] + [d for d in drafters if d not in DRAFTERS]
        if bad or not wls or not batches or min(batches) < 1 or min(args.prompts, args.max_new, args.k,
                                                                    args.repeats) < 1:
            raise K3Error(f"expected workloads in {WORKLOADS}, drafters in {DRAFTERS}, batch sizes, prompts, "
                          f"max-new, k and repeats >= 1; got {bad[0] if bad else 'a size < 1'}")
        torch.set_num_threads(args.threads)
        model = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype))
        rows: list[dict] = []

        def checkpoint(done: list[dict]) -> None:     # every finished row on file, before the next run
            if args.out:
                from k3verify.io import atomic_write_text
                atomic_write_text(args.out, json.dumps({**_summary(args, rows + done), "complete": False}) + "\n")
        for wl in wls:
            prompts = (gsm8k_prompts(args.prompts, args.shots) if wl == "gsm8k"
                       else agentic_prompts(model, args.prompts))
            rows += bench(model, wl, prompts, args.max_new, batches, drafters, args.k, args.drafter_checkpoint,
                          repeats=args.repeats, warm=args.warm, checkpoint=checkpoint)
    except (K3Error, ValueError) as exc:
        print(f"drafter_bench: {exc}", file=sys.stderr)
        return 2
    head = f"{'drafter':8} {'workload':8} {'B':>3} {'accept_len':>10} {'acc/verify':>10} {'tok/step':>8} " \
           f"{'wall_s':>7} {'speedup':>7} exact"
    print(head)
    for r in rows:
        print(f"{r['drafter']:8} {r['workload']:8} {r['batch']:>3} {r['acceptance_length']:>10.3f} "
              f"{r['mean_accepted']:>10.3f} {r['tokens_per_step']:>8.3f} {r['wall_s']:>7.2f} {r['speedup']:>7.2f} "
              f"{'yes' if r['exact'] else 'NO'}")
    line = json.dumps({**_summary(args, rows), "complete": True})
    if args.out:
        from k3verify.io import atomic_write_text
        atomic_write_text(args.out, line + "\n")
    print(line)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
