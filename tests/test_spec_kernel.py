"""Speculative decoding under a decode KERNEL (what the GPU profile runs: fla's
fused_recurrent_kda): verification and rollback use that very kernel, so both spec toggles stay
bitwise against a reference that decodes with it. On the CPU the kernel is a stand-in with other
arithmetic than the traced recurrence (einsum contractions) but the property fla has: T tokens in
one call give the bits of T one-token calls."""
from __future__ import annotations

import pytest
import torch

from k3verify.run.runner import Runner
from k3verify.scenarios import workloads
from k3verify.verdict.gate import check_toggle
from optimized_stack.engine import spec as spec_module
from optimized_stack.model import ops
from optimized_stack.model.kda import kda_recurrent_trace
from model_fixtures import model  # noqa: F401
from test_spec import SPEC_TOGGLES, OracleDrafter


def einsum_recurrence(q, k, v, g, beta, initial_state=None):
    """The KDA recurrence with contractions through einsum (bmm): other bits than the traced
    mul + sum recurrence, token by token, so any split of a call gives the same bits."""
    t_len, h, kd = q.shape
    state = (torch.zeros(h, kd, v.shape[-1]) if initial_state is None else initial_state.float().clone())
    decay = torch.exp(g.float())
    out = torch.empty(t_len, h, v.shape[-1])
    for t in range(t_len):
        state = state * decay[t].unsqueeze(-1)
        kv = torch.einsum("hkv,hk->hv", state, k[t].float())
        u = beta[t].float().unsqueeze(-1) * (v[t].float() - kv)
        state = state + k[t].float().unsqueeze(-1) * u.unsqueeze(1)
        out[t] = torch.einsum("hkv,hk->hv", state, q[t].float())
    return out, state


def test_the_stand_in_kernel_really_differs_from_the_traced_recurrence():
    """Negative control: if spec still verified with the traced recurrence, the toggles below
    would differ from a reference decoding with this kernel."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(6, 2, 8, generator=g), dim=-1) for _ in range(2))
    v, gate = torch.randn(6, 2, 8, generator=g), -torch.rand(6, 2, 8, generator=g)
    beta = torch.rand(6, 2, generator=g)
    o1, s1 = einsum_recurrence(q, k, v, gate, beta)
    o2, s2, _ = kda_recurrent_trace(q, k, v, gate, beta)
    assert not torch.equal(s1, s2) or not torch.equal(o1, o2)
    oa, sa = einsum_recurrence(q[:2], k[:2], v[:2], gate[:2], beta[:2])
    ob, sb = einsum_recurrence(q[2:], k[2:], v[2:], gate[2:], beta[2:], sa)
    assert torch.equal(torch.cat([oa, ob]), o1) and torch.equal(sb, s1), "the stand-in must be split-invariant"


@pytest.mark.parametrize("name", SPEC_TOGGLES)
def test_spec_is_bitwise_under_a_decode_kernel(model, monkeypatch, name):
    sc = workloads.build("spec_repetitive", scale=0.5)
    with ops.override(kda_decode=einsum_recurrence):
        refs = Runner(model)
        ref = refs.reference(sc)
        monkeypatch.setattr(OracleDrafter, "sequences",
                            [list(r.prompt_ids) + ref.requests[r.request_id].tokens for r in sc.requests])
        monkeypatch.setattr(spec_module, "NgramDrafter", OracleDrafter)
        made = []
        real = spec_module.Speculator.rollback

        def rollback(self, req, st, record, kept):
            made.append((kept, 1 + len(req.draft)))
            return real(self, req, st, record, kept)
        monkeypatch.setattr(spec_module.Speculator, "rollback", rollback)
        res = {r.check: r for r in check_toggle(model, name, sc, runner=refs, localize_failures=False)}
    bad = {c: r.reason for c, r in res.items() if r.status != "pass"}
    assert not bad, f"{name} under a decode kernel: {bad}"
    assert any(1 < kept < t for kept, t in made), f"no partial rollback happened: {made[:10]}"
