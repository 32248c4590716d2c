"""The batch-invariant Triton GEMM (optimized_stack/kernels/gemm/invariant.py): close to an fp64
product, rows bit-identical whatever the batch, a negative control that is caught, and one-line
errors at the entry point. On a CPU it runs through Triton's interpreter (`make test-triton`)."""
from __future__ import annotations

import pytest
import torch

from triton_env import DEVICE, MARKS, max_rel, row_mismatches, tol

pytestmark = MARKS


def _matmul():
    from optimized_stack.kernels.gemm.invariant import matmul
    return matmul


def _inputs(m, k, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=DEVICE)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype=dtype, device=DEVICE)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,k,n", [(1, 16, 24), (13, 96, 40), (40, 130, 72)], ids=lambda v: str(v))
def test_matches_fp64_product(m, k, n, dtype):
    x, w = _inputs(m, k, n, dtype)
    y = _matmul()(x, w)
    assert y.dtype == dtype and y.shape == (m, n)
    err = max_rel(y, x.double().cpu() @ w.double().cpu().T)
    assert err <= tol(dtype), f"max rel error {err:.2e} above the {dtype} tolerance {tol(dtype):.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_are_batch_invariant(dtype):
    x, w = _inputs(40, 160, 72, dtype, seed=1)
    bad = row_mismatches(lambda t: _matmul()(t, w), x)
    assert not bad, f"a row's bits depend on the batch: {bad}"


def test_small_n_weights_take_their_tiles_and_stay_batch_invariant():
    """A router-sized fp32 weight (N <= SMALL_N) takes the small tile, chosen by N alone; its rows are
    batch-invariant (the property), and the fp64 product holds. The control beside it: the same
    weight one row past SMALL_N takes the default tile."""
    from optimized_stack.kernels.gemm import invariant as inv
    assert inv.tiles_for(torch.float32, 32) == inv.SMALL_N_TILES[torch.float32]
    assert inv.tiles_for(torch.float32, inv.SMALL_N + 1) == inv.TILES[torch.float32]
    assert inv.tiles_for(torch.bfloat16, 32) == inv.TILES[torch.bfloat16]
    x, w = _inputs(40, 160, 32, torch.float32, seed=3)
    bad = row_mismatches(lambda t: _matmul()(t, w), x)
    assert not bad, f"a row's bits depend on the batch under the small-N tile: {bad}"
    err = max_rel(_matmul()(x, w), x.double().cpu() @ w.double().cpu().T)
    assert err <= tol(torch.float32), f"max rel error {err:.2e}"


@pytest.mark.skipif(DEVICE != "cuda", reason="the FMA-chain argument is CUDA's: the interpreter's dot is numpy's")
@pytest.mark.parametrize("m", [1, 64, 2112])
def test_on_the_gpu_the_small_n_tile_gives_the_default_tiles_bits(m):
    """On CUDA an IEEE fp32 dot is one FMA chain per element in ascending K, so the tile does not move
    a bit: the router's reference bits are the same under both tiles (NOTES.md 2026-12-07)."""
    from optimized_stack.kernels.gemm import invariant as inv
    x, w = _inputs(m, 768, 32, torch.float32, seed=4)
    small = _matmul()(x, w)
    default = _matmul()(x, w, _tiles=inv.TILES[torch.float32])
    assert torch.equal(small, default), f"{int((small != default).sum())} of {small.numel()} elements differ"


def split_k_by_rows(matmul, t, w):
    """Split-K below 8 rows (two half-K GEMMs added), as a small-M heuristic does: the sum's
    grouping changes with the row count on every backend. (A BLOCK_K that follows M changed the
    bits on the interpreter, not on the H200, where Triton's IEEE fp32 dot is one FMA chain.)"""
    if t.shape[0] >= 8:
        return matmul(t, w)
    half = t.shape[1] // 2
    return matmul(t[:, :half], w[:, :half]) + matmul(t[:, half:], w[:, half:])


def test_negative_control_split_k_by_rows_is_caught():
    x, w = _inputs(40, 160, 72, torch.float32, seed=2)
    bad = row_mismatches(lambda t: split_k_by_rows(_matmul(), t, w), x)
    assert bad, "control not caught: a split-K that follows M passed the invariance test (test is void)"
    assert all(int(b.split()[1]) < 8 for b in bad), bad


def test_zero_sized_and_non_contiguous():
    x, w = _inputs(10, 32, 20, torch.float32)
    assert _matmul()(x[:0], w).shape == (0, 20)
    xt = x.t().contiguous().t()                       # same values, column-major
    assert torch.equal(_matmul()(xt, w), _matmul()(x, w))


@pytest.mark.parametrize("x_shape,w_shape,dtype,match", [
    ((2, 3, 4), (5, 4), torch.float32, r"x must be 2-D \[M, K\], got shape \[2, 3, 4\]"),
    ((3, 4), (5, 4, 1), torch.float32, r"w must be 2-D \[N, K\], got shape \[5, 4, 1\]"),
    ((3, 4), (5, 6), torch.float32, r"x \[M, K\] and w \[N, K\] must share K, got x \[3, 4\] and w \[5, 6\]"),
    ((3, 4), (5, 4), torch.float64, r"x must be bfloat16, float16 or float32, got torch.float64"),
], ids=["x-3d", "w-3d", "k-mismatch", "fp64"])
def test_bad_input_one_line_errors(x_shape, w_shape, dtype, match):
    from optimized_stack.errors import K3Error
    with pytest.raises(K3Error, match=match):
        _matmul()(torch.zeros(x_shape, dtype=dtype, device=DEVICE), torch.zeros(w_shape, dtype=dtype, device=DEVICE))


def test_dtype_mismatch_error():
    from optimized_stack.errors import K3Error
    with pytest.raises(K3Error, match=r"w must have x's dtype torch.float32, got torch.bfloat16"):
        _matmul()(torch.zeros(2, 4, device=DEVICE), torch.zeros(3, 4, dtype=torch.bfloat16, device=DEVICE))
