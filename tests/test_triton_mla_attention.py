"""Causal MLA attention in Triton with fixed 64-key blocks (optimized_stack/kernels/mla/attention.py):
the contract of model/mla.py blocked_attention against an fp64 softmax, a query's bits
independent of T, of the keys past its causal limit and of the other queries, a negative
control that is caught, one-line errors."""
from __future__ import annotations

import pytest
import torch

from triton_env import DEVICE, MARKS, MS, bit_equal, max_rel, tol

pytestmark = MARKS


def _attn():
    from optimized_stack.kernels.mla.attention import causal_attention
    return causal_attention


def _qkv(t, h, c, vd, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, h, w, generator=gen).to(dtype=dtype, device=DEVICE) for w in (c, c, vd))
    return q, k, v


def _reference64(q, k, v, q_pos, scale):
    q64, k64, v64 = (x.double().cpu() for x in (q, k, v))
    s = torch.einsum("thc,shc->ths", q64, k64) * scale
    visible = torch.arange(k.shape[0]).view(1, 1, -1) <= q_pos.cpu().view(-1, 1, 1)
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("ths,shv->thv", p, v64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,s,h,c,vd", [(1, 1, 2, 24, 16), (70, 70, 2, 24, 16), (5, 150, 3, 40, 24)],
                         ids=["T1-S1", "T70-S70-prefill", "T5-S150-chunk"])
def test_matches_fp64_softmax(t, s, h, c, vd, dtype):
    q, _, _ = _qkv(t, h, c, vd, dtype)
    _, k, v = _qkv(s, h, c, vd, dtype, seed=1)
    q_pos = torch.arange(s - t, s, device=DEVICE)
    out = _attn()(q, k, v, q_pos, c ** -0.5)
    assert out.dtype == torch.float32 and out.shape == (t, h, vd)
    err = max_rel(out, _reference64(q, k, v, q_pos, c ** -0.5))
    assert err <= (2e-6 if dtype == torch.float32 else tol(torch.float32)), f"max rel error {err:.2e}"


def test_close_to_the_cpu_blocked_reference():
    from optimized_stack.model.mla import blocked_attention
    q, k, v = _qkv(130, 2, 24, 16, torch.float32, seed=2)
    q_pos = torch.arange(130, device=DEVICE)
    ref = blocked_attention(q.cpu(), k.cpu(), v.cpu(), q_pos.cpu(), 24 ** -0.5)
    assert max_rel(_attn()(q, k, v, q_pos, 24 ** -0.5), ref) <= 2e-6


def _mismatches(attn, n=130, dtype=torch.float32, ms=MS + (64, 65, 129)):
    q, k, v = _qkv(n, 2, 24, 16, dtype, seed=3)
    pos = torch.arange(n, device=DEVICE)
    scale = 24 ** -0.5
    full = attn(q, k, v, pos, scale)
    bad = []
    for m in ms:
        if not bit_equal(attn(q[n - m:], k, v, pos[n - m:], scale), full[n - m:]):
            bad.append(f"chunk of the last {m} queries")                   # T changes
        if not bit_equal(attn(q[:m], k[:m], v[:m], pos[:m], scale), full[:m]):
            bad.append(f"first {m} queries over {m} keys")                 # S past the limit dropped
        if not bit_equal(attn(q[m - 1:m], k[:m], v[:m], pos[m - 1:m], scale), full[m - 1:m]):
            bad.append(f"query {m - 1} alone (decode)")
    # queries out of order, other queries changed: a query's bits are its own
    perm = torch.tensor([129, 3, 64, 0, 65, 100], device=DEVICE)
    if not bit_equal(attn(q[perm], k, v, pos[perm], scale), full[perm]):
        bad.append("permuted queries")
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_queries_are_batch_invariant(dtype):
    bad = _mismatches(_attn(), dtype=dtype)
    assert not bad, f"a query's bits depend on the call: {bad}"


def test_negative_control_key_block_by_call_is_caught():
    """The key block picked by the call (16 keys when T < 4, else 64): the online softmax
    rescales at other points; differs on the interpreter too."""
    def control(q, k, v, pos, scale):
        return _attn()(q, k, v, pos, scale, _block_n=16 if q.shape[0] < 4 else None)
    bad = _mismatches(control, ms=(1, 2, 3, 70, 100))
    assert bad, "control not caught: a key block that follows T passed the invariance test (test is void)"


@pytest.mark.parametrize("shapes,pos,match", [
    (((4, 2, 8), (4, 2, 8), (4, 2, 8)), (4, 1), r"q_pos must be 1-D \[T\] = \[4\], got shape \[4, 1\]"),
    (((4, 8), (4, 2, 8), (4, 2, 8)), (4,), r"q must be 3-D \[T, H, C\], got shape \[4, 8\]"),
    (((4, 2, 8), (4, 3, 8), (4, 3, 8)), (4,), r"k must be \[S, H, C\] = \[S, 2, 8\], got shape \[4, 3, 8\]"),
    (((4, 2, 8), (4, 2, 8), (5, 2, 8)), (4,), r"v must be \[S, H, Vd\] = \[4, 2, Vd\], got shape \[5, 2, 8\]"),
], ids=["pos-2d", "q-2d", "k-heads", "v-length"])
def test_bad_input_one_line_errors(shapes, pos, match):
    from optimized_stack.errors import K3Error
    q, k, v = (torch.zeros(s, device=DEVICE) for s in shapes)
    with pytest.raises(K3Error, match=match):
        _attn()(q, k, v, torch.zeros(pos, dtype=torch.long, device=DEVICE), 1.0)


def test_position_past_the_keys_is_rejected():
    from optimized_stack.errors import K3Error
    q, k, v = _qkv(2, 1, 8, 8, torch.float32)
    with pytest.raises(K3Error, match=r"q_pos must lie in 0..S-1 = 0..1, got 2"):
        _attn()(q, k, v, torch.tensor([1, 2], device=DEVICE), 1.0)


# ---- the mla_flash_bf16 toggle's form: P @ V on bf16 tensor cores (kernels/mla/flash_bf16.py) ----
def _flash(fault=None):
    import functools

    from optimized_stack.kernels.mla.flash_bf16 import flash_bf16_attention
    return functools.partial(flash_bf16_attention, _fault=fault)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_bf16_pv_form_is_close_to_fp64_and_not_the_reference_bits(dtype):
    q, k, v = _qkv(130, 2, 24, 16, dtype, seed=4)
    pos = torch.arange(130, device=DEVICE)
    want = _reference64(q, k, v, pos, 24 ** -0.5)
    fast = _flash()(q, k, v, pos, 24 ** -0.5)
    # P and V rounded to bf16 (2^-9 relative): ~1e-3 of max measured; the reference's is 2e-6 (fp32)
    assert max_rel(fast, want) <= 1e-2
    assert not bit_equal(fast, _attn()(q, k, v, pos, 24 ** -0.5)), "the bf16 P @ V form did not run"


def test_the_bf16_pv_form_keeps_the_reference_tiles_batch_invariant():
    bad = _mismatches(_flash(), dtype=torch.bfloat16)
    assert not bad, f"a query's bits depend on the call: {bad}"


def test_the_flash_mutant_sees_later_keys_of_its_block_and_is_far_off():
    q, k, v = _qkv(130, 2, 24, 16, torch.bfloat16, seed=4)
    pos = torch.arange(130, device=DEVICE)
    want = _reference64(q, k, v, pos, 24 ** -0.5)
    assert max_rel(_flash("diag_unmasked")(q, k, v, pos, 24 ** -0.5), want) > 0.1
    # a query at the end of its block has no later keys there: unchanged up to the bf16 form's error
    last = torch.tensor([63, 127], device=DEVICE)
    assert max_rel(_flash("diag_unmasked")(q[last], k, v, last, 24 ** -0.5), want[[63, 127]]) <= 1e-2
