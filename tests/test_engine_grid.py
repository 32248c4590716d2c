"""The engine's KDA grid rules (kernels/kda/grid.py): under a KDA that is exact only across
64-aligned splits (the GPU profile; here its CPU twin `cpu_grid_kda`), every exact engine
toggle stays bit-identical to the reference because the engine cuts its calls on the grid
and reuses only state computed on the chunked path. The negative controls turn the rules off
(kda_grid=0) under the same KDA and show the same toggles then differ."""
from __future__ import annotations

import pytest
import torch

from optimized_stack.engine import EngineOptions
from optimized_stack.kernels.kda.chunked import kda_chunked
from optimized_stack.kernels.kda.grid import GRID, cpu_grid_kda, grid_end, grid_in_force, grid_pieces
from optimized_stack.model import ops
from optimized_stack.model.kda import kda_recurrent
from model_fixtures import model  # noqa: F401  (the module-scoped k3-mini fixture)
from optimized_stack.engine.toggle_defs import SUB_ON_GRID
from test_engine_toggles import SCENARIOS, compare, drive, drive_engine, run_toggles, summary


@pytest.mark.parametrize("start, end, prompt, want", [
    (0, 200, 150, 150),        # below A=128: the call may run into the tail, up to the prompt's end
    (0, 100, 150, 64),         # a budget of 100 stops on the grid
    (0, 60, 150, 0),           # less than one grid step: no valid stop (the scheduler overruns)
    (64, 140, 150, 140),       # from the grid into the tail
    (128, 200, 150, 191),      # at A and beyond: shorter than the grid
    (0, 300, 128, 128),        # an aligned prompt: stop at it; generated tokens are recurrent
    (128, 300, 128, 191),
], ids=lambda v: str(v))
def test_grid_end_table(start, end, prompt, want):
    assert grid_end(start, end, prompt) == want


def test_grid_pieces_cover_a_recompute_and_refuse_an_off_grid_start():
    assert grid_pieces(0, 200, 150) == [(0, 150), (150, 200)]
    assert grid_pieces(0, 300, 64) == [(0, 64), (64, 127), (127, 190), (190, 253), (253, 300)]
    with pytest.raises(ValueError, match="must start on the 64-token grid, got 70"):
        grid_pieces(70, 100, 150)


def _kda_inputs(t_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, kd = 2, 8
    q = torch.nn.functional.normalize(torch.randn(t_len, h, kd, generator=g), dim=-1) * kd ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t_len, h, kd, generator=g), dim=-1)
    v = torch.randn(t_len, h, kd, generator=g)
    gate = -0.1 * torch.sigmoid(torch.randn(t_len, h, kd, generator=g))   # mild decay: the state remembers
    beta = torch.sigmoid(torch.randn(t_len, h, generator=g))
    return q, k, v, gate, beta


def test_the_cpu_grid_kda_is_exact_across_grid_splits_and_not_across_others():
    """The property the engine relies on, and its negative control."""
    q, k, v, g, beta = _kda_inputs(150)
    whole_o, whole_s = cpu_grid_kda(q, k, v, g, beta)
    o1, s1 = cpu_grid_kda(q[:64], k[:64], v[:64], g[:64], beta[:64])
    o2, s2 = cpu_grid_kda(q[64:], k[64:], v[64:], g[64:], beta[64:], s1)
    assert torch.equal(torch.cat([o1, o2]), whole_o) and torch.equal(s2, whole_s)
    o1, s1 = cpu_grid_kda(q[:100], k[:100], v[:100], g[:100], beta[:100])
    o2, s2 = cpu_grid_kda(q[100:], k[100:], v[100:], g[100:], beta[100:], s1)
    assert not torch.equal(torch.cat([o1, o2]), whole_o) and not torch.equal(s2, whole_s), \
        "an off-grid split gave the same bits: the grid tests prove nothing"
    # and the tail is the recurrence itself
    ref_o, ref_s = kda_chunked(q[:128], k[:128], v[:128], g[:128], beta[:128])
    tail_o, tail_s = kda_recurrent(q[128:], k[128:], v[128:], g[128:], beta[128:], ref_s)
    assert torch.equal(whole_s, tail_s) and torch.equal(whole_o, torch.cat([ref_o, tail_o]))


def test_the_grid_in_force_follows_the_op_table():
    assert grid_in_force("cpu") is None
    with ops.override(kda_prefill=cpu_grid_kda):
        assert grid_in_force("cpu") == GRID and grid_in_force("cpu", 0) is None
    assert grid_in_force("cuda") == GRID, "the GPU profile computes KDA on the grid"


class GridOracle:
    """Reference states after a prompt prefix under the grid KDA: a whole forward from scratch
    (prefill(n) = chunk(n - n % 64) + recurrence, which is what the reference holds at n <= P)."""

    def __init__(self, model):
        self.model = model

    def state(self, seq: list[int], n: int):
        st = self.model.new_state()
        self.model.forward(torch.tensor(seq[:n]), st)
        return st


CASES = {
    "chunked_prefill-forks": (["chunked_prefill"], "forks", {}),
    "continuous_batching-staggered": (["continuous_batching"], "staggered", {}),
    "prefix_cache-forks": (["prefix_cache"], "forks", {}),
    "prefix_cache_subblock-multiturn": (["prefix_cache_subblock"], "multiturn", {}),
    "ckpt_with_mla_tail-forks": (["ckpt_with_mla_tail"], "forks", {}),
    # the options the sub-block toggles run with on the grid (toggle_defs.SUB_ON_GRID: 128-token
    # blocks, a checkpoint every 64 tokens), under which their own hits happen there
    "prefix_cache_subblock-forks-grid_blocks": (["prefix_cache_subblock"], "forks", SUB_ON_GRID),
    "ckpt_with_mla_tail-multiturn-grid_blocks": (["ckpt_with_mla_tail"], "multiturn", SUB_ON_GRID),
    "host_kv_tier-multiturn_tiny": (["host_kv_tier"], "multiturn_tiny", {}),
    "preemption_recompute-pressure": (["preemption"], "pressure", {}),
    "all-forks": (["continuous_batching", "chunked_prefill", "ckpt_with_mla_tail", "projected_kv_cache",
                   "host_kv_tier", "preemption"], "forks", {}),
}


@pytest.fixture(scope="module")
def grid_reference(model):
    refs = {}

    def get(name):
        if name not in refs:
            with ops.override(kda_prefill=cpu_grid_kda):
                refs[name] = drive(model, SCENARIOS[name], EngineOptions())
        return refs[name]
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_exact_toggles_stay_exact_on_the_grid(model, grid_reference, case):
    names, scenario, extra = CASES[case]
    with ops.override(kda_prefill=cpu_grid_kda):
        cand = run_toggles(model, names, SCENARIOS[scenario], extra)
        bad = compare(grid_reference(scenario), cand, GridOracle(model))
    assert not any(bad.values()), f"{case} on the KDA grid: {summary(bad)}"
    assert cand.cap.kda_points and cand.cap.logits


@pytest.mark.parametrize("case", ["chunked_prefill-forks", "ckpt_with_mla_tail-forks", "preemption_recompute-pressure"])
def test_without_the_grid_rules_the_same_toggles_differ(model, grid_reference, case):
    """Negative control: the rules are what keeps them exact under a grid KDA."""
    names, scenario, extra = CASES[case]
    with ops.override(kda_prefill=cpu_grid_kda):
        cand = run_toggles(model, names, SCENARIOS[scenario], {**extra, "kda_grid": 0})
        bad = compare(grid_reference(scenario), cand, GridOracle(model))
    assert bad["logits"] or bad["kda_state"], f"{case} without the grid rules still matched: the test proves nothing"


def test_on_the_grid_prefix_hits_stop_at_the_last_aligned_checkpoint(model, grid_reference):
    """A fork inside a block hits at the block boundary before it and recomputes the rest."""
    with ops.override(kda_prefill=cpu_grid_kda):
        cand = run_toggles(model, ["ckpt_with_mla_tail"], SCENARIOS["forks"])
    off_grid = run_toggles(model, ["ckpt_with_mla_tail"], SCENARIOS["forks"])
    assert 0 < cand.metrics.prefix_hit_tokens < off_grid.metrics.prefix_hit_tokens
    assert cand.metrics.prefix_hit_tokens % GRID == 0


SUB_BLOCK = {"prefix_cache_subblock": "prefix_hit_inside_block", "ckpt_with_mla_tail": "prefix_hit_tail_ckpt"}


# subblock alone hits inside a block only where a full block past the hit is cached, as in a fork
# of a longer request (in multiturn the partial block past turn one's aligned end is never
# registered); the tail travels with its checkpoint, so it hits in either
@pytest.mark.parametrize("toggle, scenario", [("prefix_cache_subblock", "forks"), ("ckpt_with_mla_tail", "forks"),
                                              ("ckpt_with_mla_tail", "multiturn")])
def test_with_128_token_blocks_the_sub_block_hits_happen_on_the_grid_and_stay_exact(model, grid_reference,
                                                                                    toggle, scenario):
    """The GPU report listed prefix_cache_subblock and ckpt_with_mla_tail as inert: with 64-token
    blocks every checkpoint reusable on the grid is a block boundary. With the options they run
    with on the grid (Applied.engine_at), the checkpoint at 64 lies inside a 128-token block:
    their own hits happen, and every logits row and KDA state point still matches the grid
    reference. The control is the same run with the toggle's own 64-token blocks: no such hit."""
    from optimized_stack import toggles
    with ops.override(kda_prefill=cpu_grid_kda), toggles.applied([toggle]) as applied:
        opts = applied.engine_at(grid_in_force("cpu"))
        assert opts["block_size"] == 128 and opts["checkpoint_interval"] == GRID
        cand, engine = drive_engine(model, SCENARIOS[scenario], EngineOptions.from_dict(opts))
        bad = compare(grid_reference(scenario), cand, GridOracle(model))
        _, control = drive_engine(model, SCENARIOS[scenario], EngineOptions.from_dict(applied.engine))
    assert engine.events[SUB_BLOCK[toggle]] > 0, dict(engine.events)
    assert not any(bad.values()), f"{toggle} with 128-token blocks on the grid: {summary(bad)}"
    assert cand.cap.kda_points and cand.cap.logits
    assert control.events[SUB_BLOCK[toggle]] == 0 and control.events["prefix_hit_block"] > 0, \
        "negative control: with 64-token blocks the sub-block hit cannot happen on the grid"


def test_a_checkpoint_fault_runs_on_the_grid_and_is_caught(model, grid_reference):
    """mut_ckpt_one_late asked the engine for a cut one past a checkpoint point, which the grid
    forbids: on the H200 (2026-12-01) the engine raised instead of running. The off-grid cut is
    now dropped, and the fault still fires where a call ends one past an aligned point (a prompt
    of 64k + 1 tokens), so it is caught."""
    with ops.override(kda_prefill=cpu_grid_kda):
        cand = run_toggles(model, ["mut_ckpt_one_late"], SCENARIOS["forks"])
        bad = compare(grid_reference("forks"), cand, GridOracle(model))
    assert bad["kda_state"] and bad["logits"], "the fault did not fire on the grid"


def test_an_off_grid_chunk_cut_happens_on_the_grid_only_with_a_long_tail(model):
    """On the H200, chunked_prefill's off-grid path (and its mutant) never ran on long_prompt: under
    the grid a 96-token budget cuts inside the prompt only on the grid unless the unaligned tail is
    longer than 32 tokens. long_prompt_tail has such a tail; the CPU grid twin shows both sides, and
    mut_chunk_resets_conv caught there."""
    from k3verify.run.runner import Runner
    from k3verify.run.sequential import run_scenario
    from k3verify.scenarios.workloads import build
    from k3verify.verdict.gate import check_toggle

    with ops.override(kda_prefill=cpu_grid_kda):
        short = run_scenario(model, build("long_prompt", scale=1.0), ("chunked_prefill",)).events
        tail = run_scenario(model, build("long_prompt_tail", scale=0.25), ("chunked_prefill",)).events
    assert short.get("chunk_cut_on_grid", 0) > 0 and not short.get("chunk_cut_off_grid"), short
    assert tail.get("chunk_cut_off_grid", 0) > 0, tail
    with ops.override(kda_prefill=cpu_grid_kda):
        results = check_toggle(model, "mut_chunk_resets_conv", build("long_prompt_tail", scale=0.25),
                               runner=Runner(model), localize_failures=False)
    assert {r.check for r in results if r.status == "fail"} & {"kda_state", "logits"}
    assert results[0].evidence["events"]["chunk_cut_off_grid"] > 0
