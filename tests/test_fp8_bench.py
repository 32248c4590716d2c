"""The FP8 bench (k3verify/perf/fp8_bench.py) in its smoke mode on the CPU: every arm timed and
compared with its reference, the JSON on file after every cell (a device call can be killed at its
limit), an arm that raises recorded without losing the others, bad input one line and exit 2."""
from __future__ import annotations

import json

import pytest
import torch

from k3verify.perf import fp8_bench

ARMS = {"mla_prefill": {"reference", "mla_fp8_prefill", "mla_fp8_prefill_scaled"},
        "moe_experts": {"reference", "moe_fp8_stage2"}}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_smoke_times_every_arm_and_reports_its_drift(tmp_path, capsys, one_thread):
    assert fp8_bench.main(["--out", str(tmp_path), "--smoke", "--device", "cpu", "--repeats", "5"]) == 0
    doc = json.loads((tmp_path / "fp8_bench.json").read_text())
    assert doc["complete"] and doc["model"] == "k3-mini" and doc["environment"]["git"]["commit"]
    cells = {(c["op"], c["T"]): c for c in doc["cells"]}
    assert set(cells) == {(op, t) for op in ARMS for t in fp8_bench.SMOKE_LENGTHS}
    for (op, t), cell in cells.items():
        assert set(cell["arms"]) == ARMS[op], (op, t)
        for name, row in cell["arms"].items():
            assert len(row["ms_runs"]) == 5 and row["ms_ci95"][0] <= row["ms_median"] <= row["ms_ci95"][1]
            if name != "reference":
                assert row["speedup"] > 0 and row["speedup_ci95"][0] <= row["speedup"] <= row["speedup_ci95"][1]
                # every FP8 arm moves its output, and by less than the reference's own size
                assert 0 < row["max_abs_diff"] < row["max_abs_ref"], (op, t, name, row)
    out = capsys.readouterr().out.strip().splitlines()
    assert "mla_fp8_prefill_scaled" in "\n".join(out[:-1]), "the table names every arm"
    assert json.loads(out[-1])["complete"] is True, "the last line is one JSON document"


def test_the_json_is_on_file_after_every_cell(tmp_path, monkeypatch, one_thread):
    """A run killed in its second cell (here: the timing raises) leaves the first on file."""
    real, calls = fp8_bench.time_cell, []

    def second_cell_dies(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("the device call's time limit")
        return real(*a, **kw)
    monkeypatch.setattr(fp8_bench, "time_cell", second_cell_dies)
    with pytest.raises(KeyboardInterrupt):
        fp8_bench.main(["--out", str(tmp_path), "--smoke", "--device", "cpu", "--lengths", "16"])
    doc = json.loads((tmp_path / "fp8_bench.json").read_text())
    assert doc["complete"] is False and [c["op"] for c in doc["cells"]] == ["mla_prefill"]
    assert set(doc["cells"][0]["arms"]) == ARMS["mla_prefill"]


def test_an_arm_that_raises_is_recorded_and_the_others_still_run(tmp_path, monkeypatch, one_thread):
    from optimized_stack.kernels.mla import fp8_prefill_scaled

    def broken(*a, **kw):
        raise RuntimeError("mat2 shape (24x40) must be divisible by 16")
    monkeypatch.setattr(fp8_prefill_scaled, "mla_fp8_prefill_scaled", broken)
    assert fp8_bench.main(["--out", str(tmp_path), "--smoke", "--device", "cpu", "--lengths", "16",
                           "--ops", "mla"]) == 1
    arms = json.loads((tmp_path / "fp8_bench.json").read_text())["cells"][0]["arms"]
    assert arms["mla_fp8_prefill_scaled"] == {"error": "RuntimeError: mat2 shape (24x40) must be divisible by 16"}
    assert arms["mla_fp8_prefill"]["max_abs_diff"] > 0


@pytest.mark.parametrize("argv, match", [
    (["--repeats", "4"], "--repeats must be >= 5, got 4"),
    (["--lengths", "0"], "expected lengths >= 2"),
    (["--lengths", "4k"], "expected a comma list of integers, got '4k'"),
    (["--ops", "mla,attention"], "--ops: expected some of mla, moe"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--no-smoke"], "the full bench needs CUDA"),
], ids=["repeats", "length-0", "length-text", "ops", "unknown-flag", "cpu-without-smoke"])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, match):
    base = ["--out", str(tmp_path), "--device", "cpu"]
    if argv == ["--no-smoke"]:
        argv = []
    else:
        base.append("--smoke")
    assert fp8_bench.main(base + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
    assert not (tmp_path / "fp8_bench.json").exists(), "nothing is measured on bad input"
