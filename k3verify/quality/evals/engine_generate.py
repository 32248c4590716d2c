"""A generate_fn that answers many prompts at once through the engine's continuous batching.

The quality gates ask the same question of the reference and of each approx toggle: GSM8K's
500 questions one prompt at a time is ~90% host dispatch on a GPU (one forward per token per
question). Continuous batching is an exact engine option (row-stable ops, state only copied:
engine.py), so the batched answers are the one-at-a-time answers bit for bit
(tests/test_engine_generate.py compares them); the gain is rows per forward, not numerics.
Op-slot toggles apply inside it as they do on the sequential path, since the engine runs the
model's ops.

`stack_toggles` runs the engine with exact engine toggles on (the counted stack: batched_decode,
and cuda_graphs on CUDA): their contract is bit-identity with the reference, which the same
suite judges, so the answers stay the reference's while the decode is one forward per step
for every running request instead of one per request. `stats["events"]` counts the engine's
path events (fast_decode_rows, graph_replay), the evidence that the stack ran.

A request stops on eos, on max_new_tokens, or as soon as its decoded text holds a stop
string (Engine.abort_request between steps, as a server does), so no question decodes past
its answer.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from k3verify.quality.evals.lm_eval_model import GenerateFn, truncate_at_stop


def engine_generate_fn(model, tokenizer, *, batch: int, add_bos: bool = False,
                       token_budget: int | None = None, stack_toggles: Sequence[str] = ()) -> GenerateFn:
    """Greedy answers for a list of prompts, `batch` requests running at once.

    token_budget: tokens per engine step (prefill chunks + decodes); default batch + 2048, so a
    step can decode every running request and prefill the next prompts' chunks.
    """
    from optimized_stack import toggles as registry
    from optimized_stack.engine.engine import Engine
    from optimized_stack.engine.options import EngineOptions, SamplingParams

    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: expected an integer >= 1, got {batch!r}")
    budget = token_budget if token_budget is not None else batch + 2048

    def text_of(tokens: Sequence[int]) -> str:
        body = tokens[:-1] if tokens and tokens[-1] == tokenizer.eos_id else tokens
        return tokenizer.decode(body, skip_special=True)

    def generate(prompts: list[str], max_new_tokens: int, stop: list[str]) -> list[str]:
        encoded = [tokenizer.encode(p, add_bos=add_bos) for p in prompts]
        # an MLA pool that holds the `batch` longest requests whole: a smaller one would preempt
        # and recompute (exact, but the time the batching was for)
        longest = sorted((len(ids) + max_new_tokens for ids in encoded), reverse=True)[:batch]
        with registry.applied(list(stack_toggles)) as applied:
            sized = {"continuous_batching": True, "max_num_seqs": batch, "token_budget": budget,
                     "device_cache_tokens": sum(longest) + 64 * len(longest)}
            # the stack's options on the KDA grid in force (the sub-block toggles' wider blocks)
            opts = EngineOptions.from_dict({**applied.engine_for(model.device), **sized})
            return _run(Engine(model, opts), encoded, max_new_tokens, stop)

    def _run(engine, encoded, max_new_tokens: int, stop: list[str]) -> list[str]:
        params = SamplingParams(max_new_tokens=max_new_tokens, stop_ids=(tokenizer.eos_id,))
        rids = [engine.add_request(ids, params) for ids in encoded]
        generated: dict[str, list[int]] = {rid: [] for rid in rids}
        stops = [s for s in stop if s]
        steps = most_running = 0
        # where the time goes, by step: a step that computed a prompt token (prefill chunks, with
        # or without decodes beside them) or one that only decoded. Every step ends in a host read
        # of its sampled tokens, so a step's wall clock includes its device work. On the H200
        # GSM8K run this decides what a faster prefill or decode step would buy (issue 27).
        timing = {"prefill_steps": 0, "prefill_s": 0.0, "prefill_tokens": 0, "decode_steps": 0, "decode_s": 0.0}
        with torch.no_grad():
            while engine.has_unfinished():
                t0 = time.perf_counter()
                outs = engine.step()
                dt = time.perf_counter() - t0
                prompt_tokens = sum(o.num_tokens for o in outs if o.new_token is None or o.num_tokens > 1)
                kind = "prefill" if prompt_tokens else "decode"
                timing[f"{kind}_steps"] += 1
                timing[f"{kind}_s"] += dt
                timing["prefill_tokens"] += prompt_tokens
                steps += 1
                most_running = max(most_running, len(outs))
                for out in outs:
                    if not out.new_tokens:
                        continue
                    toks = generated[out.request_id]
                    toks.extend(out.new_tokens)
                    if not out.finished and stops and any(s in text_of(toks) for s in stops):
                        engine.abort_request(out.request_id)
        # evidence that the prompts were batched: the engine steps and the most requests one step ran
        generate.stats = {"prompts": len(encoded), "steps": steps, "most_running": most_running,
                          "stack": list(stack_toggles), "events": dict(engine.events),
                          "timing": {k: round(v, 4) if isinstance(v, float) else v for k, v in timing.items()}}
        return [truncate_at_stop(text_of(generated[rid]), stop) for rid in rids]

    generate.stats = {}
    return generate
