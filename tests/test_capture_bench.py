"""perf/capture_bench on the CPU (k3-mini, tiny): both arms run the same decode work, the captured
arm really hashed the rows (evidence the capture ran), the file is engine_summary's --capture
input; bad arguments are one line, exit 2. The figure itself is a GPU measurement (NOTES.md)."""
from __future__ import annotations

import json

from k3verify.perf import capture_bench, engine_summary


def test_capture_bench_writes_an_overhead_with_rows_hashed(tmp_path):
    assert capture_bench.main(["--out", str(tmp_path), "--device", "cpu", "--batch", "2", "--context", "24",
                               "--new-tokens", "4", "--repeats", "2"]) == 0
    doc = json.loads((tmp_path / "capture_overhead.json").read_text())
    assert doc["stack"] == ["batched_decode", "prefill_sorted_experts", "prefill_batched_mixers"] and doc["batch"] == 2
    assert doc["captured_logits_rows"] >= 2 * 3, "the capture arm hashed no rows: it did not watch the engine"
    assert isinstance(doc["overhead"], float) and doc["ci95"][0] <= doc["overhead"] <= doc["ci95"][1]
    # the headline times the steady steps only: fewer seconds than the whole runs beside it
    assert doc["ab"]["tokens"] == 2 * 3 and doc["with_setup"]["ab"]["tokens"] == 2 * 4
    assert doc["ab"]["median_s_a"] < doc["with_setup"]["ab"]["median_s_a"]
    assert isinstance(doc["extra_ms_per_step"], float)
    # the per-step split: both arms timed over steady steps; on the CPU the profiler sees no device,
    # so the whole step is the host's (on a GPU the device's busy time is subtracted)
    for arm in ("none", "capture"):
        sp = doc["step_split"][arm]
        assert sp["steps"] == 6 and sp["wall_ms"] > 0 and sp["device_ms"] == 0.0
        assert sp["host_uncovered_ms"] == sp["wall_ms"]
    assert doc["step_split"]["none"]["captured_logits_rows"] == 0
    assert doc["step_split"]["capture"]["captured_logits_rows"] >= 2 * 19     # the watched arm watched its 19 steps
    # where the watched steps' host time went: the capture's own functions lead what it adds
    added = [r for r in doc["host_added"] if r["extra_ms"] > 0]
    assert any(r["function"].startswith("k3verify/") and r["calls"] > 0 for r in added[:5]), doc["host_added"][:5]
    assert len(doc["host_added"]) == 12 and "host" not in doc["step_split"]["none"]
    from optimized_stack import load_model
    kda_layers = sum(k == "kda" for k in load_model("k3-mini").config.layer_kinds)
    assert doc["digest_cost"]["tensors_a_step"] == 4 * kda_layers + 1 and doc["digest_cost"]["stack_and_digest_ms"] > 0
    merged = engine_summary.merge(None, None, None, doc, ["capture"])
    assert merged["goals"]["capture_overhead_gpu"]["verdict"] == "not measured"        # a CPU figure
    as_gpu = engine_summary.merge(None, None, None, {**doc, "device": "cuda"}, ["capture"])
    assert as_gpu["goals"]["capture_overhead_gpu"]["value"] == doc["overhead"]


def test_per_request_arm_times_the_same_digests(tmp_path):
    """--per-request: the before (per-request observer calls) beside the after, in one process; the
    two captures recorded the same digests, so the arms timed the same work."""
    assert capture_bench.main(["--out", str(tmp_path), "--device", "cpu", "--batch", "3", "--context", "24",
                               "--new-tokens", "3", "--repeats", "2", "--per-request"]) == 0
    doc = json.loads((tmp_path / "capture_overhead.json").read_text())
    pr = doc["per_request"]
    assert pr["same_digests_as_batched"] is True
    assert pr["ci95"][0] <= pr["overhead"] <= pr["ci95"][1]
    assert pr["ab"]["b"] == "capture, per-request calls" and pr["ab"]["repeats"] == 2


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys):
    assert capture_bench.main(["--out", str(tmp_path), "--device", "cpu", "--batch", "0"]) == 2
    assert capture_bench.main(["--out", str(tmp_path), "--device", "tpu"]) == 2
    assert capture_bench.main(["--out", str(tmp_path), "--device", "cpu", "--new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith("error: ") for e in err)


def test_device_time_runs_the_call_once_and_counts_no_device_work_on_a_cpu():
    import torch
    from k3verify.perf.capture_bench import _device_time
    calls = []
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ms, acts = _device_time(lambda: calls.append(torch.ones(8, device=dev).sum()))
    assert calls and len(calls) == 1
    if not torch.cuda.is_available():
        assert (ms, acts) == (0.0, 0)
    else:                                     # on a GPU the sum is one kernel at least
        assert acts >= 1 and ms >= 0


def test_after_step_arm_times_the_same_digests_and_the_default_took_them_in_the_step(tmp_path, monkeypatch):
    """--after-step: the capture with its calls after the step beside the default, whose digests rode in
    the fast step (K3_DIGEST=m31x4 gives CPU tensors the device digest, as CUDA tensors have it); the two
    recorded the same digests. Without the device digest the default arm takes none in the step."""
    monkeypatch.setenv("K3_DIGEST", "m31x4")
    assert capture_bench.main(["--out", str(tmp_path), "--device", "cpu", "--batch", "3", "--context", "24",
                               "--new-tokens", "3", "--repeats", "2", "--after-step"]) == 0
    doc = json.loads((tmp_path / "capture_overhead.json").read_text())
    assert doc["in_step"]["digest_steps"] == 2 and doc["in_step"]["off"] is None    # new-tokens 3: 2 decode steps
    af = doc["after_step"]
    assert af["same_digests_as_in_step"] is True and af["ab"]["b"] == "capture, calls after the step"
    assert af["ci95"][0] <= af["overhead"] <= af["ci95"][1]
    monkeypatch.delenv("K3_DIGEST")
    assert capture_bench.main(["--out", str(tmp_path), "--device", "cpu", "--batch", "2", "--context", "24",
                               "--new-tokens", "3", "--repeats", "2"]) == 0
    assert json.loads((tmp_path / "capture_overhead.json").read_text())["in_step"]["digest_steps"] == 0


def test_host_added_ranks_what_only_the_watched_arm_ran_and_not_what_both_ran():
    split = {"none": {"host": {"engine.py:1(step)": [2.0, 1.0], "x.py:5(f)": [0.5, 3.0]}},
             "capture": {"host": {"engine.py:1(step)": [2.0, 1.0], "x.py:5(f)": [0.7, 3.0],
                                  "k3verify/capture/capture.py:9(on_step_words)": [0.4, 1.0]}}}
    rows = capture_bench.host_added(split, top=3)
    assert [r["function"] for r in rows] == ["k3verify/capture/capture.py:9(on_step_words)", "x.py:5(f)",
                                             "engine.py:1(step)"]
    assert rows[0]["calls"] == 1.0 and abs(rows[1]["extra_ms"] - 0.2) < 1e-9 and rows[2]["extra_ms"] == 0.0


def test_replay_times_counts_each_graph_launch_and_puts_the_launches_back():
    from types import SimpleNamespace
    ran = []
    entries = {k: SimpleNamespace(replay=lambda k=k: ran.append(k)) for k in ("a", "b")}
    originals = {k: e.replay for k, e in entries.items()}
    eng = SimpleNamespace(fast=SimpleNamespace(graphs=SimpleNamespace(graphs=entries)))
    got = capture_bench._replay_times(eng, lambda: [entries["a"].replay(), entries["b"].replay(),
                                                    entries["a"].replay()])
    assert ran == ["a", "b", "a"] and got["replays"] == 3, got        # the launches really ran, each timed
    assert got["median_us"] >= 0 and got["max_us"] >= got["median_us"] and got["stream_idle_before"] == 1.0
    assert all(e.replay is originals[k] for k, e in entries.items()), "the timing wrappers were left in place"
    # control: an engine with no graph (the CPU's eager step) reports nothing, and still runs fn
    bare = SimpleNamespace(fast=None)
    assert capture_bench._replay_times(bare, lambda: ran.append("eager")) == {} and ran[-1] == "eager"
