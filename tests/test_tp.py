"""Tensor parallelism on CPU gloo ranks: the TP toggles' contracts at world size 2, their
mutants caught, and the drift of TP itself against world size 1 (reported, bounded).

The W = 2 ranks start once per module (spawning a rank imports torch: seconds on 2
cores) and every check reuses them. World sizes 4 and 8 are @slow.
"""
from __future__ import annotations

import time

import pytest
import torch

from k3verify.compare.captures import compare_captures
from k3verify.compare.tensors import compare_logits
from k3verify.run.runner import Runner
from k3verify.run.sequential import run_scenario
from k3verify.scenarios import workloads
from k3verify.verdict.gate import check_toggle
from optimized_stack import load_model
from optimized_stack import toggles as registry
from optimized_stack.errors import K3Error
from optimized_stack.parallel import Comm, TPModel, TPOptions, shard_range, split_sizes

TOGGLES = ("tp_dedup_router", "moe_output_shard", "fused_allreduce_residual", "dcp_mla")
MUTANTS = ("mut_tp_dedup_gather_order", "mut_moe_shard_full_add", "mut_fused_allreduce_twice",
           "mut_dcp_merge_no_rescale")
DRIFT_REL = 1e-5        # TP vs W = 1: max |diff| / max |logit|


@pytest.fixture(scope="module")
def model():
    return load_model("k3-mini")


@pytest.fixture(scope="module")
def scenario():
    return workloads.build("single", scale=0.5)


@pytest.fixture(scope="module")
def refs2(model):
    refs = Runner(model, world_size=2)
    yield refs
    refs.close()


def _logit_rows(ref, cand):
    a, b = [], []
    for rid, r in ref.requests.items():
        c = cand.requests[rid]
        common = sorted(p for p in r.logits if p in c.logits)
        a += [r.logits[p].tensor for p in common]
        b += [c.logits[p].tensor for p in common]
    return torch.stack(a), torch.stack(b)


def _rel_drift(ref, cand) -> float:
    a, b = _logit_rows(ref, cand)
    return float((a - b).abs().max() / a.abs().max())


# ---- pieces that need no process group -----------------------------------------------
@pytest.mark.parametrize("n,w,sizes", [(8, 2, [4, 4]), (4, 8, [1, 1, 1, 1, 0, 0, 0, 0]), (7, 3, [3, 2, 2])],
                         ids=["8over2", "4over8-empty-ranks", "7over3-uneven"])
def test_split_sizes_cover_every_item_once(n, w, sizes):
    assert split_sizes(n, w) == sizes, "shards are contiguous, the first n % W ranks one larger"
    assert [shard_range(n, w, r) for r in range(w)][-1][1] == n


def test_tp_at_world_size_1_is_the_reference_bit_for_bit(model):
    """Same ops, whole shards, identity collectives: must equal K3Model.forward exactly."""
    ids = torch.arange(3, 73) % 256
    st = model.new_state()
    ref = [model.forward(ids, st), model.forward(torch.tensor([7]), st)]
    tp = TPModel(model, Comm(0, 1))
    st1 = tp.new_state()
    got = [tp.forward(ids, st1), tp.forward(torch.tensor([7]), st1)]
    assert all(torch.equal(a, b) for a, b in zip(ref, got)), "TP at W=1 changed the logits"
    for i, s in st.kda.items():
        assert torch.equal(s.recurrent, st1.kda[i].recurrent) and torch.equal(s.conv_v, st1.kda[i].conv_v), i
    assert all(torch.equal(st.mla[i], st1.mla[i]) for i in st.mla), "MLA rows differ at W=1"
    # negative control: the DCP log-sum-exp attention associates the softmax differently,
    # so the same bitwise comparison must see it
    tp_dcp = TPModel(model, Comm(0, 1), TPOptions(dcp_mla=True))
    other = tp_dcp.forward(ids, tp_dcp.new_state())
    assert not torch.equal(ref[0], other), "the W=1 comparison cannot see a reordered softmax"
    assert torch.allclose(ref[0], other, rtol=0, atol=1e-4)


def test_tp_at_world_size_1_is_the_reference_for_kimi_linear_too():
    """The other layout: plain residual stream, low-rank KDA gate, plain q_proj, no MLA
    gate, routed experts in D (their partials ride in the FFN all-reduce)."""
    from optimized_stack.presets import PRESETS, init_model
    cfg = PRESETS["k3-mini"].replace(variant="kimi_linear", attn_res_block_size=None, routed_expert_hidden_size=None,
                                     kda_full_rank_gate=False, activation="silu", q_lora_rank=None,
                                     mla_output_gate=False)
    kl = init_model(cfg, seed=3)
    ids = torch.arange(3, 40) % 256
    tp = TPModel(kl, Comm(0, 1))
    assert torch.equal(kl.logits(ids), tp.forward(ids, tp.new_state())), "TP at W=1 changed Kimi Linear logits"


def test_tp_options_refuse_unknown_names():
    with pytest.raises(K3Error, match="TP runner option 'tp_dedupe'"):
        TPOptions.from_runner({"tp_dedupe": True})
    with pytest.raises(K3Error, match="TP fault 'nope'"):
        TPOptions(faults=frozenset({"nope"}))


def test_tp_toggles_skip_at_world_size_1_with_a_reason(model, scenario):
    res = check_toggle(model, "tp_dedup_router", scenario, runner=Runner(model))
    assert {r.status for r in res} == {"skip"}
    assert "world size 2, 4, 8, not 1" in res[0].reason


def test_registry_declares_tp_world_sizes_and_mutants():
    for name in TOGGLES + MUTANTS:
        assert registry.get(name).world_sizes == (2, 4, 8), name
    assert registry.get("tp_dedup_router").contract.kind == "exact"
    assert {registry.get(n).contract.kind for n in TOGGLES[1:]} == {"approx"}
    assert {registry.get(m).mutant_of for m in MUTANTS} == set(TOGGLES)


# ---- world size 2 on gloo ranks ------------------------------------------------------
def test_tp2_runs_are_deterministic(refs2, scenario):
    """gloo's all-reduce at a fixed W sums in a fixed order: run to run, bit for bit."""
    first = refs2.reference(scenario)
    again = refs2.run(scenario, (), keep=True)
    verdicts = compare_captures(first, again, scenario.name)
    assert all(v["equal"] for v in verdicts.values()), {k: v["reason"] for k, v in verdicts.items()}


@pytest.mark.parametrize("name", TOGGLES)
def test_tp2_toggle_holds_its_contract(model, refs2, scenario, name):
    res = check_toggle(model, name, scenario, runner=refs2)
    assert res and all(r.status == "pass" for r in res), [(r.check, r.reason) for r in res]
    fired = res[0].evidence["events"]       # counted on rank 0 (optimized_stack/events.py)
    assert fired and all(fired.values()), f"{name}: its TP path did not run: {fired}"
    if name == "fused_allreduce_residual":
        # a two-term sum has one order: at W=2 the one-shot sum equals gloo's all-reduce
        assert res[0].evidence["max_ulp"] == 0, res[0].reason
    if name in ("moe_output_shard", "dcp_mla"):
        assert res[0].evidence["max_ulp"] > 0, "the approx toggle should move some bits (else declare it exact)"


@pytest.mark.parametrize("name", MUTANTS)
def test_tp2_mutant_is_caught(model, refs2, scenario, name):
    mutant = registry.get(name)
    res = check_toggle(model, name, scenario, runner=refs2)
    failed = {r.check for r in res if r.status == "fail"}
    assert failed & set(mutant.caught_by), f"{name} not caught by {mutant.caught_by}: {[(r.check, r.reason) for r in res]}"


def test_tp2_drift_against_world_size_1_is_small(model, refs2, scenario):
    """TP changes reduction order (row-parallel sums, expert partials): an approx finding,
    reported, and bounded well below anything a structural bug produces."""
    ref1 = run_scenario(model, scenario, (), keep=True)
    ref2 = refs2.reference(scenario)
    assert compare_captures(ref1, ref2, scenario.name)["tokens"]["equal"], "TP changed the greedy tokens"
    a, b = _logit_rows(ref1, ref2)
    f = compare_logits(a, b, label="TP W=2 vs W=1")
    rel = _rel_drift(ref1, ref2)
    print(f"\nTP W=2 vs W=1: max KL {f.kl_max:.3g}, max ULP {f.max_ulp}, max abs {f.max_abs:.3g}, rel {rel:.3g}")
    assert rel < DRIFT_REL, f"TP drift {rel:.3g} of max |logit| >= {DRIFT_REL:g}"
    # negative control: the same measure on a mutant's run must exceed the bound
    force = {rid: rc.tokens for rid, rc in ref2.requests.items()}
    bad = refs2.run(scenario, ("mut_fused_allreduce_twice",), keep=True, force=force)
    assert _rel_drift(ref2, bad) > DRIFT_REL


def test_cli_diff_at_world_size_2_judges_toggle_and_mutant(tmp_path):
    """`k3verify diff --world-size 2`: the exact toggle passes, its mutant (judged in the
    same run, as the negative control) fails, so the run exits 1."""
    import json

    from k3verify.cli import main
    rc = main(["diff", "--toggle", "tp_dedup_router", "--toggle", "mut_tp_dedup_gather_order",
               "--world-size", "2", "--scenario", "single", "--scale", "0.25", "--model", "k3-mini",
               "--report-dir", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    status = {(r["toggle"], r["check"]): r["status"] for r in report["results"]}
    assert rc == 1
    assert all(v == "pass" for (t, _), v in status.items() if t == "tp_dedup_router"), status
    assert status[("mut_tp_dedup_gather_order", "logits")] == "fail", status
    assert report["environment"]["seeds"]["world_size"] == 2


def test_cli_diff_rejects_bad_world_size(capsys):
    from k3verify.cli import main
    assert main(["diff", "--toggle", "tp_dedup_router", "--world-size", "0"]) == 2
    assert "--world-size must be an integer >= 1, got 0" in capsys.readouterr().err


# ---- larger world sizes: slow, measured once ------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [4, 8], ids=["W4", "W8"])
def test_tp_verdicts_at_larger_world_sizes(model, scenario, world_size):
    """W = 8 on k3-mini: 4 KDA / MLA heads, so ranks 4-7 own no attention head (they
    still hold experts, vocab and FFN width and join every collective)."""
    t0 = time.perf_counter()
    refs = Runner(model, world_size=world_size)
    try:
        for name in TOGGLES:
            res = check_toggle(model, name, scenario, runner=refs)
            assert all(r.status == "pass" for r in res), (name, [(r.check, r.reason) for r in res])
        for name in MUTANTS:
            res = check_toggle(model, name, scenario, runner=refs)
            assert {r.check for r in res if r.status == "fail"} & set(registry.get(name).caught_by), name
        ref1 = run_scenario(model, scenario, (), keep=True)
        rel = _rel_drift(ref1, refs.reference(scenario))
        assert rel < DRIFT_REL, rel
    finally:
        refs.close()
    print(f"\nW={world_size}: verdicts in {time.perf_counter() - t0:.0f} s, drift rel {rel:.3g}")
