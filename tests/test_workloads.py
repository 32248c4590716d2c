"""k3verify.scenarios: determinism, boundaries where claimed, reuse arithmetic, vocab and size bounds,
static tags, and the one chooser of which scenarios judge a toggle."""

import itertools

import pytest

from k3verify.errors import UsageError
from k3verify.scenarios.requests import (RequestSpec, Scenario, common_prefix_len, repeated_ngram_fraction,
                                         reusable_fraction, reusable_prefix_tokens)
from k3verify.scenarios.workloads import (BLOCK_TOKENS, BOUNDARY_LENGTHS, FORK_BLOCK_POINTS, FORK_SUBBLOCK_POINTS,
                                          MAX_DEFAULT_TOKENS, SCENARIOS, SYSTEM_PREFIX_TOKENS, build, list_scenarios)

NAMES = list_scenarios()
TEXT_SCENARIOS = [n for n in NAMES if n != "spec_random"]


def test_registry_lists_every_scenario_from_the_brief():
    assert set(NAMES) == {"single", "multi_length", "boundaries", "shared_prefix_forks", "multi_turn", "long_prompt",
                          "long_prompt_tail", "eviction", "preemption", "agentic", "spec_repetitive", "spec_random"}
    assert set(SCENARIOS) == set(NAMES)
    assert SCENARIOS["single"].build(seed=3) == build("single", seed=3)
    assert list_scenarios("prefix") == ["shared_prefix_forks", "multi_turn", "eviction", "agentic"]


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_scenario(name):
    assert build(name, seed=7) == build(name, seed=7)


@pytest.mark.parametrize("name", NAMES)
def test_different_seeds_differ(name):
    a, b = build(name, seed=0), build(name, seed=1)
    assert [r.prompt_ids for r in a.requests] != [r.prompt_ids for r in b.requests]
    assert [r.request_id for r in a.requests] == [r.request_id for r in b.requests]  # same shape, other text


@pytest.mark.parametrize("vocab", [256, 100, 2], ids=["vocab256", "vocab100", "vocab2"])
@pytest.mark.parametrize("name", NAMES)
def test_ids_below_vocab(name, vocab):
    s = build(name, vocab=vocab)
    assert all(0 <= i < vocab for r in s.requests for i in r.prompt_ids), f"{name}: an id >= vocab {vocab}"


@pytest.mark.parametrize("name", NAMES)
def test_default_size_bounded(name):
    s = build(name)
    assert s.prompt_tokens + s.new_tokens <= MAX_DEFAULT_TOKENS, f"{name} exceeds {MAX_DEFAULT_TOKENS} tokens"
    assert len(s.requests) <= 32


@pytest.mark.parametrize("name", TEXT_SCENARIOS)
def test_text_scenarios_look_like_text(name):
    ids = [i for r in build(name).requests for i in r.prompt_ids]
    printable = sum(32 <= i < 127 or i == 10 for i in ids)
    assert printable == len(ids), f"{name}: prompts should be ASCII text"
    assert ids.count(32) / len(ids) > 0.08, f"{name}: text should have word breaks"


def test_random_bytes_are_not_text():  # negative control for the check above
    ids = [i for r in build("spec_random").requests for i in r.prompt_ids]
    assert sum(32 <= i < 127 for i in ids) < 0.6 * len(ids)


def test_single_request_shape():
    (r,) = build("single").requests
    assert r.prompt_len == 100 and r.max_new_tokens == 8 and r.temperature == 0.0


def test_multi_length_staggered_and_varied():
    s = build("multi_length")
    assert len({r.prompt_len for r in s.requests}) == len(s.requests)
    assert len({r.arrival_step for r in s.requests}) > 3
    sampled = [r for r in s.requests if r.temperature > 0]
    assert len(sampled) == 1 and sampled[0].seed is not None


def test_boundaries_lengths_exact():
    s = build("boundaries", scale=3.0)  # boundary lengths do not move with scale
    lengths = {r.request_id: r.prompt_len for r in s.requests}
    for n in (63, 64, 65, 127, 128, 129, 80):
        assert lengths[f"len{n:03d}"] == n
    assert set(BOUNDARY_LENGTHS) <= set(lengths.values())
    cross = s.request("len060-decode-cross")
    assert cross.prompt_len < BLOCK_TOKENS < cross.prompt_len + cross.max_new_tokens
    assert "boundaries" in s.tags


@pytest.mark.parametrize("vocab", [256, 3], ids=["vocab256", "vocab3"])
def test_forks_part_exactly_where_claimed(vocab):
    s = build("shared_prefix_forks", vocab=vocab)
    base = s.request("base").prompt_ids
    claimed = s.meta["fork_points"]
    assert set(FORK_BLOCK_POINTS) | set(FORK_SUBBLOCK_POINTS) <= set(claimed.values())
    for rid, at in claimed.items():
        fork = s.request(rid).prompt_ids
        assert common_prefix_len(base, fork) == at, f"{rid} should part from base at {at}"
    # at, just before and just after each block boundary
    for boundary in (2 * BLOCK_TOKENS, 3 * BLOCK_TOKENS):
        assert {boundary - 1, boundary, boundary + 1} <= set(claimed.values())
    assert any(p % BLOCK_TOKENS not in (0, 1, BLOCK_TOKENS - 1) for p in claimed.values())  # sub-block points
    assert SYSTEM_PREFIX_TOKENS >= 100
    assert all(common_prefix_len(base, r.prompt_ids) >= SYSTEM_PREFIX_TOKENS for r in s.requests)
    assert all(s.request(rid).arrival_step > s.request("base").arrival_step for rid in claimed)
    assert "prefix" in s.tags


def test_multi_turn_resends_history():
    s = build("multi_turn")
    by_id = {r.request_id: r for r in s.requests}
    children = [r for r in s.requests if r.parent]
    assert len({r.session for r in s.requests}) == 3 and len(children) >= 4
    for cur in children:
        prev = by_id[cur.parent]
        # the whole previous prompt, a stand-in of the parent's answer length (realised with the
        # model's real answer: tests/test_events.py), then the new message
        assert cur.prompt_ids[:prev.prompt_len] == prev.prompt_ids, "whole previous prompt re-sent"
        assert cur.prompt_len == prev.prompt_len + prev.max_new_tokens + len(cur.extend)
        assert cur.prompt_ids[-len(cur.extend):] == cur.extend
        assert cur.arrival_step > prev.arrival_step
    assert any(r.session.startswith("s0-sub") for r in children), "a subagent forked from mid-session"
    retry = by_id["s0-t0-retry"]
    assert retry.prompt_ids == by_id["s0-t0"].prompt_ids and retry.prompt_len % BLOCK_TOKENS == 0
    assert s.needs_answers and "prefix" in s.tags


def test_agentic_reuse_above_ninety_percent():
    s = build("agentic")
    assert s.reusable_fraction > 0.9
    assert s.reusable_fraction == reusable_fraction(s.requests)
    assert {"prefix", "agentic"} <= set(s.tags)
    prefix = s.meta["system_prefix_tokens"]
    assert all(common_prefix_len(s.requests[0].prompt_ids, r.prompt_ids) >= prefix for r in s.requests)
    subs = [r for r in s.requests if "-sub" in (r.session or "")]
    assert subs, "agentic needs subagent forks"
    for sub in subs:
        parent = [r for r in s.requests if r.session == sub.session.split("-sub")[0]]
        # A subagent's first turn re-sends more than any one parent turn shares with its predecessor.
        assert max(common_prefix_len(p.prompt_ids, sub.prompt_ids) for p in parent) > prefix


def test_agentic_reuse_is_a_property_of_the_scale_not_luck():
    assert build("agentic", seed=5).reusable_fraction > 0.9
    assert build("agentic", scale=0.5).prompt_tokens < build("agentic").prompt_tokens


def test_reusable_fraction_hand_built():
    reqs = [
        RequestSpec("a", (1, 2, 3, 4), 1, arrival_step=0),
        RequestSpec("b", (1, 2, 3, 9, 9), 1, arrival_step=2),
        RequestSpec("c", (5, 6), 1, arrival_step=1),
        RequestSpec("d", (1, 2, 3, 4), 1, arrival_step=3),  # a full repeat of a
    ]
    assert reusable_prefix_tokens(reqs) == {"a": 0, "c": 0, "b": 3, "d": 4}
    assert reusable_fraction(reqs) == pytest.approx(7 / 15)
    # A request cannot reuse what arrives after it: move d first and a becomes the repeat.
    moved = [RequestSpec("d", (1, 2, 3, 4), 1, arrival_step=0)] + reqs[:3]
    moved[1] = RequestSpec("a", (1, 2, 3, 4), 1, arrival_step=1)
    assert reusable_prefix_tokens(moved)["d"] == 0 and reusable_prefix_tokens(moved)["a"] == 4


def test_reusable_fraction_near_zero_without_shared_prefixes():  # negative control
    for name in ("spec_random", "preemption", "single"):
        assert build(name).reusable_fraction < 0.05, name


def test_long_prompt_goes_through_chunks():
    (r,) = build("long_prompt").requests
    assert 1400 <= r.prompt_len <= 1600 and r.prompt_len % BLOCK_TOKENS != 0
    assert "long" in build("long_prompt").tags


def test_eviction_cache_smaller_than_working_set():
    s = build("eviction")
    cache = s.engine_hints["device_cache_tokens"]
    families = s.meta["family_prefix_tokens"]
    assert cache < 2 * min(families.values()), "two family prefixes must not fit at once"
    assert s.reusable_fraction > 0.5 and {"prefix", "eviction"} <= set(s.tags)


def test_preemption_oversubscribes_the_pools():
    s = build("preemption")
    concurrent = [r for r in s.requests if r.arrival_step == 0]
    assert len(concurrent) > s.engine_hints["kda_pool_slots"] == 4
    # what forces preemption is the MLA pool: two of the largest requests exceed it
    block = 64
    blocks = sorted(-(-(len(r.prompt_ids) + r.max_new_tokens) // block) for r in concurrent)
    assert blocks[-1] + blocks[-2] > s.engine_hints["device_cache_tokens"] // block
    assert "preemption" in s.tags


def test_spec_scenarios_have_high_and_low_repetition():
    rep = [repeated_ngram_fraction(r.prompt_ids) for r in build("spec_repetitive").requests]
    rnd = [repeated_ngram_fraction(r.prompt_ids) for r in build("spec_random").requests]
    assert min(rep) > 0.5, rep
    assert max(rnd) < 0.05, rnd
    assert repeated_ngram_fraction([1, 2, 3, 4, 1, 2, 3, 4], n=4) == pytest.approx(1 / 5)


def test_unknown_scenario_suggests_a_name():
    with pytest.raises(UsageError, match=r"unknown scenario 'singel'; did you mean 'single'\?"):
        build("singel")


@pytest.mark.parametrize("kwargs, match", [
    ({"scale": 0}, r"scale must be a number in \(0, 64\], got 0"),
    ({"vocab": 1}, r"vocab must be an integer >= 2, got 1"),
    ({"seed": "x"}, r"seed must be an integer, got 'x'"),
], ids=["scale-zero", "vocab-one", "seed-str"])
def test_bad_build_arguments(kwargs, match):
    with pytest.raises(UsageError, match=match):
        build("single", **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"prompt_ids": ()}, "prompt_ids must be non-empty"),
    ({"prompt_ids": (1, -2)}, "prompt ids must be ints >= 0, got -2"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1, got 0"),
    ({"temperature": 0.8}, "temperature 0.8 needs a seed"),
], ids=["empty", "negative-id", "zero-new", "unseeded-sample"])
def test_request_spec_validation(kwargs, match):
    args = {"request_id": "r", "prompt_ids": (1, 2), "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        RequestSpec(**args)


def test_scenario_rejects_duplicate_ids():
    r = RequestSpec("r", (1,), 1)
    with pytest.raises(ValueError, match=r"duplicate request ids \['r'\]"):
        Scenario("x", "d", (), (r, r))


# ---- static tags and the chooser -------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_registry_tags_are_the_built_scenarios_tags(name):
    entry = SCENARIOS[name]
    sc = build(name, scale=0.25)
    assert (sc.tags, sc.description) == (entry.tags, entry.description)


def test_the_chooser_reads_tags_without_building(monkeypatch):
    """Choosing scenarios for a toggle must not run a builder (tags are static metadata);
    negative control: building one does run it."""
    from k3verify.scenarios import chooser, workloads
    from optimized_stack import toggles as registry

    calls = []
    for name, entry in list(SCENARIOS.items()):
        monkeypatch.setitem(SCENARIOS, name, workloads.ScenarioEntry(
            entry.name, entry.description, entry.tags, lambda g, s, b=entry.builder: calls.append(1) or b(g, s)))
    choice = chooser.choose(registry.get("prefix_cache"))
    assert choice.names == ("single", "multi_length", "boundaries", "shared_prefix_forks", "multi_turn",
                            "eviction", "agentic")
    assert calls == [], "the chooser built a scenario to read its tags"
    build("single")
    assert calls == [1]


def test_the_chooser_adds_a_tagged_scenario_when_none_listed_applies_and_says_so():
    from k3verify.scenarios import chooser

    class Tagged:                                   # a toggle that only applies to spec scenarios
        scenario_tags, exercised_by, mutant_of = ("spec",), (), None
    choice = chooser.choose(Tagged(), ["single"])
    assert choice.names == ("single", "spec_repetitive") and "added 'spec_repetitive'" in choice.note
    assert chooser.choose(Tagged(), ["spec_random"]).names == ("spec_random",), "a listed tagged scenario: as written"


def test_the_selftest_choice_is_the_cheapest_exercising_scenario():
    from k3verify.scenarios import chooser
    from optimized_stack import toggles as registry

    assert chooser.choose(registry.get("prefill_step_api"), one=True).names == ("single",)
    # a mutant is judged where the toggle it mutates is exercised
    assert chooser.choose(registry.get("mut_restore_skips_conv"), one=True).names == ("multi_turn",)
    assert chooser.choose(registry.get("spec_replay_ssm"), one=True).names == ("spec_repetitive",)
