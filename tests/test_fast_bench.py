"""The engine benchmark (k3verify/perf/fast_bench.py) runs end to end on the CPU in its
smoke mode and writes issue 20's summary fields; its roofline bytes are the verifier's; its
transformers peer has the preset's dims (read back through our own config loader); the contract
check it counts rows by can fail."""
from __future__ import annotations

import json

import pytest
import torch

from k3verify.perf import fast_bench as bench
from k3verify.perf.fast_bench_setup import Donor, decode_step_bytes, seeded_engine
from optimized_stack.engine import EngineOptions
from model_fixtures import model  # noqa: F401  (the module-scoped k3-mini fixture)

SUMMARY_FIELDS = {"decode_tok_s", "transformers_bf16_decode_tok_s", "transformers_fp32_decode_tok_s",
                  "roofline_fraction", "prefill_tok_s", "transformers_bf16_prefill_tok_s", "agentic",
                  "release_suite_s"}


def test_smoke_runs_end_to_end(tmp_path, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert bench.main(["--out", str(tmp_path), "--smoke", "--budget-s", "300"]) == 0
    finally:
        torch.set_num_threads(threads)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert SUMMARY_FIELDS <= set(summary), f"missing {SUMMARY_FIELDS - set(summary)}"
    assert set(summary["decode_tok_s"]) == {"1", "2"} and all(v > 0 for v in summary["decode_tok_s"].values())
    assert summary["contracts"] == {"reference": True, "continuous_batching": True, "batched_decode": True,
                                    "cuda_graphs": False, "fused_kda_conv": False, "fused_moe_combine": False,
                                    "fused_situ": False, "mla_absorbed": False, "moe_grouped_static": False}
    doc = json.loads((tmp_path / "engine_bench.json").read_text())
    bd = next(c for c in doc["contracts"] if c["row"] == "batched_decode")
    assert bd["held"] and bd["rows_compared"] > 0 and bd["fast"]["steps"] > 0
    assert summary["agentic"][0]["prefix_reuse"] > 0, "the agentic smoke never hit the prefix cache"
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary, "the last line is the summary"


def test_the_row_check_fails_on_a_fault(model):
    """The judge that counts a row: the seeded conv fault against the row above is not exact."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (20, 45, 70)]
    above = bench.check_run(model, ("continuous_batching",), prompts, 3)
    good = bench.check_run(model, ("continuous_batching", "projected_kv_cache", "batched_decode"), prompts, 3)
    bad = bench.check_run(model, ("mut_fast_conv_wrong_row",), prompts, 3)
    assert bench.judge("batched_decode", above, good)["held"]
    verdict = bench.judge("batched_decode", above, bad)
    assert not verdict["held"] and verdict["rows_differing"] > 0


def test_roofline_bytes_are_the_verifiers(model):
    gpu_bench = pytest.importorskip("k3verify.perf.gpu_bench")
    for b, ctx in ((1, 100), (64, 512), (256, 8192)):
        assert decode_step_bytes(model, b, ctx) == gpu_bench.decode_step_bytes(model, b, ctx)


def test_seeded_requests_decode_from_the_donor_state(model):
    """A seeded engine's first decode step gives the row a real request gets after the same
    prefill (the donor's state copied into the slot and blocks, projected K/V included)."""
    donor = Donor.prefill(model, 40, seed=3)
    opts = EngineOptions(continuous_batching=True, projected_kv_cache=True, batched_decode=True,
                         max_num_seqs=2, kda_pool_slots=2, token_budget=100)
    eng = seeded_engine(model, opts, donor, 2, 4)
    eng.step()
    st = donor.state.clone()
    want = model.forward(torch.tensor([donor.first_token]), st)[0]
    got = [r.tokens[-1] for r in eng.scheduler.running]
    assert got == [int(want.argmax())] * 2 and eng.fast.stats.steps == 1


def test_the_transformers_peer_has_the_presets_dims(tmp_path):
    pytest.importorskip("transformers")
    from optimized_stack.config import K3Config
    from k3verify.perf.transformers_kimi import kimi_linear_config
    from optimized_stack.presets import preset_config
    cfg = preset_config("k3-small")
    kimi_linear_config(cfg).save_pretrained(tmp_path)
    back = K3Config.from_file(tmp_path)
    same = ("vocab_size", "hidden_size", "num_layers", "layer_kinds", "kda_num_heads", "kda_head_dim", "num_heads",
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts",
            "num_experts_per_token", "num_shared_experts", "moe_intermediate_size", "intermediate_size",
            "first_k_dense_replace", "kda_conv_size")
    assert {f: getattr(back, f) for f in same} == {f: getattr(cfg, f) for f in same}
    assert back.variant == "kimi_linear"


def test_a_budget_that_cannot_seed_every_request_is_refused(model):
    """Otherwise the timed steps prefill the requests left waiting (capture_bench's 259 ms 'decode'
    step at B = 64, 2026-12-07); the budget of batch x context seeds them all (the control)."""
    donor = Donor.prefill(model, 40, seed=3)
    opts = EngineOptions(continuous_batching=True, projected_kv_cache=True, batched_decode=True,
                         max_num_seqs=4, kda_pool_slots=4, token_budget=100)
    with pytest.raises(ValueError, match="placed 3 of 4 requests"):
        seeded_engine(model, opts, donor, 4, 4)
    opts = EngineOptions(continuous_batching=True, projected_kv_cache=True, batched_decode=True,
                         max_num_seqs=4, kda_pool_slots=4, token_budget=4 * 41)
    eng = seeded_engine(model, opts, donor, 4, 4)
    eng.step()
    assert eng.fast.stats.steps == 1 and eng.fast.stats.rows == 4, "every request decoded in the one fast step"
