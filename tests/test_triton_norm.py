"""Row RMSNorm, L2 norm, row sum / row dot in Triton (optimized_stack/kernels/norm/rows.py):
the reference's semantics (ops.rms_norm / ops.l2_norm) against fp64, rows bit-identical
whatever the batch, a negative control that is caught, one-line errors."""
from __future__ import annotations

import pytest
import torch

from triton_env import DEVICE, MARKS, max_rel, row_mismatches, tol

pytestmark = MARKS


def _rows():
    from optimized_stack.kernels.norm import rows
    return rows


def _x(m, d, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, d, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def _rms_ref(x, w, eps):
    """ops.rms_norm in fp64: normalise, round to x's dtype, times the gain (rounded to the result)."""
    x64 = x.double().cpu()
    y = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).double()
    return y if w is None else y * w.double().cpu()


CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
         (torch.float32, None)]


@pytest.mark.parametrize("dtype,w_dtype", CASES, ids=["fp32", "bf16", "bf16-x-fp32-gain", "fp32-no-gain"])
@pytest.mark.parametrize("d", [16, 100, 1500], ids=lambda d: f"D{d}")
def test_rms_norm_matches_reference(d, dtype, w_dtype):
    x = _x(9, d, dtype, scale=3.0)
    w = None if w_dtype is None else _x(1, d, w_dtype, seed=1)[0]
    y = _rows().rms_norm_rows(x, w, 1e-5)
    expect_dtype = dtype if w is None else torch.promote_types(dtype, w_dtype)
    assert y.dtype == expect_dtype, f"result dtype: expected {expect_dtype} as torch's `y * weight`, got {y.dtype}"
    err = max_rel(y, _rms_ref(x, w, 1e-5))
    assert err <= tol(expect_dtype) + (tol(dtype) if w is not None else 0), f"max rel error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_l2_norm_and_row_sums_match_reference(dtype):
    x, z = _x(11, 1300, dtype), _x(11, 1300, dtype, seed=3)
    x64, z64 = x.double().cpu(), z.double().cpu()
    l2 = _rows().l2_norm_rows(x, 1e-6)
    assert l2.dtype == dtype
    assert max_rel(l2, x64 * torch.rsqrt(x64.pow(2).sum(-1, keepdim=True) + 1e-6)) <= tol(dtype)
    s, dot = _rows().row_sum(x), _rows().row_dot(x, z)
    assert s.dtype == dot.dtype == torch.float32 and s.shape == (11,)
    assert max_rel(s, x64.sum(-1)) <= 1e-4           # cancellation: relative to the largest sum
    assert max_rel(dot, (x64 * z64).sum(-1)) <= 1e-4


@pytest.mark.parametrize("op", ["rms_norm", "l2_norm", "row_sum", "row_dot"])
@pytest.mark.parametrize("d", [48, 1500], ids=lambda d: f"D{d}")
def test_rows_are_batch_invariant(op, d):
    rows = _rows()
    w, z = _x(1, d, torch.float32, seed=5)[0], _x(40, d, torch.float32, seed=6)
    x = _x(40, d, torch.float32, seed=4)
    fns = {"rms_norm": lambda t: rows.rms_norm_rows(t, w, 1e-5), "l2_norm": lambda t: rows.l2_norm_rows(t),
           "row_sum": rows.row_sum}
    if op == "row_dot":                               # z's rows follow x's rows
        full = rows.row_dot(x, z)
        for m in (1, 2, 3, 5, 8, 13, 17, 33):
            assert torch.equal(rows.row_dot(x[:m], z[:m]), full[:m]), f"row_dot first {m}"
            assert torch.equal(rows.row_dot(x[-m:], z[-m:]), full[-m:]), f"row_dot last {m}"
        return
    bad = row_mismatches(fns[op], x)
    assert not bad, f"{op}: a row's bits depend on the batch: {bad}"


def test_rms_norm_bf16_is_batch_invariant():
    x, w = _x(40, 300, torch.bfloat16, scale=2.0), _x(1, 300, torch.bfloat16, seed=1)[0]
    assert not row_mismatches(lambda t: _rows().rms_norm_rows(t, w, 1e-5), x)


def test_negative_control_chunk_width_by_rows_is_caught():
    """The chunk width picked by the row count (16 below 8 rows, else the width's own): the sum
    of squares is grouped differently, and the interpreter (numpy) shows it too."""
    rows = _rows()
    x = _x(40, 128, torch.float32, seed=7, scale=3.0)
    bad = row_mismatches(lambda t: rows.row_sum(t, _block_d=16 if t.shape[0] < 8 else None), x)
    assert bad, "control not caught: a chunk width that follows M passed the invariance test (test is void)"
    bad = row_mismatches(lambda t: rows.rms_norm_rows(t, None, 1e-5, _block_d=16 if t.shape[0] < 8 else None), x)
    assert bad, "control not caught for rms_norm"


@pytest.mark.parametrize("call,match", [
    (lambda r: r.rms_norm_rows(torch.zeros(2, 3, 4, device=DEVICE), None, 1e-5), r"x must be 2-D \[M, D\], got shape \[2, 3, 4\]"),
    (lambda r: r.rms_norm_rows(torch.zeros(2, 4, device=DEVICE), torch.ones(5, device=DEVICE), 1e-5),
     r"weight must be 1-D \[D\] = \[4\], got shape \[5\]"),
    (lambda r: r.l2_norm_rows(torch.zeros(2, 4, dtype=torch.float64, device=DEVICE)),
     r"x must be bfloat16, float16 or float32, got torch.float64"),
    (lambda r: r.row_dot(torch.zeros(2, 4, device=DEVICE), torch.zeros(3, 4, device=DEVICE)),
     r"z must have x's shape \[2, 4\], got \[3, 4\]"),
], ids=["x-3d", "gain-width", "fp64", "dot-shape"])
def test_bad_input_one_line_errors(call, match):
    from optimized_stack.errors import K3Error
    with pytest.raises(K3Error, match=match):
        call(_rows())
