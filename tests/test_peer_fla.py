"""Peer test: the project's KDA recurrence against fla-core's `naive_recurrent_kda`.

fla's naive.py is the public reference of the KDA kernels (fp32, one token per step).
Both sides get the same random inputs; the project's layout is [T, H, K] with q already
scaled and l2-normed, so fla gets a batch axis and scale=1.0. Same update order on both
sides (decay, delta against the decayed state, write, read), so only summation order
differs: max|d|/max|ref| <= 1e-6 on the output and on the final state.
"""
from __future__ import annotations

import pytest
import torch

from tests.peer_fixtures import describe_diff, load_fla_naive_kda, random_kda_inputs, rel_err

naive_recurrent_kda = load_fla_naive_kda()
if naive_recurrent_kda is None:
    pytest.skip("fla-core is not installed (fla/ops/kda/naive.py not found)", allow_module_level=True)

from optimized_stack.model.kda import kda_recurrent  # noqa: E402  (after the skip)

TOL = 1e-6

# (T, H, K, V, with_state, seed)
CASES = {
    "T1-H1-K8-zero-state": (1, 1, 8, 8, False, 0),
    "T37-H4-K16-zero-state": (37, 4, 16, 16, False, 1),
    "T64-H2-K32-state": (64, 2, 32, 32, True, 2),
    "T130-H4-K16-state": (130, 4, 16, 16, True, 3),
    "T50-H3-K16-V24-state": (50, 3, 16, 24, True, 4),
}


def _fla(inp):
    """fla in [B=1, T, H, K]; scale=1.0 because q arrives pre-scaled."""
    state = None if inp.state is None else inp.state[None]
    o, s = naive_recurrent_kda(inp.q[None], inp.k[None], inp.v[None], inp.g[None], inp.beta[None],
                               scale=1.0, initial_state=state, output_final_state=True)
    return o[0], s[0]


@pytest.mark.parametrize("case", CASES)
def test_kda_recurrent_matches_fla_naive(case):
    T, H, K, V, with_state, seed = CASES[case]
    inp = random_kda_inputs(seed, T, H, K, V, with_state)
    state_before = None if inp.state is None else inp.state.clone()
    ref_o, ref_s = _fla(inp)
    got_o, got_s = kda_recurrent(inp.q, inp.k, inp.v, inp.g, inp.beta, initial_state=inp.state)
    assert got_o.shape == (T, H, V) and got_s.shape == (H, K, V), (
        f"shapes: o {tuple(got_o.shape)} (want {(T, H, V)}), state {tuple(got_s.shape)} (want {(H, K, V)})")
    assert got_o.dtype == torch.float32 and got_s.dtype == torch.float32, "output and state must be fp32"
    assert rel_err(got_o, ref_o) <= TOL, f"{case} output: {describe_diff(got_o, ref_o)}"
    assert rel_err(got_s, ref_s) <= TOL, f"{case} final state: {describe_diff(got_s, ref_s)}"
    if state_before is not None:
        assert torch.equal(inp.state, state_before), "kda_recurrent modified its initial_state in place"


def test_split_sequence_carries_state_like_fla():
    """Two calls chained through the final state equal fla's single pass over the whole sequence."""
    inp = random_kda_inputs(5, 48, 2, 16, 16, with_state=True)
    ref_o, ref_s = _fla(inp)
    o1, s1 = kda_recurrent(inp.q[:20], inp.k[:20], inp.v[:20], inp.g[:20], inp.beta[:20], inp.state)
    o2, s2 = kda_recurrent(inp.q[20:], inp.k[20:], inp.v[20:], inp.g[20:], inp.beta[20:], s1)
    got_o = torch.cat([o1, o2])
    assert rel_err(got_o, ref_o) <= TOL, f"split output: {describe_diff(got_o, ref_o)}"
    assert rel_err(s2, ref_s) <= TOL, f"split final state: {describe_diff(s2, ref_s)}"


# Negative controls: a plausible bug on the project side must fail the same comparison.
def _read_before_write(q, k, v, g, beta, initial_state=None):
    """KDA with the read taken before the write (a classic off-by-one in the update order)."""
    T, H, K = q.shape
    S = torch.zeros(H, K, v.shape[-1]) if initial_state is None else initial_state.clone()
    out = []
    for t in range(T):
        S = S * g[t].exp().unsqueeze(-1)
        out.append((S * q[t].unsqueeze(-1)).sum(1))
        u = beta[t].unsqueeze(-1) * (v[t] - (S * k[t].unsqueeze(-1)).sum(1))
        S = S + k[t].unsqueeze(-1) * u.unsqueeze(1)
    return torch.stack(out), S


BUGS = {
    "beta-ignored": lambda i: kda_recurrent(i.q, i.k, i.v, i.g, torch.ones_like(i.beta), i.state),
    "decay-dropped": lambda i: kda_recurrent(i.q, i.k, i.v, torch.zeros_like(i.g), i.beta, i.state),
    "initial-state-dropped": lambda i: kda_recurrent(i.q, i.k, i.v, i.g, i.beta, None),
    "read-before-write": lambda i: _read_before_write(i.q, i.k, i.v, i.g, i.beta, i.state),
}


@pytest.mark.parametrize("bug", BUGS)
def test_negative_control_bug_is_caught(bug):
    inp = random_kda_inputs(6, 37, 4, 16, 16, with_state=True)
    ref_o, _ = _fla(inp)
    got_o, _ = BUGS[bug](inp)
    err = rel_err(got_o, ref_o)
    assert err > 100 * TOL, f"{bug}: the peer comparison did not notice ({err:.2e})"
