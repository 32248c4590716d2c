"""A broken reference fails every check (issue 29 item 2): with the lm_head zeroed every logits
row is constant over the vocabulary, greedy emits token 0 (NUL) on every step, and a candidate
broken the same way agrees bit for bit (max KL 0). Agreement between two broken sides is not a
pass; the normal model (negative control) still passes."""
from __future__ import annotations

import pytest
import torch

from k3verify.compare.captures import EXACT_CHECKS, compare_captures, degenerate_reference
from k3verify.run.runner import Runner
from k3verify.scenarios.workloads import build
from k3verify.verdict.gate import check_toggle
from optimized_stack import load_model


@pytest.fixture(scope="module")
def small():
    return build("single", scale=0.25)


@pytest.fixture(scope="module")
def broken():
    """k3-mini with its lm_head zeroed: every logits row is 0 over the whole vocabulary."""
    m = load_model("k3-mini")
    with torch.no_grad():
        m.lm_head.weight.zero_()
    return m


@pytest.fixture(scope="module")
def broken_runner(broken):
    return Runner(broken)


def test_the_broken_model_is_what_the_rule_is_for(broken, broken_runner, small):
    """Without the rule both sides agree: every hash equal, the stream all NUL."""
    ref = broken_runner.reference(small)
    cand = broken_runner.run(small, ("prefill_step_api",))
    verdicts = compare_captures(ref, cand, "single")
    assert all(verdicts[c]["equal"] for c in EXACT_CHECKS), "two broken sides agree bit for bit"
    assert set(ref.requests["r0"].tokens) == {0}, "greedy on constant logits picks token 0 (NUL) every step"


def test_every_exact_check_fails_on_a_constant_logits_reference(broken, broken_runner, small):
    res = check_toggle(broken, "prefill_step_api", small, runner=broken_runner, localize_failures=False)
    assert [r.check for r in res] == list(EXACT_CHECKS)
    assert all(r.status == "fail" for r in res), [(r.check, r.status, r.reason) for r in res]
    reason = res[0].reason
    assert reason.startswith("reference is degenerate: logits constant over the vocabulary at ")
    assert "of request r0" in reason and "token 0 repeated 8 times" in reason, reason
    assert all(r.reason == reason and r.first_divergence["side"] == "reference" for r in res)
    assert res[0].findings[0]["what"] == "degenerate_reference"


def test_the_drift_budget_fails_on_it_too(broken, broken_runner, small):
    (res,) = check_toggle(broken, "kda_chunked", small, runner=broken_runner, localize_failures=False)
    assert res.check == "drift_budget" and res.status == "fail"
    assert res.reason.startswith("reference is degenerate: logits constant over the vocabulary")


def test_a_single_constant_row_names_its_step_and_request():
    from k3verify.capture.capture import Capture
    cap = Capture(keep=True)
    cap.on_request("r1", 4)
    cap.on_logits("r1", 3, torch.stack([torch.randn(16), torch.full((16,), 2.5)]))   # positions 3 (step 0), 4
    found = degenerate_reference(cap, "single")
    assert found["reason"].startswith("reference is degenerate: logits constant over the vocabulary at step 1 "
                                      "of request r1 (every entry 2.5")
    assert (found["first"]["request"], found["first"]["position"], found["first"]["step"]) == ("r1", 4, 1)


def test_negative_control_rows_that_vary_or_are_nonfinite_are_not_this_rule():
    from k3verify.capture.capture import Capture
    cap = Capture(keep=True)
    cap.on_request("r0", 2)
    row = torch.randn(16)
    nan_row = torch.full((16,), float("nan"))
    cap.on_logits("r0", 1, torch.stack([row, nan_row]))
    assert degenerate_reference(cap, "single") is None, "NaN rows belong to the non-finite record"


def test_negative_control_the_normal_model_passes():
    model = load_model("k3-mini")
    small = build("single", scale=0.25)
    runner = Runner(model)
    assert degenerate_reference(runner.reference(small), "single") is None
    res = check_toggle(model, "prefill_step_api", small, runner=runner, localize_failures=False)
    assert [r.status for r in res] == ["pass"] * 4, [(r.check, r.reason) for r in res]
