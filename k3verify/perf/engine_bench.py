"""Engine benchmark on an agentic-shaped workload: reference vs each toggle vs all exact toggles.

    python -m k3verify.perf.engine_bench [--sessions 3 --turns 3 --repeats 3 --threads 1]

Workload (seeded, closed loop): a shared system/tools prefix; sessions whose every turn
re-sends the whole history plus new user tokens (a turn is submitted when the previous
one finishes); after each session's first turn a subagent fork continues from that
history with different tokens. Runs are interleaved A/B in one process (ref, cand, ref,
cand, ...) and the speedup is perf/ab.py's: the geometric mean of the per-pair time ratios
with a 95% t-interval (the statistic every k3verify speed ratio uses). Each candidate's
tokens are checked against the reference (a fast toggle that changes tokens is flagged).
Prints a table, then one line of JSON.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from k3verify.perf.ab import ABResult
from optimized_stack import load_model, toggles
from optimized_stack.engine.engine import Engine
from optimized_stack.engine.options import EngineOptions, SamplingParams


def exact_engine_toggles() -> list[str]:
    """The exact engine toggles from the registry, speculation aside (its drafts want their own
    workload, and the "all exact" configuration stacks everything else on one engine)."""
    return [t.name for t in toggles.all_toggles("optimization")
            if t.engine and t.contract.kind == "exact" and "speculative" not in t.engine]


@dataclass(frozen=True)
class Workload:
    system: list[int]
    sessions: list[list[list[int]]]        # session -> turn -> new tokens (turn 0 after system)
    forks: list[list[int]]                 # per session: fork tokens after turn 0
    params: SamplingParams


def make_workload(seed: int, sessions: int, turns: int, system_len: int, turn_len: int,
                  max_new: int) -> Workload:
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=g).tolist()
    return Workload(rand(system_len), [[rand(turn_len) for _ in range(turns)] for _ in range(sessions)],
                    [rand(turn_len) for _ in range(sessions)],
                    SamplingParams(max_new_tokens=max_new, ignore_eos=True))


def run_sessions(eng: Engine, wl: Workload, *, on_submit=None, on_finish=None) -> None:
    """The closed loop: every session's first turn, then as each turn finishes the session's next
    turn on its real history (and after turn 0 its fork), until nothing is left.
    on_submit(rid) / on_finish(rid) let a caller time requests."""
    prompts: dict[str, list[int]] = {}

    def submit(rid: str, prompt: list[int]) -> None:
        prompts[rid] = prompt
        if on_submit is not None:
            on_submit(rid)
        eng.add_request(prompt, wl.params, request_id=rid, arrival_step=eng.step_index)
    for s, turns in enumerate(wl.sessions):
        submit(f"s{s}t0", wl.system + turns[0])
    while eng.has_unfinished():
        for out in eng.step():
            if not out.finished:
                continue
            rid = out.request_id
            if on_finish is not None:
                on_finish(rid)
            history = prompts[rid] + eng.results[rid].tokens
            if "f" not in rid:
                s, t = (int(x) for x in rid[1:].split("t"))
                if t + 1 < len(wl.sessions[s]):
                    submit(f"s{s}t{t + 1}", history + wl.sessions[s][t + 1])
                if t == 0:
                    submit(f"s{s}f", history + wl.forks[s])


def drive(model, wl: Workload, opts: EngineOptions) -> tuple[float, dict, Engine]:
    """Run the closed-loop workload; returns (seconds, {rid: tokens}, engine)."""
    eng = Engine(model, opts)
    t0 = time.perf_counter()
    run_sessions(eng, wl)
    dt = time.perf_counter() - t0
    return dt, {rid: r.tokens for rid, r in eng.results.items()}, eng


def bench(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    wl = make_workload(args.seed, args.sessions, args.turns, args.system_len, args.turn_len, args.max_new)
    _, ref_tokens, ref_eng = drive(model, wl, EngineOptions())          # warm-up + oracle
    rm = ref_eng.metrics
    work_tokens = rm.prompt_tokens + rm.generated_tokens
    exact = exact_engine_toggles()
    configs = [[t] for t in (args.toggles or exact)] + [exact]
    rows = []
    for names in configs:
        label = "all exact" if names is configs[-1] else names[0]
        ref_times, cand_times = [], []
        same = True
        extra = {} if args.device_tokens is None else {"device_cache_tokens": args.device_tokens}
        for _ in range(args.repeats):
            # the pair's reference runs outside the candidate's patches (an op swap must not leak)
            ref_times.append(drive(model, wl, EngineOptions())[0])
            with toggles.applied(names) as applied:
                opts = EngineOptions.from_dict({**applied.engine_for(model.device), **extra})
                dt, tokens, eng = drive(model, wl, opts)
            cand_times.append(dt)
            same = same and tokens == ref_tokens
        m = eng.metrics
        ab = ABResult("reference", label, ref_times, cand_times, work_tokens).to_dict()
        rows.append({"config": label, "ref_tok_s": ab["tokens_per_s_a"], "cand_tok_s": ab["tokens_per_s_b"],
                     "speedup": ab["ratio"], "ci95": ab["ci95"], "hit_tokens": m.prefix_hit_tokens,
                     "hit_rate": m.hit_rate, "tokens_computed": m.tokens_computed,
                     "evictions": m.evictions, "restores": m.restores, "preemptions": m.preemptions,
                     "same_tokens": same})
    return {"model": args.model, "threads": args.threads, "repeats": args.repeats,
            "requests": rm.requests_finished, "prompt_tokens": rm.prompt_tokens,
            "generated_tokens": rm.generated_tokens, "reusable_tokens": rm.reusable_tokens,
            "reusable_fraction": rm.reusable_fraction, "rows": rows}


def print_table(res: dict) -> None:
    print(f"workload: {res['requests']} requests, {res['prompt_tokens']} prompt + {res['generated_tokens']} "
          f"generated tokens; theoretical reusable prefix {res['reusable_tokens']} tokens "
          f"({100 * res['reusable_fraction']:.1f}% of prompt tokens); threads={res['threads']}, "
          f"repeats={res['repeats']}")
    head = f"{'config':22} {'ref tok/s':>10} {'cand tok/s':>10} {'speedup':>8} {'[95% CI]':>13} " \
           f"{'hit tok':>8} {'hit/reus':>8} {'computed':>8} {'evict':>5} {'restore':>7} {'preempt':>7} {'same':>5}"
    print(head)
    print("-" * len(head))
    for r in res["rows"]:
        print(f"{r['config']:22} {r['ref_tok_s']:10.0f} {r['cand_tok_s']:10.0f} {r['speedup']:7.2f}x "
              f"{r['ci95'][0]:5.2f}-{r['ci95'][1]:<6.2f} {r['hit_tokens']:8d} {100 * r['hit_rate']:7.1f}% "
              f"{r['tokens_computed']:8d} {r['evictions']:5d} {r['restores']:7d} {r['preemptions']:7d} "
              f"{'yes' if r['same_tokens'] else 'NO':>5}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="k3-mini")
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-len", type=int, default=192)
    p.add_argument("--turn-len", type=int, default=24)
    p.add_argument("--max-new", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device-tokens", type=int, default=None, help="override every candidate's MLA pool")
    p.add_argument("--toggles", nargs="*", default=None, help="single toggles to run (default: all exact)")
    args = p.parse_args(argv)
    res = bench(args)
    print_table(res)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
