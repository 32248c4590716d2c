"""The batched decode step (optimized_stack/engine/fast) is bit-exact against the reference engine,
its mutants are caught, and padding a batch to the CUDA-graph ladder changes no real row's bits.

Exactness: the k3-mini scenarios of test_engine_toggles.py (staggered arrivals with a seeded
sampled request, forks around block and checkpoint boundaries, multi-turn sessions, a tiny pool
with host-tier restores, page pressure with preemption), every check: tokens, every logits row,
every KDA state point (recurrent and conv windows), the MLA rows at finish; alone, stacked on
every exact engine toggle, and on the KDA grid (decode is always on the recurrent side of it).
Each case also proves the fast path ran (steps, padded rows).

Padding (what a CUDA graph of a ladder size relies on): the same step at the padded size and at
the exact size gives the same logits rows and leaves the same pool state, bit for bit; the
padding rows write only the spare slot and block.
"""
from __future__ import annotations

import pytest
import torch

from optimized_stack import toggles
from optimized_stack.engine import Engine, EngineOptions
from optimized_stack.engine.fast.batch import LADDER, build_meta, padded_size
from optimized_stack.kernels.kda.grid import cpu_grid_kda
from optimized_stack.model import ops
from model_fixtures import model  # noqa: F401  (the module-scoped k3-mini fixture)
from test_engine_grid import GridOracle
from test_engine_toggles import EXACT_TOGGLES, SCENARIOS, Oracle, Run, compare, drive_engine, summary

FAST = ["batched_decode"]


def run_toggles(model, names, sc, extra=None) -> tuple[Run, Engine]:
    with toggles.applied(names) as applied:
        opts = EngineOptions.from_dict({**applied.engine, **sc.options, **(extra or {})})
        return drive_engine(model, sc, opts)


@pytest.fixture(scope="module")
def oracle(model):
    return Oracle(model)


_REFS: dict[tuple[str, bool], Run] = {}


def reference(model, name: str, grid: bool = False) -> Run:
    if (name, grid) not in _REFS:
        with ops.override(kda_prefill=cpu_grid_kda) if grid else ops.override():
            _REFS[(name, grid)] = drive_engine(model, SCENARIOS[name], EngineOptions())[0]
    return _REFS[(name, grid)]


CASES = {
    "batched_decode-staggered": (FAST, "staggered", {}),
    "batched_decode-2slots-staggered": (FAST, "staggered", {"kda_pool_slots": 2}),
    "batched_decode-multiturn": (FAST, "multiturn", {}),
    "batched_decode+prefix_cache-forks": (FAST + ["ckpt_with_mla_tail"], "forks", {}),
    # a 2-block pool: one request at a time, so batches of one (the host tier's restores are the point)
    "batched_decode+host_kv_tier-multiturn_tiny": (FAST + ["host_kv_tier"], "multiturn_tiny", {}),
    "batched_decode+preemption-pressure": (FAST + ["preemption"], "pressure", {}),
    "batched_decode+preemption_swap-pressure": (FAST + ["preemption"], "pressure", {"preempt_mode": "swap"}),
    "all-forks": (FAST + EXACT_TOGGLES, "forks", {}),
    "all-multiturn_tiny": (FAST + EXACT_TOGGLES, "multiturn_tiny", {}),
    "all-pressure": (FAST + EXACT_TOGGLES, "pressure", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_batched_decode_is_bit_exact(model, oracle, case):
    names, scenario, extra = CASES[case]
    cand, eng = run_toggles(model, names, SCENARIOS[scenario], extra)
    bad = compare(reference(model, scenario), cand, oracle)
    assert not any(bad.values()), f"{case}: batched_decode differs from the reference: {summary(bad)}"
    stats = eng.fast.stats
    assert stats.steps > 0, f"{case}: the fast path never ran: {stats}"
    if scenario != "multiturn_tiny":
        assert stats.rows > stats.steps, f"{case}: the fast path never ran more than one request: {stats}"
    assert cand.cap.kda_points and cand.cap.logits, "nothing was captured"


def test_the_scenarios_pad(model):
    """Padding must be exercised: some steps run 3, 5, 6 or 7 requests (padded to 4 or 8)."""
    _, eng = run_toggles(model, FAST, SCENARIOS["staggered"])
    assert eng.fast.stats.padded_rows > 0, f"no step was padded: {eng.fast.stats}"


GRID_CASES = {
    "batched_decode-staggered": (FAST, "staggered"),
    "batched_decode+prefix_cache-forks": (FAST + ["ckpt_with_mla_tail"], "forks"),
    "all-forks": (FAST + ["chunked_prefill", "ckpt_with_mla_tail", "host_kv_tier", "preemption"], "forks"),
}


@pytest.mark.parametrize("case", list(GRID_CASES))
def test_batched_decode_is_exact_on_the_kda_grid(model, case):
    """Under the CPU twin of the GPU profile's KDA (chunked on the 64-grid, recurrent tail):
    decode is on the recurrent side, prefills keep the engine's grid rules."""
    names, scenario = GRID_CASES[case]
    with ops.override(kda_prefill=cpu_grid_kda):
        cand, eng = run_toggles(model, names, SCENARIOS[scenario])
        bad = compare(reference(model, scenario, grid=True), cand, GridOracle(model))
    assert not any(bad.values()), f"{case} on the KDA grid: {summary(bad)}"
    assert eng.fast.stats.steps > 0


MUTANTS = {
    "mut_fast_pad_shares_table": "staggered",
    "mut_fast_conv_wrong_row": "staggered",
}
# mutants of batched_decode that only run at other dims, with the test that catches them there
DIMS_MUTANTS = {"mut_fast_kda_stale_value_tiles": "tests/test_real_dims.py"}


def test_every_fast_mutant_has_a_scenario():
    cpu = {t.name for t in toggles.all_toggles("mutant") if t.mutant_of == "batched_decode"}
    assert cpu == set(MUTANTS) | set(DIMS_MUTANTS), "a batched_decode mutant is registered without a test (or vice versa)"
    assert toggles.get("mut_graph_stale_input").devices == ("cuda",), "the graph mutant runs where graphs do"


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_fast_mutant_is_caught(model, oracle, mutant):
    scenario = MUTANTS[mutant]
    cand, eng = run_toggles(model, [mutant], SCENARIOS[scenario])
    bad = compare(reference(model, scenario), cand, oracle)
    assert eng.fast.stats.steps > 0, "the fault's path never ran"
    for check in toggles.get(mutant).caught_by:
        assert bad[check], f"{mutant}: check {check!r} should catch it on {scenario} but passed ({summary(bad)})"


def test_fast_path_declines_prefills_drafts_and_probes(model):
    """Only plain decodes take the fast path; a probe sends every step to the reference path."""
    eng = Engine(model, EngineOptions(continuous_batching=True, projected_kv_cache=True, batched_decode=True))
    eng.add_request(list(range(10, 40)))
    eng.step()                                   # the prefill
    assert eng.fast.stats.steps == 0
    with model.probe(lambda *a: None):
        eng.step()
    assert eng.fast.stats.steps == 0, "a decode with a probe attached went through the fast path"
    eng.step()
    assert eng.fast.stats.steps == 1


# ---- padding: eager at the padded size == eager at the exact size --------------------------
def _engine_mid_decode(model, n_requests: int) -> Engine:
    """An engine with n requests admitted and prefilled, about to decode (no step taken yet)."""
    eng = Engine(model, EngineOptions(continuous_batching=True, projected_kv_cache=True, batched_decode=True,
                                      max_num_seqs=8))
    g = torch.Generator().manual_seed(5)
    for i in range(n_requests):
        eng.add_request(torch.randint(0, 256, (20 + 37 * i,), generator=g).tolist())
    eng.step()                                   # prefills every request, samples its first token
    return eng


def _pools(eng) -> dict[str, torch.Tensor]:
    """Every pool tensor the step writes (live, not copies)."""
    st = eng.store
    out = {f"kda{i}.{n}": t for i, p in st.pool.pools.items() for n, t in p.items()}
    out.update({f"rows{i}": t for i, t in st.mla.rows.items()})
    out.update({f"kv{i}": t for i, t in st.mla.kv.items()})
    return out


def _step_at(eng, size: int, *, pad_shares_table: bool = False) -> tuple[torch.Tensor, dict]:
    """One fast step of the running requests at batch size `size`; returns its logits rows and
    the pools after it, and puts the pools back (so the next call starts from the same state)."""
    reqs = eng.scheduler.running
    step = eng.fast.step
    for req in reqs:
        step.tables.sync(req.slot, req.blocks)
    live = _pools(eng)
    saved = {k: t.clone() for k, t in live.items()}
    batch = build_meta([r.tokens[-1] for r in reqs], [r.num_computed for r in reqs], [r.slot for r in reqs],
                       step.spare_slot, size, pin=False, pad_shares_table=pad_shares_table)
    logits, _ = step.forward(batch.meta)
    after = {k: t.clone() for k, t in live.items()}
    for k, t in saved.items():
        live[k].copy_(t)
    return logits[:len(reqs)], after


def _real_parts(eng, pools: dict) -> dict[str, torch.Tensor]:
    """The pool entries that belong to requests: every slot but the spare, every block but the spare."""
    st = eng.store
    spare_slot, spare_block = st.pool.slots, st.mla.num_blocks
    return {k: (t[:spare_slot] if k.startswith("kda") else t[:spare_block]) for k, t in pools.items()}


@pytest.mark.parametrize("n", [1, 3, 5])
def test_padding_changes_no_real_bits(model, n):
    eng = _engine_mid_decode(model, n)
    exact_logits, exact_pools = _step_at(eng, n)
    for size in sorted({padded_size(n), 8}):
        logits, pools = _step_at(eng, size)
        assert torch.equal(logits, exact_logits), f"B={n} padded to {size}: logits rows differ"
        real, want = _real_parts(eng, pools), _real_parts(eng, exact_pools)
        bad = [k for k in want if not torch.equal(real[k], want[k])]
        assert not bad, f"B={n} padded to {size}: padding touched request state {bad[:4]}"


def test_padding_negative_control_a_shared_table_is_seen(model):
    """The seeded fault (padding rows on request 0's block table) must show in the same check."""
    eng = _engine_mid_decode(model, 3)
    _, exact_pools = _step_at(eng, 3)
    _, pools = _step_at(eng, 4, pad_shares_table=True)
    real, want = _real_parts(eng, pools), _real_parts(eng, exact_pools)
    assert any(not torch.equal(real[k], want[k]) for k in want if k.startswith("rows")), \
        "padding through a request's table left its rows alone: the padding check proves nothing"


def test_ladder():
    assert LADDER == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert [padded_size(n) for n in (1, 2, 3, 5, 8, 9, 200, 256, 257, 600)] == [1, 2, 4, 8, 8, 16, 256, 256, 512, 1024]
    with pytest.raises(ValueError, match="at least one row, got 0"):
        padded_size(0)


def test_options_need_their_prerequisites():
    from optimized_stack.errors import K3Error
    with pytest.raises(K3Error, match="batched_decode requires projected_kv_cache"):
        EngineOptions(continuous_batching=True, batched_decode=True)
    with pytest.raises(K3Error, match="batched_decode requires continuous_batching"):
        EngineOptions(projected_kv_cache=True, batched_decode=True)
    with pytest.raises(K3Error, match="cuda_graphs requires batched_decode"):
        EngineOptions(continuous_batching=True, projected_kv_cache=True, cuda_graphs=True)


def test_cuda_graphs_refuses_a_cpu_model(model):
    from optimized_stack.errors import K3Error
    with pytest.raises(K3Error, match="cuda_graphs needs a CUDA model, the model is on cpu"):
        Engine(model, EngineOptions(continuous_batching=True, projected_kv_cache=True, batched_decode=True,
                                    cuda_graphs=True))
