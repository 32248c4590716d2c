"""Every engine toggle is bit-exact against the reference engine (all options off), and every
engine mutant is caught by the checks it names (negative controls).

Compared per request: generated tokens; every logits row the candidate emits (against the
reference row at the same position; the reference emits every prompt and decode row);
every KDA state the candidate emits (against the reference state after the same number of
tokens: the reference's own emission where it has one, else the model run on the same
token prefix, which is exact because chunked == whole-prompt prefill on row-stable ops);
the MLA rows at finish. Workloads are small k3-mini scenarios shaped to break caches:
staggered arrivals, forks around block and checkpoint boundaries, multi-turn sessions
that re-send history, a tiny device pool (eviction/restore) and page pressure (preemption).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from optimized_stack import toggles
from optimized_stack.engine import Engine, EngineObserver, EngineOptions, SamplingParams
from model_fixtures import model  # noqa: F401  (the module-scoped k3-mini fixture)

CHECKS = ("tokens", "logits", "kda_state", "mla_rows")


# ---- workloads ------------------------------------------------------------------------
@dataclass
class Scenario:
    name: str
    requests: list[tuple[str, list[int], SamplingParams, int]]      # rid, prompt, params, arrival
    followups: dict[str, tuple[str, list[int], SamplingParams]] = field(default_factory=dict)
    options: dict = field(default_factory=dict)                     # candidate capacity knobs


def _rand(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=gen).tolist()


def make_scenarios() -> dict[str, Scenario]:
    g = torch.Generator().manual_seed(1234)
    greedy3 = SamplingParams(max_new_tokens=3, ignore_eos=True)
    out: dict[str, Scenario] = {}
    # staggered arrivals, mixed lengths, one seeded-sampling request
    reqs = []
    for i, (n, arrival) in enumerate(zip((40, 90, 55, 70, 30, 85), (0, 0, 1, 2, 4, 6))):
        p = (SamplingParams(max_new_tokens=5, temperature=0.8, seed=7, ignore_eos=True) if i == 2
             else SamplingParams(max_new_tokens=5, ignore_eos=True))
        reqs.append((f"s{i}", _rand(g, n), p, arrival))
    out["staggered"] = Scenario("staggered", reqs)
    # forks of one 140-token sequence at, before and after block (64, 128) and checkpoint
    # (80) boundaries, plus a verbatim 128-token prefix (ends exactly on a block)
    base = _rand(g, 140)
    reqs = [("base", base, greedy3, 0)]
    for i, f in enumerate((63, 64, 65, 80, 127, 128, 129)):
        p = SamplingParams(max_new_tokens=3, temperature=0.7, seed=5, ignore_eos=True) if f == 65 else greedy3
        reqs.append((f"fork{f}", base[:f] + _rand(g, 12), p, 1 + i))
    reqs.append(("dup128", base[:128], greedy3, 9))
    out["forks"] = Scenario("forks", reqs)
    # multi-turn: 3 sessions share a 70-token system prefix; each turn re-sends the history
    system = _rand(g, 70)
    p4 = SamplingParams(max_new_tokens=4, ignore_eos=True)
    reqs, follow = [], {}
    for s, name in enumerate("ABC"):
        reqs.append((f"{name}1", system + _rand(g, 10), p4, s))
        for t in (1, 2):
            follow[f"{name}{t}"] = (f"{name}{t + 1}", _rand(g, 12), p4)
    out["multiturn"] = Scenario("multiturn", reqs, follow)
    # the same sessions plus an unrelated one, on a 2-block device pool: the unrelated
    # session evicts the shared system block, the next system-prefix hit restores it
    tiny_reqs = reqs + [("X1", _rand(g, 90), p4, 1)]
    tiny_follow = {**follow, "X1": ("X2", _rand(g, 8), p4)}
    out["multiturn_tiny"] = Scenario("multiturn_tiny", tiny_reqs, tiny_follow, {"device_cache_tokens": 128})
    # page pressure: 4 requests whose decodes cross a block boundary, 4-block pool
    shared = _rand(g, 40)
    p16 = SamplingParams(max_new_tokens=16, ignore_eos=True)
    reqs = [(f"p{i}", shared + _rand(g, n), p16, 0) for i, n in enumerate((10, 14, 18, 22))]
    out["pressure"] = Scenario("pressure", reqs, options={"device_cache_tokens": 256, "max_num_seqs": 4})
    return out


SCENARIOS = make_scenarios()


# ---- capture and drive ------------------------------------------------------------------
class Capture(EngineObserver):
    def __init__(self) -> None:
        self.logits: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.kda: dict[tuple[str, int, int], object] = {}
        self.kda_points: list[tuple[str, int, int, object]] = []
        self.mla: dict[str, dict[int, torch.Tensor]] = {}
        self.steps: list[list[tuple[str, int]]] = []

    def on_logits(self, rid, start_pos, rows):
        for i in range(rows.shape[0]):
            self.logits.setdefault((rid, start_pos + i), []).append(rows[i])

    def on_kda_state(self, rid, num_tokens, layer, kda_state):
        self.kda[(rid, num_tokens, layer)] = kda_state
        self.kda_points.append((rid, num_tokens, layer, kda_state))

    def on_finish(self, rid, result, mla_rows):
        self.mla[rid] = mla_rows

    def on_step(self, step_index, scheduled):
        self.steps.append(scheduled)


@dataclass
class Run:
    results: dict
    cap: Capture
    metrics: object


def drive(model, sc: Scenario, opts: EngineOptions) -> Run:
    return drive_engine(model, sc, opts)[0]


def drive_engine(model, sc: Scenario, opts: EngineOptions) -> tuple[Run, Engine]:
    """The scenario through one engine (follow-ups re-send prompt + answer): the run and the engine."""
    cap = Capture()
    eng = Engine(model, opts, [cap])
    prompts = {}
    for rid, prompt, params, arrival in sc.requests:
        eng.add_request(prompt, params, request_id=rid, arrival_step=arrival)
        prompts[rid] = prompt
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished and out.request_id in sc.followups:
                nxt, new, params = sc.followups[out.request_id]
                prompt = prompts[out.request_id] + eng.results[out.request_id].tokens + new
                prompts[nxt] = prompt
                eng.add_request(prompt, params, request_id=nxt, arrival_step=eng.step_index)
    return Run(eng.results, cap, eng.metrics), eng


class Oracle:
    """Reference KDA states after any token prefix: the model run on that prefix, memoised
    by prefix (forward from the longest memoised prefix is exact by row-stability)."""

    def __init__(self, model):
        self.model = model
        self.memo = {(): model.new_state()}

    def state(self, seq: list[int], n: int):
        key = tuple(seq[:n])
        if key not in self.memo:
            m = next(m for m in range(n - 1, -1, -1) if tuple(seq[:m]) in self.memo)
            st = self.memo[tuple(seq[:m])].clone()
            self.model.forward(torch.tensor(seq[m:n]), st)
            self.memo[key] = st
        return self.memo[key]


def compare(ref: Run, cand: Run, oracle: Oracle) -> dict[str, list[str]]:
    """Failures per check; an empty list is a pass."""
    bad: dict[str, list[str]] = {c: [] for c in CHECKS}
    for rid, r in ref.results.items():
        c = cand.results.get(rid)
        if c is None or c.tokens != r.tokens or c.finish_reason != r.finish_reason:
            bad["tokens"].append(f"{rid}: {None if c is None else c.tokens} != {r.tokens}")
    for (rid, pos), rows in cand.cap.logits.items():
        want = ref.cap.logits.get((rid, pos))
        if want is None or any(not torch.equal(row, want[0]) for row in rows):
            bad["logits"].append(f"{rid} row {pos}")
    for rid, r in ref.results.items():             # every decode-relevant row was emitted
        seq_len = len(r.prompt_ids) + len(r.tokens)
        missing = [p for p in range(len(r.prompt_ids) - 1, seq_len - 1) if (rid, p) not in cand.cap.logits]
        if missing:
            bad["logits"].append(f"{rid} rows never emitted: {missing[:5]}")
    for rid, n, layer, st in cand.cap.kda_points:
        want = ref.cap.kda.get((rid, n, layer))
        if want is None:
            r = ref.results[rid]
            want = oracle.state(r.prompt_ids + r.tokens, n).kda[layer]
        for name, t in st.tensors().items():
            if not torch.equal(t, want.tensors()[name]):
                bad["kda_state"].append(f"{rid} n={n} layer {layer} {name}")
    for rid, rows in ref.cap.mla.items():
        got = cand.cap.mla.get(rid, {})
        for layer, t in rows.items():
            if layer not in got or not torch.equal(got[layer], t):
                bad["mla_rows"].append(f"{rid} layer {layer}")
    return bad


def summary(bad: dict[str, list[str]]) -> str:
    return "; ".join(f"{k}: {len(v)} ({', '.join(v[:3])})" for k, v in bad.items() if v)


# ---- fixtures -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def oracle(model):
    return Oracle(model)


_REFS: dict[str, Run] = {}


@pytest.fixture(scope="module")
def reference(model):
    def get(name: str) -> Run:
        if name not in _REFS:
            _REFS[name] = drive(model, SCENARIOS[name], EngineOptions())
        return _REFS[name]
    return get


def run_toggles(model, names, sc: Scenario, extra=None) -> Run:
    with toggles.applied(names) as applied:
        opts = EngineOptions.from_dict({**applied.engine, **sc.options, **(extra or {})})
        return drive(model, sc, opts)


EXACT_TOGGLES = ["continuous_batching", "chunked_prefill", "prefix_cache", "prefix_cache_subblock",
                 "ckpt_with_mla_tail", "projected_kv_cache", "host_kv_tier", "preemption", "preempt_swap"]

# (toggle names, scenario, extra options, metric expectations) -- exact hit counts are
# worked out by hand in the module notes below for the one-request-at-a-time runs
CASES = {
    "continuous_batching-staggered": (["continuous_batching"], "staggered", {}, {"max_running": (2, None)}),
    "continuous_batching-2slots-staggered": (["continuous_batching"], "staggered", {"kda_pool_slots": 2},
                                             {"max_running": (2, 2)}),
    "continuous_batching-multiturn": (["continuous_batching"], "multiturn", {}, {}),
    "chunked_prefill-forks": (["chunked_prefill"], "forks", {}, {"chunked": True}),
    "prefix_cache-forks": (["prefix_cache"], "forks", {}, {"hits": 576, "reusable": 783}),
    "prefix_cache-multiturn": (["prefix_cache"], "multiturn", {}, {"hits": 512, "reusable": 686}),
    "prefix_cache_subblock-forks": (["prefix_cache_subblock"], "forks", {}, {"hits": 624}),
    "prefix_cache_subblock-multiturn": (["prefix_cache_subblock"], "multiturn", {}, {"hits": 512}),
    "ckpt_with_mla_tail-forks": (["ckpt_with_mla_tail"], "forks", {}, {"hits": 736}),
    "ckpt_with_mla_tail-multiturn": (["ckpt_with_mla_tail"], "multiturn", {}, {"hits": 674}),
    "projected_kv_cache-staggered": (["projected_kv_cache"], "staggered", {}, {}),
    "host_kv_tier-multiturn_tiny": (["host_kv_tier"], "multiturn_tiny", {}, {"restores": True, "hits_min": 512}),
    "preemption_recompute-pressure": (["preemption"], "pressure", {}, {"preempted": True}),
    "preemption_swap-pressure": (["preemption"], "pressure", {"preempt_mode": "swap"}, {"preempted": True}),
    "all-forks": (EXACT_TOGGLES, "forks", {}, {"hits_min": 1}),
    "all-multiturn_tiny": (EXACT_TOGGLES, "multiturn_tiny", {}, {"hits_min": 1, "restores": True}),
    "all-pressure": (EXACT_TOGGLES, "pressure", {}, {"hits_min": 1, "preempted": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_toggle_is_bit_exact(model, reference, oracle, case):
    names, scenario, extra, expect = CASES[case]
    sc = SCENARIOS[scenario]
    cand = run_toggles(model, names, sc, extra)
    bad = compare(reference(scenario), cand, oracle)
    assert not any(bad.values()), f"{case}: exact toggle differs from the reference: {summary(bad)}"
    m = cand.metrics
    assert len(cand.cap.kda_points) > 0 and len(cand.cap.logits) > 0, "nothing was captured"
    if "hits" in expect:
        assert m.prefix_hit_tokens == expect["hits"], f"prefix hits: expected {expect['hits']}, got {m.prefix_hit_tokens}"
    if "hits_min" in expect:
        assert m.prefix_hit_tokens >= expect["hits_min"], "the prefix cache never hit"
    if "reusable" in expect:
        assert m.reusable_tokens == expect["reusable"], f"reusable: expected {expect['reusable']}, got {m.reusable_tokens}"
    if expect.get("restores"):
        assert m.evictions > 0 and m.restores > 0, f"no eviction/restore happened: {m}"
    if expect.get("preempted"):
        assert m.preemptions > 0, "no preemption happened, the scenario does not test it"
    if expect.get("chunked"):
        sizes = [n for step in cand.cap.steps for _, n in step]
        assert max(sizes) <= 100 and cand.metrics.steps > reference(scenario).metrics.steps, \
            "prompts were not split across steps"
    if "max_running" in expect:
        lo, hi = expect["max_running"]
        most = max(len(step) for step in cand.cap.steps)
        assert most >= lo, f"expected steps with >= {lo} requests, max was {most}"
        assert hi is None or most <= hi, f"expected at most {hi} requests per step (KDA slots), got {most}"


# mutant -> scenario (and extra options) that exercises it
MUTANT_SCENARIOS = {
    "mut_batch_plain_linear": ("staggered", {}),
    "mut_chunk_resets_conv": ("forks", {}),
    "mut_restore_skips_conv": ("forks", {}),
    "mut_ckpt_one_late": ("forks", {}),
    "mut_tail_one_short": ("forks", {}),
    "mut_projected_kv_lowp": ("staggered", {}),
    "mut_stale_block_after_evict": ("multiturn_tiny", {}),
    "mut_preempt_loses_conv": ("pressure", {}),
    "mut_recompute_skips_generated": ("pressure", {}),
}


def test_every_engine_mutant_has_a_scenario():
    """Tested here on the hand-built workloads, or in tests/test_events.py as the mutant of a path
    event (caught on the registry scenario that fires it, not exercised where nothing does)."""
    from test_events import CPU_EVENTS, mutant_for
    by_event = {mutant_for(e).name for e in CPU_EVENTS}
    engine_mutants = {t.name for t in toggles.all_toggles("mutant") if t.mutant_of in EXACT_TOGGLES}
    assert set(MUTANT_SCENARIOS) <= engine_mutants, "a mutant test names no registered engine mutant"
    assert engine_mutants <= set(MUTANT_SCENARIOS) | by_event, \
        f"engine mutants without a test: {sorted(engine_mutants - set(MUTANT_SCENARIOS) - by_event)}"
    tested = set(MUTANT_SCENARIOS) | by_event
    assert {t.mutant_of for t in toggles.all_toggles("mutant") if t.name in tested} >= set(EXACT_TOGGLES), \
        "every exact engine toggle needs at least one mutant"


@pytest.mark.parametrize("mutant", list(MUTANT_SCENARIOS))
def test_mutant_is_caught(model, reference, oracle, mutant):
    scenario, extra = MUTANT_SCENARIOS[mutant]
    sc = SCENARIOS[scenario]
    toggle = toggles.get(mutant)
    cand = run_toggles(model, [mutant], sc, extra)
    bad = compare(reference(scenario), cand, oracle)
    for check in toggle.caught_by:
        assert bad[check], f"{mutant}: check {check!r} should catch it on {scenario} but passed ({summary(bad)})"
