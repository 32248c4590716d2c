"""Exact verdicts at the dims that run (issue 26 item 2).

The batched KDA decode runs its value axis in 64-wide tiles, as fla's kernel does on the GPU. At
k3-mini's value head of 16 there is one tile, so code for the tiles after the first never runs
there: mut_fast_kda_stale_value_tiles (the tiles after the first are not written back) is inert
at k3-mini's dims and wrong at K3's. k3-dims is a CPU-sized preset with K3's KDA and MLA head
dims (KDA 128, MLA q_lora 192 / kv_lora 512 / nope 128 / rope 64 / v 128) that runs it.
"""
from __future__ import annotations

import pytest
import torch

from k3verify.kinds.selftest import scenario_for
from k3verify.scenarios.workloads import build
from k3verify.verdict.gate import check_toggle
from optimized_stack import load_model
from optimized_stack import toggles as registry
from optimized_stack.engine.fast.kda_step import V_TILE, recurrent_step
from optimized_stack.model.kda import kda_recurrent
from optimized_stack.presets import PRESETS
from model_fixtures import model  # noqa: F401  (the module-scoped k3-mini fixture)

MUTANT = "mut_fast_kda_stale_value_tiles"


@pytest.fixture(scope="module")
def dims_model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_model("k3-dims")
    finally:
        torch.set_num_threads(threads)


def test_k3_dims_has_k3s_head_dims_and_k3_mini_does_not():
    d, m = PRESETS["k3-dims"], PRESETS["k3-mini"]
    assert (d.kda_head_dim, d.q_lora_rank, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim) == \
        (128, 192, 512, 128, 64, 128)
    assert d.kda_head_dim > V_TILE >= m.kda_head_dim        # more than one value tile only in k3-dims


@pytest.mark.parametrize("v_dim", [16, 64, 128, 192], ids=lambda v: f"V{v}")
def test_value_tiles_give_the_reference_recurrence_bit_for_bit(v_dim):
    g = torch.Generator().manual_seed(v_dim)
    b, h, k = 3, 2, 128
    q, k_ = torch.randn(b, h, k, generator=g), torch.nn.functional.normalize(torch.randn(b, h, k, generator=g), dim=-1)
    v, gate = torch.randn(b, h, v_dim, generator=g), -torch.rand(b, h, k, generator=g)
    beta, state = torch.rand(b, h, generator=g), torch.randn(b, h, k, v_dim, generator=g)
    o, new = recurrent_step(q, k_, v, gate, beta, state)
    for i in range(b):                  # the reference, one request at a time, untiled
        o_ref, s_ref = kda_recurrent(q[i:i + 1], k_[i:i + 1], v[i:i + 1], gate[i:i + 1], beta[i:i + 1], state[i])
        assert torch.equal(o[i], o_ref[0]) and torch.equal(new[i], s_ref), f"request {i} differs at V={v_dim}"


def test_the_real_dims_mutant_does_not_apply_at_k3_minis_dims(model):
    sc = build(scenario_for(registry.get(MUTANT), 1.0), scale=1.0)
    results = check_toggle(model, MUTANT, sc)
    assert results and {r.status for r in results} == {"skip"}, [r.status for r in results]
    assert "at this model's dims: kda_head_dim 16 <= 64" in results[0].reason, results[0].reason


def test_at_k3s_dims_the_batched_step_is_exact_and_the_mutant_is_caught_where_it_lives(dims_model):
    sc = build("multi_length", scale=0.5)
    real = check_toggle(dims_model, "batched_decode", sc)
    assert {r.status for r in real} == {"pass"}, [(r.check, r.status, r.reason) for r in real]
    # negative control: the same scenario and model with the fault, its event fired
    bad = check_toggle(dims_model, MUTANT, sc)
    failed = {r.check for r in bad if r.status == "fail"}
    assert failed & {"kda_state", "logits"}, [(r.check, r.status, r.reason) for r in bad]
    assert bad[0].evidence["events"]["fast_kda_value_tiles"] > 0
    loc = next(r.localization for r in bad if r.localization)
    assert loc["component"] == "kda/recurrent", loc
