"""The fused MoE combine (optimized_stack/kernels/moe/combine.py) against the batched step's torch
combine (engine/fast/moe_static.py _combine), the exact toggle fused_moe_combine's claim: the same
fp32 bits for every row whatever the batch; its seeded fault (experts added in slot order) differs
from three experts a row up and is equivalent at two (why its mutant is judged on k3-small, not
k3-mini); bad input is one line; and through the engine, bit-identical logits with its event."""
from __future__ import annotations

import pytest
import torch

from triton_env import DEVICE, ENGINE_PROMPTS, MARKS, bit_equal, engine_run

pytestmark = MARKS


def _case(tokens, top_k, n_exp, width, seed=0, zero_weight=False):
    from optimized_stack.engine.fast.moe_static import placement
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(n_exp, generator=gen)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=gen)
    if zero_weight:
        w[:, 0] = 0.0                       # -0.0 products (0 * negative): +0.0 from zeros in both
    out = torch.randn(n_exp, tokens, width, generator=gen) * 3
    flat, pos = placement(idx, n_exp)
    return [t.to(DEVICE) for t in (out, flat, pos, idx, w)]


def _both(out, flat, pos, idx, w, **kw):
    from optimized_stack.engine.fast.moe_static import _combine
    from optimized_stack.kernels.moe.combine import fused_combine
    return _combine(out, flat, pos, idx, w), fused_combine(out, pos, idx, w, **kw)


@pytest.mark.parametrize("tokens,top_k,n_exp,width", [(1, 2, 8, 64), (9, 4, 32, 200), (64, 8, 16, 130)],
                         ids=["T1k2", "T9k4", "T64k8"])
@pytest.mark.parametrize("zero_weight", [False, True], ids=["", "zero-w"])
def test_fused_combine_equals_the_torch_combine_bit_for_bit(tokens, top_k, n_exp, width, zero_weight):
    ref, got = _both(*_case(tokens, top_k, n_exp, width, zero_weight=zero_weight))
    assert got.dtype == torch.float32 and bit_equal(got, ref)


def test_a_row_is_the_same_alone_and_in_a_batch():
    from optimized_stack.kernels.moe.combine import fused_combine
    out, flat, pos, idx, w = _case(12, 4, 16, 96, seed=2)
    batch = fused_combine(out, pos, idx, w)
    for t in (0, 7, 11):                     # row t alone: its expert rows at the same buffer rows
        alone = fused_combine(out, pos[t * 4:(t + 1) * 4], idx[t:t + 1], w[t:t + 1])
        assert bit_equal(alone[0], batch[t])


def test_the_slot_order_fault_differs_from_three_experts_and_is_equivalent_at_two():
    ref, bad = _both(*_case(32, 4, 16, 256, seed=4), slot_order=True)
    assert not bit_equal(bad, ref), "the slot-order sum gave the expert-order bits at top-4: the check proves nothing"
    ref2, bad2 = _both(*_case(32, 2, 16, 256, seed=4), slot_order=True)
    assert bit_equal(bad2, ref2), "(0 + a) + b == (0 + b) + a: at top-2 the fault cannot show"


@pytest.mark.parametrize("mutate,match", [
    (lambda a: {**a, "out": a["out"].to(torch.bfloat16)}, "out must be fp32"),
    (lambda a: {**a, "w": a["w"][:, :1]}, "shapes disagree"),
])
def test_bad_input_is_one_line(mutate, match):
    from optimized_stack.errors import K3Error
    from optimized_stack.kernels.moe.combine import fused_combine
    out, _, pos, idx, w = _case(3, 2, 4, 16)
    with pytest.raises(K3Error, match=match) as err:
        fused_combine(**mutate({"out": out, "pos": pos, "idx": idx, "w": w}))
    assert "\n" not in str(err.value)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter form of the engine test (on a GPU the selftest judges it)")
def test_the_engine_with_the_fused_combine_is_bit_identical_and_fires_its_events():
    from optimized_stack import load_model
    model = load_model("k3-mini", device="cpu", dtype=torch.bfloat16)
    tokens, rows, events = engine_run(model, ENGINE_PROMPTS)
    f_tokens, f_rows, f_events = engine_run(model, ENGINE_PROMPTS, fused_moe_combine=True)
    _, m_rows, _ = engine_run(model, ENGINE_PROMPTS, fused_moe_combine=True, faults={"mut_fused_combine_drops_last"})
    assert any(not bit_equal(m_rows[k], rows[k]) for k in rows), "the dropped-expert mutant changed no logits row"
    assert events.get("fast_fused_combine_rows", 0) == 0, "the control fired the fused combine's event"
    assert f_events.get("fast_fused_combine_rows", 0) > 0
    assert f_events.get("fast_fused_combine_three_plus", 0) == 0, "k3-mini routes two experts a row"
    assert f_tokens == tokens and all(bit_equal(f_rows[k], rows[k]) for k in rows)


def test_the_dropped_expert_fault_differs_at_any_top_k():
    for top_k in (2, 4):
        ref, bad = _both(*_case(16, top_k, 8, 64, seed=top_k), drop_last=True)
        assert not bit_equal(bad, ref)
