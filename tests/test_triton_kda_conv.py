"""The fused decode conv (optimized_stack/kernels/kda/conv_step.py) against the batched step's
torch conv (engine/fast/kda_step.py conv_step), the exact toggle fused_kda_conv's claim: the same
output bits and the same new windows, for every row, whatever the batch; the seeded fault (taps
summed newest first) differs; bad input is one line."""
from __future__ import annotations

import pytest
import torch

from triton_env import DEVICE, ENGINE_PROMPTS, MARKS, bit_equal, engine_run

pytestmark = MARKS


def _case(b, c, taps, dtype, pool_dtype, slots_total=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = slots_total or b + 3
    x = (torch.randn(b, c, generator=gen) * 2).to(dtype)
    pool = (torch.randn(p, taps - 1, c, generator=gen) * 2).to(dtype).to(pool_dtype)
    weight = torch.randn(c, 1, taps, generator=gen).to(dtype)
    slots = torch.randperm(p, generator=gen)[:b]
    return [t.to(DEVICE) for t in (x, pool, slots, weight)]


def _both(x, pool, slots, weight, **kw):
    from optimized_stack.engine.fast.kda_step import conv_step
    from optimized_stack.kernels.kda.conv_step import fused_conv_step
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref = conv_step(x, ref_pool, slots, weight)
    got = fused_conv_step(x, got_pool, slots, weight, **kw)
    return ref, got, ref_pool, got_pool


@pytest.mark.parametrize("dtype,pool_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                              (torch.float16, torch.float16)], ids=["bf16", "bf16-fp32-pool", "fp16"])
@pytest.mark.parametrize("b,c,taps", [(1, 16, 4), (5, 200, 4), (3, 64, 2)], ids=["B1C16", "B5C200", "B3C64W2"])
def test_fused_conv_equals_conv_step_bit_for_bit(b, c, taps, dtype, pool_dtype):
    x, pool, slots, weight = _case(b, c, taps, dtype, pool_dtype)
    ref, got, ref_pool, got_pool = _both(x, pool, slots, weight)
    assert got.dtype == ref.dtype and bit_equal(got, ref), "output bits differ from conv_step"
    assert bit_equal(got_pool, ref_pool), "the new windows (or an untouched slot) differ from conv_step's"
    untouched = sorted(set(range(pool.shape[0])) - set(slots.tolist()))
    assert bit_equal(got_pool[untouched], pool[untouched]), "a slot no row owns was written"


def test_a_row_is_the_same_alone_and_in_a_batch():
    """Batch invariance: row i of a batch of 7 equals the same row run as a batch of 1."""
    from optimized_stack.kernels.kda.conv_step import fused_conv_step
    x, pool, slots, weight = _case(7, 130, 4, torch.bfloat16, torch.bfloat16, seed=3)
    batch = fused_conv_step(x, pool.clone(), slots, weight)
    for i in (0, 4, 6):
        alone = fused_conv_step(x[i:i + 1], pool.clone(), slots[i:i + 1], weight)
        assert bit_equal(alone[0], batch[i])


def test_the_seeded_fault_changes_the_bits_and_the_control_does_not():
    x, pool, slots, weight = _case(6, 256, 4, torch.bfloat16, torch.bfloat16, seed=5)
    ref, bad, _, _ = _both(x, pool, slots, weight, reversed_taps=True)
    assert not bit_equal(bad, ref), "taps summed newest first gave conv_step's bits: the check proves nothing"
    _, good, _, _ = _both(x, pool, slots, weight)
    assert bit_equal(good, ref)


@pytest.mark.parametrize("mutate,match", [
    (lambda a: {**a, "x": a["x"].float()}, "x must be bfloat16 or float16"),
    (lambda a: {**a, "weight": a["weight"][:, :, :3]}, "shapes disagree"),
    (lambda a: {**a, "x": a["x"][:, None]}, "expected x \\[B, C\\]"),
])
def test_bad_input_is_one_line(mutate, match):
    from optimized_stack.errors import K3Error
    from optimized_stack.kernels.kda.conv_step import fused_conv_step
    x, pool, slots, weight = _case(2, 32, 4, torch.bfloat16, torch.bfloat16)
    args = mutate({"x": x, "pool": pool, "slots": slots, "weight": weight})
    with pytest.raises(K3Error, match=match) as err:
        fused_conv_step(**args)
    assert "\n" not in str(err.value)


# ---- the toggle in the engine: batched decode with and without the fused conv ------------------
@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter form of the engine test (on a GPU the selftest judges it)")
def test_the_engine_with_the_fused_conv_is_bit_identical_and_its_mutant_is_not():
    from optimized_stack import load_model
    model = load_model("k3-mini", device="cpu", dtype=torch.bfloat16)
    tokens, rows, events = engine_run(model, ENGINE_PROMPTS)
    f_tokens, f_rows, f_events = engine_run(model, ENGINE_PROMPTS, fused_kda_conv=True)
    _, m_rows, _ = engine_run(model, ENGINE_PROMPTS, fused_kda_conv=True, faults={"mut_fused_conv_stale_window"})
    assert events.get("fast_fused_conv_rows", 0) == 0, "the control fired the fused conv's event"
    assert f_events.get("fast_fused_conv_rows", 0) > 0 and f_events.get("fast_decode_rows", 0) > 0
    assert f_tokens == tokens and f_rows.keys() == rows.keys()
    assert all(bit_equal(f_rows[k], rows[k]) for k in rows), "a logits row differs with the fused conv"
    assert any(not bit_equal(m_rows[k], rows[k]) for k in rows), "the stale-window mutant changed no logits row"


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter form of the engine test")
def test_an_fp32_model_keeps_the_torch_conv_and_says_so_by_its_silent_event():
    """The counted stack holds fused_kda_conv on every CUDA run; an fp32 model must still be served
    (conv_step runs), and the toggle's event stays silent, so its verdict is not a pass there."""
    from optimized_stack import load_model
    model = load_model("k3-mini", device="cpu", dtype=torch.float32)
    tokens, rows, _ = engine_run(model, ENGINE_PROMPTS[:2])
    f_tokens, f_rows, f_events = engine_run(model, ENGINE_PROMPTS[:2], fused_kda_conv=True)
    assert f_events.get("fast_fused_conv_rows", 0) == 0 and f_events.get("fast_decode_rows", 0) > 0
    assert f_tokens == tokens and all(bit_equal(f_rows[k], rows[k]) for k in rows)
