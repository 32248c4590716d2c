"""The arithmetic behind the GPU speed tables (k3verify/gpu_bench.py, gpu_suite.py): the
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
