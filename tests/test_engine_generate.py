"""The batched generate_fn the quality gates use on a GPU answers exactly as the one-at-a-time
reference does, and the comparison can fail."""
from __future__ import annotations

import pytest
import torch

from k3verify.quality.evals import gsm8k_synth
from k3verify.quality.evals.engine_generate import engine_generate_fn
from k3verify.quality.evals.gsm8k import greedy_generate_fn
from optimized_stack.model import ops
from optimized_stack.engine.engine import Engine
from optimized_stack.engine.options import EngineOptions, SamplingParams
from optimized_stack.loading import load_model
from optimized_stack.tokenizer import load_tokenizer

STOP = ["\n\nQuestion:"]


@pytest.fixture(scope="module")
def model_and_tok():
    torch.manual_seed(0)
    return load_model(None), load_tokenizer(None)


def _prompts(n: int) -> list[str]:
    # zero-shot: the CPU reference computes rows one by one, so short prompts keep this in seconds
    return [f"Question: {d['question']}\nAnswer:" for d in gsm8k_synth.generate("test", n, seed=9)]


def test_batched_answers_equal_one_at_a_time(model_and_tok):
    model, tok = model_and_tok
    prompts = _prompts(3)
    ref = greedy_generate_fn(model, tok)(prompts, 20, STOP)
    gen = engine_generate_fn(model, tok, batch=2, token_budget=24)
    out = gen(prompts, 20, STOP)
    assert out == ref
    assert any(ref), "every answer empty: nothing was compared"
    # evidence it batched: 3 prompts through 2 slots, several requests in one step
    assert gen.stats["prompts"] == 3 and gen.stats["most_running"] >= 2


def test_comparison_fails_when_one_side_is_wrong(model_and_tok):
    """Negative control: a seeded fault on the batched side only parts the answers."""
    model, tok = model_and_tok
    prompts = _prompts(3)
    ref = greedy_generate_fn(model, tok)(prompts, 16, STOP)
    plain = ops.OPS.linear
    with ops.override(linear=lambda x, w, *a, **k: plain(x, w, *a, **k) * 0.7):
        out = engine_generate_fn(model, tok, batch=3)(prompts, 16, STOP)
    assert out != ref


def test_a_request_stopped_early_changes_nothing_for_the_others(model_and_tok):
    """What engine_generate_fn relies on when a stop string ends one request between steps."""
    model, _ = model_and_tok
    eng = Engine(model, EngineOptions(continuous_batching=True, max_num_seqs=2, token_budget=64))
    a = eng.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=6, ignore_eos=True))
    b = eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
    eng.step()
    eng.step()
    eng.abort_request(a)
    res = eng.run()
    assert len(res[a].tokens) < 6
    solo = Engine(model, EngineOptions())
    rid = solo.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert solo.run()[rid].tokens == res[b].tokens and len(res[b].tokens) == 6


def test_gsm8k_units_reuse_the_reference_answers_never_the_candidates(monkeypatch, tmp_path):
    """Two toggles' gsm8k units in one process: the reference answers once, each candidate
    answers itself. Negative control: a candidate that answers wrongly fails its gate, which it
    could not if it were read from the reference's cache."""
    import k3verify.quality.evals.gsm8k as ev
    from k3verify.kinds import gsm8k as kind
    from k3verify.kinds.base import Context, Unit

    calls = []

    def fake_greedy(model, tokenizer, add_bos=False):
        def generate(prompts, max_new_tokens, stop):
            faulty = ops.OPS.moe_route is not None          # mut_router_bias_in_weights swaps it
            calls.append(("cand" if faulty else "ref", len(prompts)))
            out = []
            for p in prompts:
                q = p.rsplit("Question: ", 1)[-1]
                out.append(" #### 0" if faulty else f" #### {ANSWERS[q.split(chr(10))[0]]}")
            return out
        return generate

    from k3verify.quality.evals import gsm8k_synth as synth
    ANSWERS = {d["question"]: d["answer"].split("####")[-1].strip() for d in synth.generate("test", 300)}
    monkeypatch.setattr(ev, "greedy_generate_fn", fake_greedy)
    model, _ = load_model(None), None
    ctx = Context(model, model_arg=None, run_dir=tmp_path)
    opts = {**kind.OPTIONS, "limit": 300, "num_fewshot": 0}
    good = kind.run(Unit("gsm8k", "g", opts, "gemm_per_shape"), ctx)
    bad = kind.run(Unit("gsm8k", "g", opts, "mut_router_bias_in_weights"), ctx)
    assert sum(n for side, n in calls if side == "ref") == 300 * 2   # reference once, gemm_per_shape's side once
    assert sum(n for side, n in calls if side == "cand") == 300
    assert all(r.status == "pass" for r in good)
    assert all(r.status == "fail" for r in bad)


def test_counted_stack_answers_equal_the_reference_and_its_path_ran(model_and_tok):
    """gsm8k `stack = "counted"`: batched_decode on (the CPU's counted stack), the same answers
    bit for bit, with the fast step's rows as the evidence that it ran."""
    from k3verify.serving.stack import counted_toggles
    model, tok = model_and_tok
    prompts = _prompts(3)
    ref = greedy_generate_fn(model, tok)(prompts, 20, STOP)
    gen = engine_generate_fn(model, tok, batch=3, stack_toggles=counted_toggles("cpu"))
    assert gen(prompts, 20, STOP) == ref
    assert gen.stats["stack"] == ["batched_decode", "prefill_sorted_experts", "prefill_batched_mixers"]
    fired = gen.stats["events"]
    assert fired.get("fast_decode_rows", 0) > 0 and fired.get("prefill_sorted_experts", 0) > 0
    assert fired.get("prefill_batched_mixers", 0) > 0, "the three prompts were not prefilled in one forward"
    plain = engine_generate_fn(model, tok, batch=3)
    plain(prompts, 20, STOP)
    assert plain.stats["events"].get("fast_decode_rows", 0) == 0     # the control: off unless asked


def test_counted_stack_comparison_fails_on_a_fast_step_fault(model_and_tok):
    """Negative control: a fault in the batched step's conv rows (a shipped mutant) parts the answers."""
    model, tok = model_and_tok
    prompts = _prompts(3)
    ref = greedy_generate_fn(model, tok)(prompts, 20, STOP)
    gen = engine_generate_fn(model, tok, batch=3, stack_toggles=("batched_decode", "mut_fast_conv_wrong_row"))
    assert gen(prompts, 20, STOP) != ref


def test_the_step_timing_splits_prefill_from_decode_and_counts_every_prompt_token(model_and_tok):
    """stats["timing"]: steps that computed prompt tokens vs steps that only decoded; every prompt
    token is counted once (the control: the prompts' own lengths), every step is one of the two."""
    model, tok = model_and_tok
    prompts = _prompts(3)
    gen = engine_generate_fn(model, tok, batch=2)
    gen(prompts, 12, STOP)
    t = gen.stats["timing"]
    assert t["prefill_steps"] + t["decode_steps"] == gen.stats["steps"]
    assert t["prefill_tokens"] == sum(len(tok.encode(p)) for p in prompts)
    assert t["prefill_steps"] >= 1 and t["decode_steps"] >= 1 and t["prefill_s"] > 0 and t["decode_s"] > 0
