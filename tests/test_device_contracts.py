"""Per-device contracts: an exact toggle that cannot be exact on a device says why there, as a
skip (never a pass), and only an exact contract can be qualified that way."""
from __future__ import annotations

import pytest

from k3verify.scenarios import workloads
from k3verify.verdict.gate import applies
from optimized_stack import toggles as registry
from optimized_stack.errors import K3Error


def test_a_toggle_not_exact_on_a_device_is_a_skip_saying_why():
    t = registry.get("prefill_step_api")
    sc = workloads.build("single", scale=0.25)
    assert applies(t, sc, device="cpu") is None
    assert applies(t, sc, device="cuda").startswith("not exact on cuda: one-token steps run KDA")


def test_only_an_exact_contract_takes_a_device_exception():
    approx = registry.Contract("approx", max_kl=1e-6)
    with pytest.raises(K3Error, match="not_exact_on only qualifies an exact contract"):
        registry.Toggle(name="tmp_bad", description="x", contract=approx, touches=("logits",),
                        not_exact_on={"cuda": "why"})


def test_the_selftest_reports_such_a_toggle_as_a_skip_not_a_pass(monkeypatch):
    from k3verify.kinds import selftest
    from k3verify.kinds.base import Context, Unit
    from k3verify.verdict import gate
    from optimized_stack import load_model
    model = load_model("k3-mini")
    monkeypatch.setattr(gate, "model_device", lambda m: "cuda")     # judged as if on a GPU
    ctx = Context(model)
    ctx.device = "cuda"
    unit = Unit("selftest", "selftest", {"scale": 0.25}, toggle="prefill_step_api", scenario="single")
    (row,) = selftest.run(unit, ctx)
    assert row.status == "skip" and row.reason.startswith("not exact on cuda")
