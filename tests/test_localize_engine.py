"""Engine faults are localised where they enter (k3verify/localize_engine.py, issue 26 item 7).

The oracle is each mutant's own `lives_in`. Before the engine trace, the gate localised an engine
fault from the state check alone, which names the first KDA state seen wrong: an MLA cache fault
read "kda/conv", a batched-GEMM fault "kda/recurrent". The negative controls show that older
answer on the same runs (so these tests tell the two apart) and that a correct engine toggle
localises to nothing.
"""
from __future__ import annotations

import pytest

from k3verify.kinds.selftest import scenario_for
from k3verify.localize import state_only
from k3verify.localize_engine import localize_engine
from k3verify.run.runner import Runner
from k3verify.scenarios.answers import realized
from k3verify.scenarios.workloads import build
from k3verify.suites.verdicts import localisation
from k3verify.verdict.gate import check_toggle
from optimized_stack import toggles as registry
from model_fixtures import model  # noqa: F401  (the module-scoped k3-mini fixture)

# one mutant per kind of place a fault can enter, each cheap at full scale on the 2-core CPU
FAST = ["mut_batch_plain_linear", "mut_host_block_aliases", "mut_spec_accept_off_by_one",
        "mut_fast_pad_shares_table"]
# the rest of the engine mutants that run on the CPU (make test-slow)
SLOW = [t.name for t in registry.all_toggles("mutant")
        if t.engine and "cpu" in t.devices and t.name not in FAST and t.name != "mut_fast_kda_stale_value_tiles"]


def _judge(model, name: str):
    toggle = registry.get(name)
    sc = build(scenario_for(toggle, 1.0), scale=1.0)
    results = check_toggle(model, name, sc)
    failed = {r.check for r in results if r.status == "fail"}
    loc = next((r.localization for r in results if r.localization), None) or {}
    return toggle, sc, failed, loc


@pytest.mark.parametrize("name", FAST)
def test_an_engine_fault_is_localised_where_it_lives(model, name):
    toggle, sc, failed, loc = _judge(model, name)
    assert failed & set(toggle.caught_by), f"{name} must be caught on {sc.name} (failed: {sorted(failed)})"
    assert loc.get("replay") == "engine trace", loc
    assert loc.get("component") == toggle.lives_in, (
        f"{name} lives in {toggle.lives_in}; the engine trace named {loc.get('component')}: {loc.get('reason')}")
    assert loc.get("request") and loc.get("engine_step") is not None and loc.get("first_position") is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_every_cpu_engine_fault_is_localised_where_it_lives(model, name):
    toggle, sc, failed, loc = _judge(model, name)
    assert failed & set(toggle.caught_by), f"{name} must be caught on {sc.name}"
    assert loc.get("component") == toggle.lives_in, f"{name}: {loc}"


def test_negative_control_the_state_check_alone_names_the_wrong_component(model):
    """The same runs localised the old way (the first KDA state seen wrong) miss where the cache
    fault lives: the tests above can fail."""
    toggle, sc, failed, loc = _judge(model, "mut_host_block_aliases")
    ref = Runner(model).reference(realized(model, sc))
    cand = Runner(model).run(realized(model, sc), (toggle.name,), keep=True)
    from k3verify.compare.captures import compare_captures
    verdicts = compare_captures(ref, cand, sc.name)
    first = verdicts["kda_state"]["first"] if not verdicts["kda_state"]["equal"] else verdicts["mla_rows"]["first"]
    old = state_only(model, first, "state check only")["component"]
    assert loc["component"] == "mla/cache" and old != "mla/cache", (loc["component"], old)


def test_negative_control_a_correct_engine_toggle_localises_to_nothing(model):
    sc = realized(model, build("multi_length", scale=0.5))
    ref = Runner(model).reference(sc)
    assert localize_engine(model, "continuous_batching", sc, ref) is None


def test_the_accuracy_figure_counts_only_caught_mutants_that_name_where_they_live():
    def row(caught, lives, found):
        return {"kind": "mutant", "caught": caught,
                "evidence": {"localisation": {"lives_in": lives, "found": found, "exact": lives == found}}}
    rows = [row(True, "mla/cache", "mla/cache"), row(True, "kda/conv", "kda/recurrent"),
            row(False, "kda/conv", None), row(True, None, None), {"kind": "optimization", "caught": None}]
    got = localisation(rows)
    assert (got["localised"], got["localisable"], got["localisation_accuracy"]) == (1, 2, 0.5), got
    assert got["mislocalised"] == ["kda/conv -> kda/recurrent"]
