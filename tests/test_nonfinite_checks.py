"""Non-finite numbers fail every check kind with their first location, on either side.

Each poison writes one NaN / +inf / -inf in process (nonfinite_fixtures). Poisoned on the
reference side: the shared reference capture is taken under the poison and the toggle is
judged without it; on the candidate side: a temporary toggle applies the poison. The
negative controls: a clean run passes, and where both sides hold the same poisoned bits
the item's hashes are equal (and the old drift computation passes), so the new finiteness
record is what catches it.
"""
from __future__ import annotations

import contextlib
import json

import pytest

import optimized_stack
from k3verify.cli import main
from k3verify.compare.captures import EXACT_CHECKS
from k3verify.run.runner import Runner
from k3verify.scenarios import workloads
from k3verify.verdict.gate import check_toggle, drift_verdict
from optimized_stack import toggles as registry

from model_fixtures import model  # noqa: F401  (the module-scoped k3-mini fixture)
from nonfinite_fixtures import VALUES, candidate_poison, poisoned, poisoned_weight

KINDS = list(VALUES)
SIDES = ("reference", "candidate")
R = 24                                   # MLA cache row width of k3-mini


@pytest.fixture(scope="module")
def small():
    return workloads.build("single", scale=0.25)          # r0: 25 prompt tokens, up to 8 new


@pytest.fixture(scope="module")
def clean_refs(model):
    return Runner(model)


@pytest.fixture(scope="module")
def final(clean_refs, small):
    """Tokens in r0 after the last forward: a state poisoned there feeds no sampled row."""
    return max(clean_refs.reference(small).requests["r0"].kda)


def _poison(model, where: str, kind: str, final: int):
    """(poison factory, expected message without the side, failing check)."""
    if where == "logits":             # a prompt row: never sampled, so the run completes
        return (lambda: poisoned(model, "logits", position=3, value=kind, index=7),
                f"non-finite ({kind}) in logits of r0 at position 3, vocab index 7", "logits")
    if where in ("recurrent", "conv_q"):
        idx = (0, 0, 5) if where == "recurrent" else (0, 5)
        return (lambda: poisoned(model, where, position=final, value=kind, layer=2),
                f"non-finite ({kind}) in KDA layer 2 {where} of r0 after {final} tokens, index {idx}", "kda_state")
    return (lambda: poisoned(model, "mla", position=final, value=kind, layer=3, index=20 * R + 3),
            f"non-finite ({kind}) in MLA layer 3 cache rows of r0 at row 20, index (20, 3)", "mla_rows")


def _judge(model, small, poison, side: str, contract: str = "exact"):
    """check_toggle with the poison on one side: the reference (then a real toggle of the
    contract's kind is judged, clean) or the candidate (a temporary toggle applies it)."""
    refs = Runner(model)
    if side == "reference":
        with poison():
            refs.reference(small)
        toggle = "prefill_step_api" if contract == "exact" else "kda_chunked"
        return check_toggle(model, toggle, small, runner=refs, localize_failures=False), refs.reference(small)
    with candidate_poison(f"tmp_poison_{contract}", poison, contract) as name:
        return check_toggle(model, name, small, runner=refs, localize_failures=False), refs.reference(small)


# ---- exact checks: tokens / logits / kda_state / mla_rows ------------------------------
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["logits", "recurrent", "conv_q", "mla"])
def test_exact_check_fails_with_location(model, small, final, where, kind, side):
    poison, message, check = _poison(model, where, kind, final)
    res, _ = _judge(model, small, poison, side)
    by = {r.check: r for r in res}
    assert {c for c, r in by.items() if r.status == "fail"} == {check}, [(r.check, r.reason) for r in res]
    bad = by[check]
    assert bad.reason == f"{message} ({side} side)"
    assert bad.first_divergence["side"] == side and bad.first_divergence["nonfinite"] == kind
    assert bad.findings[0]["what"] == "nonfinite" and bad.evidence["nonfinite"]["request"] == "r0"


@pytest.mark.parametrize("where", ["logits", "recurrent", "mla"])
def test_same_poison_on_both_sides_hashes_alike_and_still_fails(model, small, final, where):
    """The negative control: identical NaN bits on both sides give equal hashes, which is
    all the old comparator looked at; the finiteness record fails it."""
    poison, message, check = _poison(model, where, "nan", final)
    refs = Runner(model)
    with poison():
        ref = refs.reference(small)
    with candidate_poison("tmp_poison_both", poison):
        cand = refs.run(small, ("tmp_poison_both",))
        res = check_toggle(model, "tmp_poison_both", small, runner=refs, localize_failures=False)
    r, c = ref.requests["r0"], cand.requests["r0"]
    items = {"logits": lambda x: x.logits[3], "recurrent": lambda x: x.kda[final][(2, "recurrent")],
             "mla": lambda x: x.mla[3]}[where]
    assert items(r).digest == items(c).digest, "old behaviour: equal hashes, the check passed"
    assert r.tokens == c.tokens
    bad = next(x for x in res if x.check == check)
    assert bad.status == "fail" and bad.reason == f"{message} (reference and candidate sides)"


def test_sampler_stop_fails_tokens_and_names_the_refused_row(model, small):
    p = 26                                                 # the row that picks the third token
    res, ref = _judge(model, small, lambda: poisoned(model, "logits", position=p, value="nan"), "candidate")
    by = {r.check: r for r in res}
    assert by["tokens"].status == "fail"
    assert by["tokens"].reason.startswith("candidate run stopped in request r0: sampler refused a logits row: "
                                          "nan at vocab index 5")
    assert by["logits"].reason == f"non-finite (nan) in logits of r0 at position {p}, vocab index 5 (candidate side)"


def test_clean_runs_pass_every_exact_check(model, small):
    res, _ = _judge(model, small, contextlib.nullcontext, "candidate")
    assert {r.check: r.status for r in res} == dict.fromkeys(EXACT_CHECKS, "pass")


# ---- approx: the drift budget ----------------------------------------------------------
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("kind", KINDS)
def test_drift_budget_fails_with_location(model, small, final, kind, side):
    poison, message, _ = _poison(model, "logits", kind, final)
    res, _ = _judge(model, small, poison, side, contract="approx")
    assert len(res) == 1 and res[0].status == "fail"
    assert res[0].reason == f"{message} ({side} side)"
    assert res[0].first_divergence["position"] == 3 and res[0].evidence["nonfinite"]["side"] == side


def test_drift_budget_fails_on_a_nonfinite_kda_state(model, small, final):
    poison, message, _ = _poison(model, "recurrent", "inf", final)
    res, _ = _judge(model, small, poison, "candidate", contract="approx")
    assert res[0].status == "fail" and res[0].reason == f"{message} (candidate side)"


def test_old_drift_computation_passes_what_the_refusal_catches(model, small, final):
    """Negative control: KL, top-1 and ULP of NaN vs NaN compare as nothing."""
    poison, message, _ = _poison(model, "logits", "nan", final)
    refs = Runner(model)
    with poison():
        ref = refs.reference(small)
        cand = refs.run(small, (), keep=True, force={rid: rc.tokens for rid, rc in ref.requests.items()})
    contract = registry.Contract("approx", max_kl=1e-3, min_top1=0.99)
    ok, reason, _, _ = drift_verdict(ref, cand, contract)
    assert ok, f"the budget alone lets NaN through: {reason}"
    with candidate_poison("tmp_poison_approx", poison, "approx"):
        res = check_toggle(model, "tmp_poison_approx", small, runner=refs, localize_failures=False)
    assert res[0].status == "fail" and res[0].reason == f"{message} (reference and candidate sides)"


def test_clean_run_passes_the_drift_budget(model, small):
    res, _ = _judge(model, small, contextlib.nullcontext, "candidate", contract="approx")
    assert res[0].status == "pass", res[0].reason


# ---- the CLI: the headline case (it used to exit 0) -------------------------------------
def test_cli_diff_on_nan_weights_exits_1_with_the_location(model, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(optimized_stack, "load_model", lambda *a, **k: model)
    with poisoned_weight(model.lm_head.weight, (3, 5), "nan"):
        rc = main(["diff", "--toggle", "prefill_step_api", "--scenario", "single", "--scale", "0.25",
                   "--report-dir", str(tmp_path)])
    capsys.readouterr()
    assert rc == 1
    report = json.loads((tmp_path / "report.json").read_text())
    logits = next(r for r in report["results"] if r["check"] == "logits")
    assert logits["status"] == "fail"
    assert logits["reason"] == ("non-finite (nan) in logits of r0 at position 0, vocab index 3 "
                                "(reference and candidate sides)")
    assert logits["localization"]["component"] == "head/logits"
    assert logits["reason"] in (tmp_path / "report.md").read_text()
