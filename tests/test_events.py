"""Path evidence (issue 19): every toggle declares the events that prove its path ran, each
fires on the scenario the selftest picks for it (so in its default set too), no check holds
as a pass where an event never fired, and every event has a mutant that corrupts exactly its
path: caught where the event fires, `not exercised` (never pass) where it does not.
"""
from __future__ import annotations

import pytest

from k3verify.run.runner import Runner
from k3verify.run.sequential import run_scenario
from k3verify.scenarios.answers import realized
from k3verify.scenarios.chooser import choose
from k3verify.scenarios.requests import RequestSpec, Scenario
from k3verify.scenarios.workloads import build
from k3verify.verdict.gate import check_toggle
from optimized_stack import toggles as registry
from optimized_stack.errors import K3Error
from optimized_stack.events import EVENTS, OP_PREFIX


@pytest.fixture(scope="module")
def model():
    """The embedded trained k3-mini (what `k3verify all` judges with): its answers, stop tokens
    and acceptance lengths decide which paths the scenarios drive. One thread (shared box)."""
    import torch
    from optimized_stack import load_model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_model()
    finally:
        torch.set_num_threads(threads)


CPU_W1 = [t for t in registry.all_toggles() if "cpu" in t.devices and 1 in t.world_sizes]
OPTIMIZATIONS = [t for t in CPU_W1 if t.kind == "optimization"]
# the op slots every forward calls, whatever the scenario, and the sorted experts every prefill runs
# (every scenario has one): their events cannot be absent
ALWAYS_CALLED = {"op:linear", "op:attention", "op:attn_res_mix", "op:moe_route", "prefill_sorted_experts"}


def declared_events() -> list[str]:
    """Every event some optimization toggle declares (what needs a negative control)."""
    return sorted({e for t in registry.all_toggles("optimization") for e in t.events})


def mutant_for(event: str):
    """The mutant that corrupts exactly the event's path: the first that declares only it, else
    the first that declares it among others."""
    mine = [m for m in registry.all_toggles("mutant") if event in m.events]
    return next((m for m in mine if m.events == (event,)), mine[0] if mine else None)


def quiet_scenarios() -> list[Scenario]:
    """Scenarios built to fire as little as possible: one sampled request (no speculation), no
    second request (no batching, no hit), too short for a chunk cut, a checkpoint or a block;
    the first never decodes (max 1 new token), the second has a one-token prompt (no prefill call)."""
    no_decode = RequestSpec("q12", tuple(range(65, 77)), 1, temperature=0.7, seed=3)
    one_token = RequestSpec("q1", (65,), 1, temperature=0.7, seed=3)
    return [Scenario(f"quiet_{r.request_id}", "one short sampled request", ("basic",), (r,), meta={"seed": 0})
            for r in (no_decode, one_token)]


# ---- declarations (no model) ------------------------------------------------------------------

@pytest.mark.parametrize("name", [t.name for t in registry.all_toggles()])
def test_every_registered_toggle_and_mutant_declares_its_path_events(name):
    t = registry.get(name)
    assert t.events, f"{name}: a toggle (or mutant) must declare the events that prove its path ran"


@pytest.mark.parametrize("event", declared_events())
def test_every_declared_event_has_a_mutant_that_corrupts_its_path(event):
    m = mutant_for(event)
    assert m is not None, f"event {event}: no mutant declares it, so no check is shown to fail on its path"
    assert m.caught_by, f"{m.name} names no check that catches it"


def test_an_event_nothing_counts_is_refused_with_a_suggestion():
    from optimized_stack.toggles import EXACT, Toggle
    with pytest.raises(K3Error, match=r"unknown event 'prefix_hit_blok'; did you mean 'prefix_hit_block'"):
        Toggle("x", "x", EXACT, ("logits",), events=("prefix_hit_blok",))
    with pytest.raises(K3Error, match=r"event 'op:lienar' names no op slot; did you mean"):
        Toggle("x", "x", EXACT, ("logits",), events=(OP_PREFIX + "lienar",))
    assert Toggle("x", "x", EXACT, ("logits",), events=("prefix_hit_block", "op:linear")).events


def test_the_selftest_pick_is_in_the_default_set():
    for t in CPU_W1:
        assert choose(t, one=True).names[0] in choose(t).names or not t.exercised_by, t.name


# ---- every event fires where the selftest (premerge) judges the toggle --------------------------

@pytest.mark.parametrize("name", [t.name for t in OPTIMIZATIONS])
def test_declared_events_fire_on_the_selftest_pick(model, name):
    """The pick is one scenario of the default set, so this proves the default set fires them too."""
    t = registry.get(name)
    pick = choose(t, one=True).names[0]
    cap = run_scenario(model, build(pick), (name,))
    silent = [e for e in t.events if not cap.events.get(e)]
    assert not silent, f"{name} on {pick}: declared events never fired: {silent} (fired: {cap.events})"


def test_engine_counters_are_the_registry_names():
    assert all(not e.startswith(OP_PREFIX) for e in EVENTS)
    assert {"prefix_hit_on_generated", "host_take_ckpt", "preempt_sampled", "spec_reject_all",
            "chunk_cut_on_grid"} <= set(EVENTS)


# ---- negative controls: each event's mutant -----------------------------------------------------

CPU_EVENTS = [e for e in declared_events()
              if (m := mutant_for(e)) is not None and "cpu" in m.devices and 1 in m.world_sizes]


@pytest.mark.parametrize("event", CPU_EVENTS)
def test_the_events_mutant_reads_not_exercised_where_the_event_never_fires(model, event):
    m = mutant_for(event)
    runner = Runner(model)
    quiet = [sc for sc in quiet_scenarios() if not runner.run(sc, (m.name,)).events.get(event)]
    if event in ALWAYS_CALLED:
        assert not quiet, f"{event} is called by every forward: it must fire on every scenario"
        return
    assert quiet, f"{event} fired even on the quiet scenarios: no negative control scenario"
    results = check_toggle(model, m.name, quiet[0], runner=runner, localize_failures=False)
    assert results and all(r.status == "not_exercised" for r in results), \
        f"{m.name} on {quiet[0].name}: " + "; ".join(f"{r.check} {r.status}: {r.reason}" for r in results)
    assert all(event in r.evidence["events_missing"] for r in results)


# one event per mechanism in the fast run (the selftest in premerge catches every mutant anyway)
FAST_CAUGHT = {"batched_forward", "chunk_cut_on_grid", "prefix_hit_on_generated", "host_take_ckpt",
               "preempt_sampled", "spec_accept_all", "state_roundtrip", "op:kda_decode"}


@pytest.fixture(scope="module")
def shared_runner(model):
    return Runner(model)                 # one reference capture per scenario for the whole module


@pytest.mark.parametrize("event", [e if e in FAST_CAUGHT else pytest.param(e, marks=pytest.mark.slow)
                                   for e in CPU_EVENTS])
def test_the_events_mutant_is_caught_where_the_event_fires(model, shared_runner, event):
    m = mutant_for(event)
    pick = choose(m, one=True).names[0]
    results = check_toggle(model, m.name, build(pick), runner=shared_runner, localize_failures=False)
    failed = {r.check for r in results if r.status == "fail"}
    assert failed & set(m.caught_by), (f"{m.name} on {pick} not caught by {m.caught_by}: "
                                       + "; ".join(f"{r.check} {r.status}" for r in results))
    assert results[0].evidence["events"][event] > 0


# ---- real answers in multi-turn histories -------------------------------------------------------

def test_multi_turn_histories_carry_the_models_real_answers(model):
    static = build("multi_turn")
    real = realized(model, static)
    assert realized(model, static) is real, "realised once per model"
    assert not real.needs_answers and real.meta["answers"] == "reference"
    ref = run_scenario(model, real, ())
    by_id = {r.request_id: r for r in real.requests}
    for r in real.requests:
        if r.parent:
            p = by_id[r.parent]
            answer = tuple(ref.requests[p.request_id].tokens)
            assert r.prompt_ids == p.prompt_ids + answer + r.extend, f"{r.request_id}: not the real answer"
    assert real.prompt_tokens != static.prompt_tokens or real.requests != static.requests
    reuse = real.meta["reuse"]
    assert 0 < reuse["theoretical_block_tokens"] <= reuse["theoretical_tokens"] < reuse["prompt_tokens"]


def test_a_checkpoint_saved_at_a_requests_end_is_hit_by_the_next_turn(model):
    cap = run_scenario(model, build("multi_turn"), ("ckpt_with_mla_tail",))
    assert cap.events["checkpoint_saved_at_end"] and cap.events["prefix_hit_on_generated"]
    m = cap.metrics
    assert 0 < m["prefix_hit_tokens"] <= m["reusable_tokens"], "achieved reuse within the theoretical"
