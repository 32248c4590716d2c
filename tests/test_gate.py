"""The verifier core end to end on the tiny model: exact toggles pass bit for bit,
mutants fail the check that should catch them and are localised, approx toggles are
held to their drift budget, and the registry refuses what it should."""
from __future__ import annotations

import json

import pytest

from k3verify.capture.capture import Capture
from k3verify.cli import main
from k3verify.run.runner import Runner
from k3verify.run.sequential import run_scenario
from k3verify.scenarios import workloads
from k3verify.verdict.gate import check_toggle
from optimized_stack import K3Error, load_model
from optimized_stack import toggles as registry
from optimized_stack.model import ops


@pytest.fixture(scope="module")
def model():
    return load_model("k3-mini")


@pytest.fixture(scope="module")
def scenario():
    return workloads.build("single", scale=0.5)


@pytest.fixture(scope="module")
def refs(model):
    return Runner(model)


def statuses(results):
    return {r.check: r.status for r in results}


def test_exact_toggle_is_bitwise_on_every_check(model, scenario, refs):
    res = check_toggle(model, "state_offload_roundtrip", scenario, runner=refs)
    assert statuses(res) == {"tokens": "pass", "logits": "pass", "kda_state": "pass", "mla_rows": "pass"}
    assert all("bit-identical" in r.reason for r in res)


def test_mutant_is_caught_by_state_check_and_localised(model, scenario, refs):
    res = check_toggle(model, "mut_roundtrip_drops_conv", scenario, runner=refs)
    st = statuses(res)
    assert st["kda_state"] == "fail", "dropping the conv window must fail the KDA state check"
    kda = next(r for r in res if r.check == "kda_state")
    assert kda.first_divergence["tensor"].startswith("conv_")
    assert kda.localization["component"] == "kda/conv"
    assert kda.findings and kda.findings[0]["n_mismatched"] > 0


def test_op_mutant_localised_to_sublayer(model, scenario, refs):
    res = check_toggle(model, "mut_router_bias_in_weights", scenario, runner=refs)
    logits = next(r for r in res if r.check == "logits")
    assert logits.status == "fail"
    assert logits.localization["component"] == "moe/ffn"
    assert logits.localization["layer"] == 1, "first MoE layer is where the fault enters"
    assert "Mismatched elements" in logits.findings[0]["message"]


def test_approx_within_budget_and_mutant_outside(model, scenario, refs):
    ok = check_toggle(model, "kda_chunked", scenario, runner=refs)[0]
    assert ok.status == "pass", ok.reason
    assert 0 < ok.evidence["kl_max"] < 1e-6 and ok.evidence["top1_agreement"] == 1.0
    assert ok.evidence["max_ulp"] > 0, "chunked KDA is not bit-exact: drift must be visible"
    bad = check_toggle(model, "mut_kda_chunk_off_by_one", scenario, runner=refs)[0]
    assert bad.status == "fail" and "max KL" in bad.reason


def test_capture_file_round_trip(model, scenario, tmp_path):
    cap = run_scenario(model, scenario)
    path = cap.save(tmp_path / "cap.json")
    again = Capture.from_json(json.loads(path.read_text()))
    assert again.to_json() == cap.to_json()
    with pytest.raises(ValueError, match="expected format k3verify.capture v2 \\(or v1\\)"):
        Capture.from_json({"format": "other", "version": 9})


def test_registry_refuses_duplicates_and_suggests():
    with pytest.raises(K3Error, match="registered twice"):
        registry.register(registry.get("kda_chunked"))
    with pytest.raises(K3Error, match="did you mean 'kda_chunked'"):
        registry.get("kda_chunkd")
    with pytest.raises(K3Error, match="exact contract takes no drift budget"):
        registry.Contract("exact", max_kl=1.0)


def test_applied_restores_ops_on_error():
    before = ops.OPS.kda_prefill
    with pytest.raises(RuntimeError):
        with registry.applied(["kda_chunked"]):
            assert ops.OPS.kda_prefill is not before
            raise RuntimeError("boom")
    assert ops.OPS.kda_prefill is before


def test_cli_toggles_json(capsys):
    assert main(["toggles", "--json"]) == 0
    items = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    names = {t["name"] for t in items}
    assert {"kda_chunked", "mla_absorbed", "prefill_step_api", "mut_kda_state_bf16"} <= names
    assert all({"name", "kind", "contract", "touches", "description"} <= set(t) for t in items)


def test_cli_diff_exit_codes_and_report(tmp_path, capsys):
    assert main(["diff", "--toggle", "nope_toggle"]) == 2
    out = tmp_path / "rep"
    rc = main(["diff", "--toggle", "mut_attnres_drop_snapshot", "--scenario", "single", "--scale", "0.5",
               "--model", "k3-mini", "--report-dir", str(out)])
    assert rc == 1
    report = json.loads((out / "report.json").read_text())
    assert report["schema_version"] == 1 and report["summary"]["verdict"] == "fail"
    assert {"report.md", "report.html", "junit.xml"} <= {p.name for p in out.iterdir()}
    rc = main(["diff", "--toggle", "prefill_step_api", "--scenario", "single", "--scale", "0.5",
               "--model", "k3-mini", "--report-dir", str(tmp_path / "ok")])
    assert rc == 0


def _transposed_state_recurrence(q, k, v, g, beta, initial_state=None):
    """CPU twin of the fla layout mutant: the cached state enters the recurrence as [V, K]."""
    from optimized_stack.model.kda import kda_recurrent
    s = None if initial_state is None else initial_state.transpose(-1, -2).contiguous()
    o, final = kda_recurrent(q, k, v, g, beta, s)
    return o, final.transpose(-1, -2).contiguous()


def test_state_budget_catches_what_a_lax_logits_budget_misses(model, scenario, refs):
    """An approx contract's max_state_rel judges the final KDA state itself: a transposed
    state may stay inside a loose KL budget on a confident model, never inside the state's."""
    lax = registry.Contract("approx", max_kl=10.0, min_top1=0.0)
    strict = registry.Contract("approx", max_kl=10.0, min_top1=0.0, max_state_rel=1e-4)
    results = {}
    for name, contract in (("tmp_lax_transposed", lax), ("tmp_strict_transposed", strict)):
        registry.register(registry.Toggle(
            name=name, description="test only", contract=contract, touches=("kda_state",),
            ops={"kda_prefill": _transposed_state_recurrence, "kda_decode": _transposed_state_recurrence}))
        try:
            results[name] = check_toggle(model, name, scenario, runner=refs, localize_failures=False)[0]
        finally:
            registry._REGISTRY.pop(name)
    assert results["tmp_lax_transposed"].status == "pass"          # the logits budget alone lets it through
    bad = results["tmp_strict_transposed"]
    assert bad.status == "fail" and "KDA state drift" in bad.reason
    assert bad.evidence["kda_state_rel_max"] > 1e-2
    # negative control: a correct kernel stays far inside the same state budget
    ok = check_toggle(model, "kda_chunked", scenario, runner=refs)[0]
    assert ok.status == "pass" and ok.evidence["kda_state_rel_max"] < 1e-5


def _decode_reads_transposed_state(q, k, v, g, beta, initial_state=None):
    from optimized_stack.model.kda import kda_recurrent
    s = None if initial_state is None else initial_state.transpose(-1, -2).contiguous()
    return kda_recurrent(q, k, v, g, beta, s)


def test_decode_only_fault_is_localised_by_the_stepped_replay(model, scenario):
    """A decode kernel that reads the cached state in the wrong layout runs only where a state
    is handed to a one-token call: the whole-prompt replay sees nothing (control), the served-
    order replay (prompt, then a token per call) names the KDA mixer at the first decode token."""
    from k3verify.localize import localize_request
    name = "tmp_decode_reads_transposed"
    registry.register(registry.Toggle(
        name=name, description="test only", contract=registry.Contract("approx", max_kl=1e-6),
        touches=("kda_state",), ops={"kda_decode": _decode_reads_transposed_state}))
    try:
        ids = list(scenario.requests[0].prompt_ids)[:24] + [5, 6, 7]
        whole = localize_request(model, name, ids)
        stepped = localize_request(model, name, ids, prompt_len=24)
    finally:
        registry._REGISTRY.pop(name)
    assert whole["component"] is None and whole["replay"] == "whole prompt"
    assert stepped["component"] == "kda/mixer" and stepped["first_position"] == 24
    assert stepped["replay"].startswith("prompt of 24")


def test_state_only_drift_is_localised_from_the_state(model, scenario, refs):
    """A state stored transposed and read back the same way changes no output, only the state:
    the drift verdict localises it from the state budget's first layer over (kda/recurrent)."""
    name = "tmp_state_layout"
    registry.register(registry.Toggle(
        name=name, description="test only",
        contract=registry.Contract("approx", max_kl=1e-6, max_state_rel=1e-4), touches=("kda_state",),
        ops={"kda_prefill": _transposed_state_recurrence, "kda_decode": _transposed_state_recurrence}))
    try:
        bad = check_toggle(model, name, scenario, runner=refs)[0]
    finally:
        registry._REGISTRY.pop(name)
    assert bad.status == "fail" and "KDA state drift" in bad.reason and "max KL" not in bad.reason
    assert bad.localization["component"] == "kda/recurrent"
    assert bad.localization["layer"] == min(s["layer"] for s in bad.evidence["kda_state_drift"]
                                            if s["rel_to_max"] > 1e-4)
