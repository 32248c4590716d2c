"""perf/engine_summary: the session-10 H200 files give the figures the hand-written summary quoted
(ratio lower bound 5.74x, prefill 0.22x at 32K: both missed); a goal with no figure is `not
measured`, never met; the boundaries judge the right way round; bad input is one line, exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3verify.perf import engine_summary as es

ENGINE = Path(__file__).resolve().parent.parent / "golden/reports/gpu-2026-12-02-h200-engine"


def test_the_session_10_files_give_the_hand_derived_figures(tmp_path):
    out = tmp_path / "summary.json"
    assert es.main(["--out", str(out), "--fair", str(ENGINE / "fair_baseline.json"),
                    "--step-profile", str(ENGINE / "step_profile.json")]) == 0
    doc = json.loads(out.read_text())
    hand = json.loads((ENGINE / "summary.json").read_text())
    goals = doc["goals"]
    assert goals["decode_b64_lower95_vs_transformers"]["value"] == pytest.approx(hand["ratio_b64_lower95"])
    assert goals["decode_b64_lower95_vs_transformers"]["verdict"] == "missed"
    assert goals["prefill_32k_vs_transformers"]["value"] == pytest.approx(0.2167, abs=1e-3)
    assert goals["prefill_32k_vs_transformers"]["verdict"] == "missed"
    assert doc["kernels_per_step"] == hand["kernels_per_step"]
    # what these files do not hold is not measured, never met
    for name in ("roofline_b64", "roofline_b256", "agentic_c64_tok_s", "capture_overhead_gpu"):
        assert goals[name] == {"value": None, "target": goals[name]["target"], "verdict": "not measured"}


@pytest.mark.parametrize("value,verdict", [(0.0999, "missed"), (0.10, "met"), (0.31, "met")])
def test_roofline_goal_boundary(value, verdict):
    doc = es.merge(None, None, {"roofline_fraction": {"64": value}, "agentic": []}, None, ["fast"])
    assert doc["goals"]["roofline_b64"]["verdict"] == verdict


@pytest.mark.parametrize("overhead,verdict", [(0.049, "met"), (0.05, "met"), (0.051, "missed")])
def test_capture_overhead_is_a_ceiling(overhead, verdict):
    doc = es.merge(None, None, None, {"overhead": overhead, "device": "cuda"}, ["capture"])
    assert doc["goals"]["capture_overhead_gpu"]["verdict"] == verdict
    # the same figure from a CPU run does not judge the GPU goal
    cpu = es.merge(None, None, None, {"overhead": overhead, "device": "cpu"}, ["capture"])
    assert cpu["goals"]["capture_overhead_gpu"]["verdict"] == "not measured" and "cpu" in cpu["capture_overhead_note"]


def test_agentic_goal_reads_the_c64_row_only():
    rows = [{"concurrency": 8, "tok_s": 90_000.0, "prefix_reuse": 0.99},
            {"concurrency": 64, "tok_s": 29_000.0, "prefix_reuse": 0.97}]
    goals = es.merge(None, None, {"agentic": rows}, None, ["fast"])["goals"]
    assert goals["agentic_c64_tok_s"]["verdict"] == "missed" and goals["agentic_c64_prefix_reuse"]["verdict"] == "met"
    skipped = es.merge(None, None, {"agentic": [{"concurrency": 64, "skipped": "budget spent"}]}, None, ["fast"])
    assert skipped["goals"]["agentic_c64_tok_s"]["verdict"] == "not measured"


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert es.main(["--out", str(tmp_path / "s.json")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert es.main(["--out", str(tmp_path / "s.json"), "--fast", str(bad)]) == 2
    assert es.main(["--out", str(tmp_path / "s.json"), "--fair", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert not (tmp_path / "s.json").exists()
