"""The price of exactness (issue 18 item 5): the same workloads on the GPU reference's invariant
profile and on torch's own forms (K3_GPU_PROFILE=torch), interleaved A/B, ratio with a 95% interval."""
from __future__ import annotations

import torch

from optimized_stack import load_model

from k3verify.scenarios import workloads

from .ab import interleaved
from .gpu_drift import with_profile


def section_price(run, model_src: str = "k3-small", repeats: int = 5) -> None:
    """Two workloads: one 4096-token prefill (kernel-bound: the profile's GEMMs, norms, attention
    and grid KDA against cuBLAS / torch / SDPA / whole-call chunk_kda), and the engine on a
    multi-request workload (dispatch-bound on today's per-request engine: issue 20)."""
    from optimized_stack.engine import Engine, EngineOptions, SamplingParams
    model = load_model(model_src, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (4096,), generator=torch.Generator().manual_seed(0))

    def prefill() -> None:
        model.logits(ids)
        torch.cuda.synchronize()

    ab = interleaved(lambda: with_profile("torch", prefill), lambda: with_profile("invariant", prefill),
                     repeats=repeats, tokens=4096, labels=("torch defaults", "invariant profile"))
    _price_row(run, model_src, "prefill 4096 tokens, one request, bf16", repeats, ab)
    sc = workloads.build("multi_length", scale=1.0)
    tokens = sum(r.max_new_tokens for r in sc.requests)

    def engine_run() -> None:
        eng = Engine(model, EngineOptions(continuous_batching=True, chunked_prefill=True, token_budget=512,
                                          max_num_seqs=8))
        for r in sc.requests:
            eng.add_request(list(r.prompt_ids), SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True),
                            request_id=r.request_id)
        eng.run()
        torch.cuda.synchronize()

    ab = interleaved(lambda: with_profile("torch", engine_run), lambda: with_profile("invariant", engine_run),
                     repeats=3, tokens=tokens, labels=("torch defaults", "invariant profile"))
    _price_row(run, model_src, f"{sc.name}: {len(sc.requests)} requests through the engine, continuous batching "
                               f"+ chunked prefill (budget 512), bf16", 3, ab)


def _price_row(run, model_src: str, workload: str, repeats: int, ab) -> None:
    mid = len(ab.times_a) // 2
    item = {"model": model_src, "workload": workload, "repeats": repeats,
            "seconds_torch": ab.times_a, "seconds_invariant": ab.times_b,
            # > 1: the invariant profile is slower by this factor
            "price_of_exactness": 1.0 / ab.ratio, "ci95": [1.0 / ab.ci_high, 1.0 / ab.ci_low],
            "tokens_per_s_torch": ab.tokens / sorted(ab.times_a)[mid],
            "tokens_per_s_invariant": ab.tokens / sorted(ab.times_b)[mid]}
    run.log(f"price of exactness ({model_src}, {workload}): {item['price_of_exactness']:.3f}x "
            f"[{item['ci95'][0]:.3f}, {item['ci95'][1]:.3f}]")
    run.add("price", item)
