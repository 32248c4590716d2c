"""The arithmetic behind the GPU speed tables (k3verify/perf/gpu_bench.py, gpu_suite.py, gpu_render.py): the
bytes a decode step must move, the roofline fraction, the bench plan parser and the report
rendering. The GPU timings themselves are the device run's (golden/reports/gpu-*)."""
from __future__ import annotations

import json

import pytest

from k3verify.perf import bench, gpu_bench, gpu_suite
from k3verify.scenarios import workloads
from optimized_stack import load_model


@pytest.fixture(scope="module")
def model():
    return load_model()


def test_decode_step_bytes_counts_every_weight_once_at_large_batch(model):
    all_weights = sum(p.numel() * p.element_size() for p in model.parameters())
    big = gpu_bench.decode_step_bytes(model, 4096, 100)
    assert big["weights"] == pytest.approx(all_weights, rel=1e-9)
    one = gpu_bench.decode_step_bytes(model, 1, 100)
    # negative control: one request touches only k of E experts, so fewer weight bytes
    assert one["weights"] < big["weights"]
    assert big["states"] == 4096 * one["states"] and big["cache"] == 4096 * one["cache"]
    assert gpu_bench.decode_step_bytes(model, 1, 200)["cache"] == 2 * one["cache"]


def test_decode_roofline_is_bytes_over_time_over_bandwidth(model):
    sc = workloads.build("single", scale=0.25)
    r = bench.decode_roofline(model, sc, seconds=2.0, hbm_bytes_per_s=1e9)
    assert r["achieved_bytes_per_s"] == pytest.approx(r["decode_bytes"] / 2.0)
    assert r["roofline_fraction"] == pytest.approx(r["decode_bytes"] / 2.0 / 1e9)
    slower = bench.decode_roofline(model, sc, seconds=4.0, hbm_bytes_per_s=1e9)
    assert slower["roofline_fraction"] == pytest.approx(r["roofline_fraction"] / 2)


def test_bench_plan_parses_and_refuses():
    assert gpu_suite._bench_plan("prefill:4096:3:ref,decode:64:2") == [
        ("prefill", 4096, 3, True), ("decode", 64, 2, True)]
    assert gpu_suite._bench_plan("prefill:32768:2") == [("prefill", 32768, 2, False)]
    with pytest.raises(ValueError, match="expected prefill"):
        gpu_suite._bench_plan("train:1:1")


def test_render_says_not_counted_and_why():
    doc = {"environment": {}, "log": [], "sections": {"bench": [
        {"workload": "prefill 32768", "toggles": ["kda_fla_chunk"], "tokens_per_s_reference": None,
         "tokens_per_s_candidate": 4e4, "ratio": None, "counted": False, "why": "no reference timing"},
        {"workload": "decode B=8 ctx=512", "toggles": ["kda_fla_recurrent"], "tokens_per_s_reference": 30.0,
         "tokens_per_s_candidate": 60.0, "ratio": 2.0, "ci95": [1.5, 2.5], "counted": True, "why": "",
         "roofline_fraction_reference": 0.001, "roofline_fraction_candidate": 0.002}]}}
    md = gpu_suite.render(doc)
    assert "no: no reference timing" in md
    assert "2.00x [1.50, 2.50]" in md and "0.10% / 0.20%" in md


def test_gpu_suite_refuses_bad_input_in_one_line(capsys, tmp_path):
    assert gpu_suite.main(["--out", str(tmp_path), "--sections", "verdicts,nope"]) == 2
    assert "unknown section 'nope'" in capsys.readouterr().err
    assert gpu_suite.main(["--out", str(tmp_path), "--bench-items", "decode:x"]) == 2


def test_bench_toggle_reports_roofline_only_for_decode_with_a_bandwidth(model):
    r = bench.bench_toggle(model, "mla_absorbed", workload_name="decode", scale=0.25, repeats=2,
                           hbm_bytes_per_s=1e10)
    assert r["counted"] and 0 < r["roofline_candidate"]["roofline_fraction"] < 1
    plain = bench.bench_toggle(model, "mla_absorbed", workload_name="decode", scale=0.25, repeats=2)
    assert "roofline_candidate" not in plain          # no bandwidth measured (CPU): no column


def test_bench_of_a_cuda_toggle_on_cpu_is_not_timed_and_says_why(model, capsys):
    r = bench.bench_toggle(model, "kda_fla_chunk", workload_name="decode", scale=0.25, repeats=2)
    assert r["counted"] is False and r["ratio"] is None and "runs on cuda, not cpu" in r["why"]
    from k3verify.cli import main
    assert main(["bench", "--toggle", "kda_fla_chunk", "--scale", "0.25", "--repeats", "2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])[0]
    assert row["counted"] is False and "runs on cuda, not cpu" in row["why"]


# ---- what the GPU run judges and times is read from the registry -----------------------------

def test_the_gpu_runs_lists_come_from_the_registry():
    from optimized_stack import toggles as registry

    assert set(gpu_suite.phase_set("prefill")) == {"kda_fla_chunk", "mla_flash_bf16", "moe_grouped",
                                                   "shared_expert_side_stream"}
    assert set(gpu_suite.phase_set("decode")) == {"kda_fla_recurrent", "mla_absorbed", "moe_grouped",
                                                  "shared_expert_side_stream"}
    kernels = gpu_suite.kernel_toggles()
    assert kernels[:7] == ("kda_fla_chunk", "kda_fla_chunk_prefill", "kda_fla_recurrent", "mla_flash_bf16",
                           "moe_grouped", "moe_grouped_static", "shared_expert_side_stream"), \
        "CUDA-only kernels first: the time budget cuts the tail"
    assert {"kda_chunked", "mla_absorbed", "mla_sdpa", "gemm_per_shape"} <= set(kernels)
    assert all(registry.get(m).mutant_of in kernels for m in gpu_suite.kernel_mutants())
    assert {"mut_fla_chunk_drops_state", "mut_gemm_per_shape_drops_column"} <= set(gpu_suite.kernel_mutants())
    assert set(gpu_suite.engine_roots()) == {"continuous_batching", "chunked_prefill", "prefix_cache",
                                             "projected_kv_cache"}
    # a kernel registered now is judged, timed with its phase and its mutant added, without an edit here;
    # negative control: a toggle that swaps no op slot is not a kernel
    from optimized_stack.model import ops
    new = [registry.Toggle(name="tmp_cuda_kernel", description="x", contract=registry.EXACT, touches=("logits",),
                           devices=("cuda",), ops={"linear": ops.plain_linear}, phases=("decode",)),
           registry.Toggle(name="tmp_cuda_kernel_mut", description="x", contract=registry.EXACT, touches=("logits",),
                           devices=("cuda",), kind="mutant", mutant_of="tmp_cuda_kernel", caught_by=("logits",),
                           ops={"linear": ops.plain_linear}),
           registry.Toggle(name="tmp_cuda_runner_only", description="x", contract=registry.EXACT, touches=("logits",),
                           devices=("cuda",), runner={"prefill_chunk": 7})]
    for t in new:
        registry.register(t)
    try:
        assert "tmp_cuda_kernel" in gpu_suite.kernel_toggles()[:8]        # among the CUDA-only ones
        assert "tmp_cuda_kernel_mut" in gpu_suite.kernel_mutants()
        assert "tmp_cuda_kernel" in gpu_suite.phase_set("decode")
        assert "tmp_cuda_kernel" not in gpu_suite.phase_set("prefill")
        assert "tmp_cuda_runner_only" not in gpu_suite.kernel_toggles()
    finally:
        for t in new:
            registry._REGISTRY.pop(t.name)


def test_engine_toggles_require_what_engine_options_require():
    """One source of the rule: an engine toggle's `requires` is engine/options.py REQUIRES's."""
    from optimized_stack import toggles as registry
    from optimized_stack.engine.options import REQUIRES, required_options

    for t in registry.all_toggles("optimization"):
        if t.engine:
            assert set(t.requires) == set(required_options(t.engine)) - {t.name}, t.name
            for needed in t.requires:            # the option's toggle is named after it and switches it on
                assert registry.get(needed).engine.get(needed), (t.name, needed)
    assert registry.get("ckpt_with_mla_tail").requires == ("prefix_cache", "prefix_cache_subblock")
    assert REQUIRES["speculative"] == "continuous_batching" and registry.get("spec_replay_ssm").requires == (
        "continuous_batching",)
