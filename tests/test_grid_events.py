"""Path events on the 64-token KDA grid (the GPU profile; here its CPU twin `cpu_grid_kda`).

On the grid the store reuses state only up to the computing request's aligned prompt length, so
a hit over generated tokens and a checkpoint with an MLA tail cannot happen there
(optimized_stack/events.py OFF_GRID_IMPOSSIBLE; the H200 run of 2026-12-01 reported every prefix
toggle "bit-identical" with none of these paths run). A verdict on the grid neither waits for
those events nor passes without the others; a toggle all of whose events are impossible there is
still run (switched on it must change no bit) and reads `not exercised ... inert`, never a pass;
a mutant like it is a skip (it cannot be caught where its path cannot run). The negative
controls are the same checks off the grid.

The two sub-block toggles run on the grid with 128-token blocks (toggle_defs.SUB_ON_GRID), where
their hits inside a block happen; `with_64_token_blocks` runs them with their own 64-token blocks
there, the form in which they are inert (the GPU report of 2026-12-02 showed them so).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

from optimized_stack import toggles as registry
from k3verify.scenarios import workloads
from k3verify.suites.verdicts import set_events
from k3verify.verdict.gate import check_toggle
from optimized_stack.events import OFF_GRID_IMPOSSIBLE, impossible
from optimized_stack.kernels.kda.grid import cpu_grid_kda
from optimized_stack.model import ops
from model_fixtures import model  # noqa: F401  (the module-scoped k3-mini fixture)

SUB_BLOCK_TOGGLES = ("prefix_cache_subblock", "ckpt_with_mla_tail", "mut_inside_hit_tail_short",
                     "mut_tail_one_short", "mut_end_ckpt_counts_unfed")


@contextlib.contextmanager
def with_64_token_blocks():
    """The sub-block toggles (and their mutants) registered without engine_on_grid: on the grid
    they run with 64-token blocks, where every reusable checkpoint is a block boundary."""
    saved = {n: registry.get(n) for n in SUB_BLOCK_TOGGLES}
    try:
        for n, t in saved.items():
            registry._REGISTRY[n] = replace(t, engine_on_grid={})
        yield
    finally:
        registry._REGISTRY.update(saved)


def test_impossible_events_exist_only_on_a_grid():
    declared = ("checkpoint_saved", "prefix_hit_on_generated")
    assert impossible(declared, 64) == {"prefix_hit_on_generated": OFF_GRID_IMPOSSIBLE["prefix_hit_on_generated"]}
    assert impossible(declared, None) == {}                        # negative control: off the grid


def test_sub_block_events_are_impossible_on_the_grid_only_where_blocks_are_the_grid():
    declared = ("prefix_hit_inside_block", "prefix_hit_tail_ckpt", "prefix_hit_on_generated")
    sub = {"prefix_cache": True, "prefix_cache_subblock": True}
    # 64-token blocks (the default): checkpoints reusable on the grid are all block boundaries
    assert set(impossible(declared, 64, engine=sub)) == set(declared)
    assert set(impossible(declared, 64)) == set(declared)
    # 128-token blocks with a checkpoint every 64: the one at 64 is inside a block
    wide = {**sub, "block_size": 128, "checkpoint_interval": 64}
    assert set(impossible(declared, 64, engine=wide)) == {"prefix_hit_on_generated"}
    # wide blocks without sub-block checkpoints: only block boundaries again
    assert set(impossible(declared, 64, engine={**wide, "prefix_cache_subblock": False})) == set(declared)
    assert registry.engine_options(["ckpt_with_mla_tail"], 64)["block_size"] == 128
    assert "block_size" not in registry.engine_options(["ckpt_with_mla_tail"], None)   # off the grid: its own


def test_a_toggle_whose_every_event_is_impossible_on_the_grid_is_run_and_reads_not_exercised(model):
    sc = workloads.build("single", scale=0.5)
    with ops.override(kda_prefill=cpu_grid_kda), with_64_token_blocks():
        on_grid = check_toggle(model, "ckpt_with_mla_tail", sc, localize_failures=False)
    # it ran (switched on, every check compared) and is never a pass: its own code cannot run there
    assert on_grid and {r.status for r in on_grid} == {"not_exercised"}, [r.status for r in on_grid]
    assert "can fire on the 64-token KDA grid" in on_grid[0].reason and on_grid[0].reason.endswith(
        "it is inert here")
    assert on_grid[0].reason.startswith("bit-identical")
    # off the grid the same toggle on the same scenario runs, and with none of its events is not exercised
    off_grid = check_toggle(model, "ckpt_with_mla_tail", sc, localize_failures=False)
    assert {r.status for r in off_grid} == {"not_exercised"}, [(r.status, r.reason) for r in off_grid]
    assert "prefix_hit_tail_ckpt" in off_grid[0].reason and "inert" not in off_grid[0].reason


def test_a_mutant_whose_path_cannot_run_on_the_grid_is_a_skip_there(model):
    sc = workloads.build("single", scale=0.5)
    with ops.override(kda_prefill=cpu_grid_kda):
        # a hit over generated tokens: impossible on the grid whatever the blocks
        unfed = check_toggle(model, "mut_end_ckpt_counts_unfed", sc, localize_failures=False)
        with with_64_token_blocks():
            narrow = check_toggle(model, "mut_tail_one_short", sc, localize_failures=False)
    for got in (unfed, narrow):
        assert {r.status for r in got} == {"skip"} and "not applicable on the 64-token KDA grid" in got[0].reason


def test_on_the_grid_a_verdict_names_only_the_events_that_could_fire(model):
    sc = workloads.build("single", scale=0.5)
    with ops.override(kda_prefill=cpu_grid_kda):
        (r, *_) = check_toggle(model, "prefix_cache", sc, localize_failures=False)
    assert r.status == "not_exercised" and "prefix_hit_block" in r.evidence["events_missing"]
    assert "prefix_hit_on_generated" not in r.evidence["events_missing"]
    assert "prefix_hit_on_generated" in r.evidence["events_impossible"]
    (off, *_) = check_toggle(model, "prefix_cache", sc, localize_failures=False)
    assert "prefix_hit_on_generated" in off.evidence["events_missing"]          # negative control


def test_the_sub_block_toggle_with_64_token_blocks_is_inert_on_the_grid_and_runs_off_it(model):
    sc = workloads.build("single", scale=0.5)
    with ops.override(kda_prefill=cpu_grid_kda), with_64_token_blocks():
        on_grid = check_toggle(model, "prefix_cache_subblock", sc, localize_failures=False)
    assert {r.status for r in on_grid} == {"not_exercised"} and "KDA grid" in on_grid[0].reason
    off_grid = check_toggle(model, "prefix_cache_subblock", sc, localize_failures=False)
    assert {r.status for r in off_grid} == {"not_exercised"}


def test_a_set_verdict_does_not_wait_for_an_impossible_event():
    from optimized_stack import toggles as registry
    t = registry.get("prefix_cache")
    fired = {"checkpoint_saved": 3, "prefix_hit_block": 2, "prefix_hit_on_generated": 0}
    row = {"scenario": "multi_turn", "evidence": {"events": fired}}
    assert set_events(t, [row])["missing"] == ["prefix_hit_on_generated"]
    on_grid = {**row, "evidence": {"events": fired, "events_impossible": {"prefix_hit_on_generated": "why"}}}
    got = set_events(t, [on_grid])
    assert got["missing"] == [] and got["impossible_on_grid"] == ["prefix_hit_on_generated"]


def test_an_inert_toggle_is_judged_bitwise_on_the_grid_but_never_called_a_pass(model):
    """The GPU report's row for a toggle whose own path cannot run on the grid: switched on, the
    run is compared bit for bit (a fault in it still fails), and the status says inert."""
    from k3verify.perf import gpu_verdicts
    from k3verify.run.runner import Runner
    sc = workloads.build("shared_prefix_forks", scale=0.5)
    with ops.override(kda_prefill=cpu_grid_kda):
        refs = Runner(model)
        with with_64_token_blocks():
            results = check_toggle(model, "prefix_cache_subblock", sc, runner=refs, localize_failures=False)
        row = gpu_verdicts.verdict("prefix_cache_subblock", results)
        # negative control: the same judging of a run that changes the bits fails
        bad = gpu_verdicts.verdict("mut_restore_skips_conv",
                                   check_toggle(model, "mut_restore_skips_conv", sc, runner=refs,
                                                localize_failures=False))
    assert row["status"] == "inert-on-cuda", row
    assert "switched on, bit-identical on 1 grid scenarios (4 checks" in row["reason"]
    assert "prefix_hit_block=" in row["reason"]
    assert bad["status"] == "fail", bad


def test_with_the_blocks_they_run_with_on_the_grid_the_sub_block_toggles_pass_with_their_events(model):
    """What the seventh GPU release run listed as `not exercised`: on the grid, with 128-token
    blocks, each toggle's own hit fires, every check is bit-identical, and the mutant of each path
    is caught there. prefix_hit_on_generated stays impossible (named, not waited for)."""
    sc = workloads.build("shared_prefix_forks", scale=0.5)
    from k3verify.run.runner import Runner
    with ops.override(kda_prefill=cpu_grid_kda):
        refs = Runner(model)
        got = {t: check_toggle(model, t, sc, runner=refs, localize_failures=False)
               for t in ("prefix_cache_subblock", "ckpt_with_mla_tail", "mut_inside_hit_tail_short",
                         "mut_tail_one_short")}
    for toggle, event in (("prefix_cache_subblock", "prefix_hit_inside_block"),
                          ("ckpt_with_mla_tail", "prefix_hit_tail_ckpt")):
        rs = got[toggle]
        assert {r.status for r in rs} == {"pass"}, [(r.status, r.reason) for r in rs]
        assert rs[0].evidence["events"][event] > 0
        assert set(rs[0].evidence["events_impossible"]) == {"prefix_hit_on_generated"}
    for mutant, check in (("mut_inside_hit_tail_short", "mla_rows"), ("mut_tail_one_short", "logits")):
        by_check = {r.check: r.status for r in got[mutant]}
        assert by_check[check] == "fail", (mutant, by_check)
