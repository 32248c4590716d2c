"""Speculative decoding (optimized_stack/engine/spec.py): both exact toggles judged by the
verifier's own gate (k3verify.verdict.gate.check_toggle: tokens, every logits row, every KDA state
point, MLA rows) on spec_repetitive and spec_random, at low acceptance (the prompt-lookup
drafter) and high acceptance (an oracle drafter that proposes the reference continuation
with deterministic corruptions, so full, partial and reject-first verifications all
happen); every spec mutant caught by the check it names; the building blocks (drafter,
trace/replay recurrence, options) on their own.

Why an oracle drafter for high acceptance: with the shipped k3-mini models (seeded preset
and trained golden) greedy decoding does not continue the prompts' repetition, so prompt
lookup is accepted ~0-0.1 drafts per step on both spec scenarios (measured; see the
report). The rollback paths only care how many drafts are accepted, not who drafted them.
"""
from __future__ import annotations

import pytest
import torch

from k3verify.run.runner import Runner
from k3verify.scenarios import workloads
from k3verify.scenarios.answers import realized
from k3verify.verdict.gate import check_toggle
from optimized_stack import K3Error, toggles
from optimized_stack.engine import Engine, EngineOptions, SamplingParams
from optimized_stack.engine import engine as engine_module
from optimized_stack.engine import spec as spec_module
from optimized_stack.engine.spec import NgramDrafter, Speculator, kda_state_bytes
from optimized_stack.kernels.kda.chunked import kda_chunked
from optimized_stack.model.kda import kda_recurrent, kda_recurrent_trace, kda_replay
from optimized_stack.model.ops import l2_norm

from model_fixtures import model  # noqa: F401  (the module-scoped k3-mini fixture)

SPEC_TOGGLES = ["spec_copy_states", "spec_replay_ssm"]
SPEC_SCENARIOS = ["spec_repetitive", "spec_random"]
MUTANT_CHECK = {                      # mutant -> (scenario, the check asserted to catch it)
    "mut_spec_gate_recompute": ("spec_random", "kda_state"),
    "mut_spec_conv_not_compacted": ("spec_random", "kda_state"),
    "mut_spec_accept_off_by_one": ("spec_random", "tokens"),
    "mut_spec_replay_closed_form": ("spec_random", "kda_state"),
    # every draft accepted: only where the drafts follow the model (the re-quoted prompt tail)
    "mut_spec_bonus_off_by_one": ("spec_repetitive", "tokens"),
}


@pytest.fixture(scope="module")
def refs(model):
    return Runner(model)


@pytest.fixture(scope="module")
def scenarios():
    return {name: workloads.build(name) for name in SPEC_SCENARIOS}


@pytest.fixture
def speculators(monkeypatch):
    """Every Speculator the engine builds during the test (for its acceptance stats)."""
    made: list[Speculator] = []

    class Recorded(Speculator):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)
    monkeypatch.setattr(engine_module, "Speculator", Recorded)
    return made


def _stats(made: list[Speculator]):
    assert len(made) == 1, f"expected one speculative engine run, got {len(made)}"
    return made[0].stats


def _judge(model, name, sc, refs):
    results = check_toggle(model, name, sc, runner=refs, localize_failures=False)
    return {r.check: r for r in results}


# ---- the toggles, bitwise, low and high acceptance -------------------------------------
@pytest.mark.parametrize("scenario", SPEC_SCENARIOS)
@pytest.mark.parametrize("name", SPEC_TOGGLES)
def test_toggle_bitwise_with_prompt_lookup(model, refs, scenarios, speculators, name, scenario):
    res = _judge(model, name, scenarios[scenario], refs)
    bad = {c: r.reason for c, r in res.items() if r.status not in ("pass", "not_exercised")}
    assert not bad, f"{name} on {scenario}: exact contract broken: {bad}"
    s = _stats(speculators)
    assert s.verify_steps > 0 and s.rollbacks > 0, f"{name} on {scenario}: no draft was ever rejected: {s}"
    if scenario == "spec_repetitive":
        # the re-quoted prompt tail: drafts of the model's own earlier answer, kept in full and in part
        assert all(r.status == "pass" for r in res.values()), {c: r.reason for c, r in res.items()}
        assert s.accepted > 0 and s.partial_rollbacks > 0, f"no draft was ever accepted: {s}"
    else:
        # random bytes: the model does not follow prompt lookup, so no verification accepts every
        # draft and the exact verdict says so instead of passing
        assert s.mean_accepted < 0.3, f"expected near-zero acceptance with prompt lookup, got {s.mean_accepted:.2f}"
        assert all(r.status == "not_exercised" and "spec_accept_all" in r.reason for r in res.values()), \
            {c: (r.status, r.reason) for c, r in res.items()}


class OracleDrafter(NgramDrafter):
    """Proposes the reference continuation; every third proposal has one wrong token (at a
    position that cycles), so verifications are full, partial and reject-first."""

    sequences: list[list[int]] = []

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = 0

    def propose(self, tokens, k):
        seq = next((s for s in self.sequences if s[:len(tokens)] == tokens), None)
        if seq is None:
            return []
        draft = list(seq[len(tokens):len(tokens) + k])
        self.calls += 1
        if draft and self.calls % 3 == 0:
            j = (self.calls // 3) % len(draft)
            draft[j] = (draft[j] + 1) % 256
        return draft


@pytest.mark.parametrize("name", SPEC_TOGGLES)
def test_toggle_bitwise_at_high_acceptance(model, refs, scenarios, speculators, monkeypatch, name):
    sc = realized(model, scenarios["spec_repetitive"])       # the prompts the runs feed
    ref = refs.reference(sc)
    seqs = [list(r.prompt_ids) + ref.requests[r.request_id].tokens for r in sc.requests]
    monkeypatch.setattr(OracleDrafter, "sequences", seqs)
    monkeypatch.setattr(spec_module, "NgramDrafter", OracleDrafter)
    res = _judge(model, name, sc, refs)
    bad = {c: r.reason for c, r in res.items() if r.status != "pass"}
    assert not bad, f"{name} at high acceptance: exact contract broken: {bad}"
    s = _stats(speculators)
    assert s.mean_accepted > 1, f"expected high acceptance, got {s.mean_accepted:.2f} per step ({s})"
    assert s.partial_rollbacks > 0, f"no rollback kept some drafts and dropped others: {s}"


def test_spec_run_takes_fewer_steps_at_high_acceptance(model, refs, scenarios, monkeypatch):
    """The point of it: accepted drafts turn into fewer engine steps for the same tokens."""
    sc = realized(model, scenarios["spec_repetitive"])       # the prompts the runs feed
    ref = refs.reference(sc)
    monkeypatch.setattr(OracleDrafter, "sequences",
                        [list(r.prompt_ids) + ref.requests[r.request_id].tokens for r in sc.requests])
    monkeypatch.setattr(spec_module, "NgramDrafter", OracleDrafter)
    steps = {}
    for label, extra in (("plain", {}), ("spec", {"speculative": "replay_ssm"})):
        eng = Engine(model, EngineOptions(continuous_batching=True, **extra))
        for r in sc.requests:
            eng.add_request(list(r.prompt_ids), SamplingParams(max_new_tokens=r.max_new_tokens),
                            request_id=r.request_id)
        out = eng.run()
        assert {rid: x.tokens for rid, x in out.items()} == {rid: x.tokens for rid, x in ref.requests.items()}
        steps[label] = eng.metrics.steps
    assert steps["spec"] < steps["plain"], f"speculation saved no steps: {steps}"


# ---- mutants (negative controls) --------------------------------------------------------
def test_every_spec_mutant_has_a_test():
    mutants = {t.name for t in toggles.all_toggles("mutant") if t.mutant_of in SPEC_TOGGLES}
    assert mutants == set(MUTANT_CHECK), "a spec mutant is registered without a test (or vice versa)"
    for name, (_, check) in MUTANT_CHECK.items():
        t = toggles.get(name)
        assert check in t.caught_by and t.lives_in, f"{name}: registry says caught_by={t.caught_by}"
        assert EngineOptions.from_dict(t.engine).faults == {name}


@pytest.mark.parametrize("mutant", list(MUTANT_CHECK))
def test_mutant_is_caught(model, refs, scenarios, mutant):
    scenario, check = MUTANT_CHECK[mutant]
    res = _judge(model, mutant, scenarios[scenario], refs)
    for c in toggles.get(mutant).caught_by:
        assert res[c].status == "fail", f"{mutant}: check {c!r} should catch it on {scenario}, got {res[c].reason}"
    if mutant == "mut_spec_gate_recompute":
        # the tokens survive: only looking at state (and the rows it feeds) catches it
        assert res["tokens"].status == "pass", "expected the gate-recompute drift to leave the tokens alone"


# ---- building blocks --------------------------------------------------------------------
@pytest.mark.parametrize("tokens,k,want", [
    ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),            # trigram match
    ([5, 6, 7, 1, 5, 6], 3, [7, 1, 5]),            # no earlier trigram 1,5,6: bigram 5,6
    ([4, 1, 4, 2, 9, 4], 5, [2, 9, 4]),            # unigram, most recent earlier 4, capped by the end
    ([1, 2, 3], 3, []),                            # nothing repeats
    ([1, 1, 1], 0, []),                            # k = 0
], ids=["trigram", "bigram-fallback", "unigram-recent", "no-match", "k0"])
def test_ngram_drafter(tokens, k, want):
    assert NgramDrafter().propose(tokens, k) == want


def test_ngram_drafter_rejects_bad_sizes():
    with pytest.raises(ValueError, match="expected 1 <= min_n <= max_n, got 3, 2"):
        NgramDrafter(max_n=2, min_n=3)


def _kda_inputs(t_len=9, h=4, kd=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2_norm(torch.randn(t_len, h, kd, generator=g)) * kd ** -0.5
    k = l2_norm(torch.randn(t_len, h, kd, generator=g))
    v = torch.randn(t_len, h, kd, generator=g)
    gate = -5 * torch.sigmoid(torch.randn(t_len, h, kd, generator=g))
    beta = torch.sigmoid(torch.randn(t_len, h, generator=g))
    return q, k, v, gate, beta, torch.randn(h, kd, kd, generator=g)


def test_trace_and_replay_are_the_recurrence_bit_for_bit():
    q, k, v, g, beta, s0 = _kda_inputs()
    o, s = kda_recurrent(q, k, v, g, beta, s0)
    o2, s2, tr = kda_recurrent_trace(q, k, v, g, beta, s0, keep_states=True)
    assert torch.equal(o, o2) and torch.equal(s, s2), "the tracing recurrence must not change a bit"
    for e in range(1, q.shape[0] + 1):
        want = kda_recurrent(q[:e], k[:e], v[:e], g[:e], beta[:e], s0)[1]
        assert torch.equal(tr.states[e - 1], want), f"kept state after {e} tokens differs"
        assert torch.equal(kda_replay(s0, tr.k[:e], tr.u[:e], tr.g[:e]), want), f"replay of {e} tokens differs"


def test_replay_negative_controls_differ():
    """The two ways a replay can go wrong that the mutants seed: the closed form and a
    perturbed gate. Both must move bits, or the mutants could not be caught."""
    q, k, v, g, beta, s0 = _kda_inputs()
    want = kda_recurrent(q, k, v, g, beta, s0)[1]
    assert not torch.equal(kda_chunked(q, k, v, g, beta, s0)[1], want)
    tr = kda_recurrent_trace(q, k, v, g, beta, s0)[2]
    g_off = torch.nextafter(tr.g, torch.zeros_like(tr.g))        # one ULP towards zero
    assert not torch.equal(kda_replay(s0, tr.k, tr.u, g_off), want)


@pytest.mark.parametrize("kwargs,match", [
    ({"speculative": "replay_ssm"}, "speculative requires continuous_batching"),
    ({"continuous_batching": True, "speculative": "copy"}, "expected None or one of"),
    ({"continuous_batching": True, "speculative": "replay_ssm", "drafter": "eagle"}, "drafter: expected one of"),
    ({"continuous_batching": True, "speculative": "replay_ssm", "num_draft_tokens": 0}, "num_draft_tokens: expected"),
    ({"continuous_batching": True, "forced_acceptance": 2.0}, "forced_acceptance requires speculative"),
    ({"continuous_batching": True, "speculative": "replay_ssm", "forced_acceptance": 4.5},
     r"forced_acceptance: expected None or a number in \[1, num_draft_tokens \+ 1 = 4\], got 4.5"),
], ids=["needs-cb", "bad-strategy", "bad-drafter", "zero-drafts", "forced-needs-spec", "forced-range"])
def test_spec_options_reject_bad_values(kwargs, match):
    with pytest.raises(K3Error, match=match):
        EngineOptions(**kwargs)


def test_forced_acceptance_hits_its_mean(model, scenarios):
    """Timing mode: a fixed mean number of tokens per verification, whatever the target says."""
    sc = scenarios["spec_random"]
    eng = Engine(model, EngineOptions(continuous_batching=True, speculative="replay_ssm", num_draft_tokens=3,
                                      forced_acceptance=3.36))
    for r in sc.requests:
        eng.add_request(list(r.prompt_ids), SamplingParams(max_new_tokens=40, ignore_eos=True),
                        request_id=r.request_id)
    eng.run()
    s = eng.spec.stats
    assert abs(s.acceptance_length - 3.36) < 0.15, f"forced 3.36 tokens per step, got {s.acceptance_length:.2f}"


def test_state_bytes_match_the_pool(model):
    cfg = model.config
    st = model.new_state()
    live = sum(t.numel() * t.element_size() for k in st.kda.values() for t in k.tensors().values())
    n_kda = len(st.kda)
    assert kda_state_bytes(n_kda, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size, None, None) == live
    copy3 = kda_state_bytes(n_kda, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size, 3, "copy_states")
    replay3 = kda_state_bytes(n_kda, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size, 3, "replay_ssm")
    assert copy3 == 4 * live and replay3 < copy3
