"""The AttnRes read fused per token in Triton (optimized_stack/kernels/attn_res/read.py): the
reference mix (model/attn_res.py AttnResRead.mix) in fp64, tokens bit-identical whatever the
batch, a negative control that is caught, one-line errors."""
from __future__ import annotations

import pytest
import torch

from triton_env import DEVICE, MARKS, max_rel, row_mismatches, tol

pytestmark = MARKS


def _read():
    from optimized_stack.kernels.attn_res.read import attn_res_read
    return attn_res_read


def _inputs(n_cand, t, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    vals = (torch.randn(n_cand, t, d, generator=gen) * torch.linspace(0.5, 3, n_cand).view(-1, 1, 1)).to(dtype)
    norm_w = torch.randn(d, generator=gen) * 0.5 + 1
    proj_w = torch.randn(1, d, generator=gen) * d ** -0.5 * 4      # non-uniform mixing
    return vals.to(DEVICE), norm_w.to(DEVICE), proj_w.to(DEVICE)


def _reference64(vals, norm_w, proj_w, eps):
    """AttnResRead.mix in fp64: softmax over candidates of sum_D(rmsnorm(V) * norm_w * proj_w)."""
    v = vals.double().cpu()
    q = norm_w.double().cpu() * proj_w.double().cpu().reshape(-1)
    scores = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * q).sum(-1)     # [N+1, T]
    p = torch.softmax(scores, 0).unsqueeze(-1)
    return (p * v).sum(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_cand,d", [(1, 32), (3, 128), (6, 1100)], ids=lambda v: str(v))
def test_matches_fp64_reference(n_cand, d, dtype):
    vals, nw, pw = _inputs(n_cand, 7, d, dtype)
    out = _read()(vals, nw, pw, 1e-5)
    assert out.dtype == dtype and out.shape == (7, d)
    err = max_rel(out, _reference64(vals, nw, pw, 1e-5))
    assert err <= tol(dtype), f"max rel error {err:.2e} above the {dtype} tolerance"


def test_close_to_the_cpu_reference_mix():
    from optimized_stack.model.attn_res import AttnResRead
    vals, nw, pw = _inputs(4, 9, 128, torch.float32, seed=1)
    ref = AttnResRead.mix([v.cpu() for v in vals], nw.cpu(), pw.cpu(), 1e-5)
    assert max_rel(_read()(vals, nw, pw, 1e-5), ref) <= 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tokens_are_batch_invariant(dtype):
    vals, nw, pw = _inputs(3, 20, 1100, dtype, seed=2)        # D > 1024: two chunks per row
    bad = row_mismatches(lambda v: _read()(v, nw, pw, 1e-5), vals, ms=(1, 2, 3, 5, 8, 13, 17), dim=1)
    assert not bad, f"a token's bits depend on the batch: {bad}"


def test_negative_control_chunk_width_by_tokens_is_caught():
    """The D chunk picked by the token count (16 below 8 tokens): each candidate's two sums are
    grouped differently; differs on the interpreter too."""
    vals, nw, pw = _inputs(3, 16, 128, torch.float32, seed=3)
    bad = row_mismatches(lambda v: _read()(v, nw, pw, 1e-5, _block_d=16 if v.shape[1] < 8 else None), vals,
                         ms=(1, 2, 3, 5, 13), dim=1)
    assert bad, "control not caught: a chunk width that follows T passed the invariance test (test is void)"


@pytest.mark.parametrize("shapes,match", [
    (((4, 8), (8,), (1, 8)), r"candidates must be 3-D \[N\+1, T, D\], got shape \[4, 8\]"),
    (((2, 4, 8), (7,), (1, 8)), r"norm_w must be 1-D \[D\] = \[8\], got shape \[7\]"),
    (((2, 4, 8), (8,), (2, 8)), r"proj_w must be \[1, D\] or \[D\] with D = 8, got shape \[2, 8\]"),
    (((0, 4, 8), (8,), (1, 8)), r"candidates must hold at least one \[T, D\] tensor, got N\+1 = 0"),
], ids=["2d", "norm-width", "proj-shape", "no-candidates"])
def test_bad_input_one_line_errors(shapes, match):
    from optimized_stack.errors import K3Error
    v, nw, pw = (torch.zeros(s, device=DEVICE) for s in shapes)
    with pytest.raises(K3Error, match=match):
        _read()(v, nw, pw, 1e-5)
