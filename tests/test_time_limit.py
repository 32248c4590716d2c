"""`k3verify all --time-limit S`: a gate with a time budget (the GPU release suite's 600 s) still
writes its report; the units it had no time for are inconclusive rows, never a pass, and a resume
runs them."""
from __future__ import annotations

import json
from pathlib import Path

from k3verify import cli

SUITE = '''version = 2
[[check]]
kind = "diff"
toggles = ["state_offload_roundtrip"]
scenarios = ["single", "multi_length"]
scale = 0.25
'''


def _rows(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "report.json").read_text(encoding="utf-8"))["results"]


def test_units_past_the_limit_are_inconclusive_and_a_resume_runs_them(tmp_path, capsys):
    suite = tmp_path / "s.toml"
    suite.write_text(SUITE, encoding="utf-8")
    run_dir = tmp_path / "run"
    # a limit that has passed before the first unit: nothing runs, nothing passes
    assert cli.main(["all", "--suite", str(suite), "--report-dir", str(run_dir), "--time-limit", "1e-9"]) == 1
    out = capsys.readouterr().out
    rows = _rows(run_dir)
    assert rows and all(r["status"] == "inconclusive" and r.get("not_run") == "time_limit" for r in rows)
    assert "--time-limit of 1e-09 s passed" in rows[0]["reason"]
    assert "0 of 2 units run now" in out, out
    assert not list((run_dir / "checks").glob("*.json")), "an unrun unit must not be recorded as finished"
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["units_not_run_time_limit"] == 2 and summary["verdict"] != "pass"
    assert summary["release_suite_s"] is not None and summary["release_suite_s"] >= 0
    # negative control: the same units with time to run pass, and only the resume ran them
    run_id = json.loads((run_dir / "plan.json").read_text(encoding="utf-8"))["run_id"]
    assert cli.main(["all", "--resume", run_id, "--report-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 units run now" in out, out
    assert {r["status"] for r in _rows(run_dir)} >= {"pass"} and not any(r.get("not_run") for r in _rows(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["units_not_run_time_limit"] == 0
    # timed as its two attempts (0 units, then 2), not from the plan across the gap between them
    assert [a["units_run"] for a in summary["attempts"]] == [0, 2]
    assert summary["release_suite_s"] == round(sum(a["seconds"] for a in summary["attempts"]), 1)


def test_a_bad_time_limit_is_one_line(tmp_path, capsys):
    for bad in ("0", "-5", "nan"):
        assert cli.main(["all", "--time-limit", bad, "--report-dir", str(tmp_path / bad)]) == 2
        err = capsys.readouterr().err
        assert "--time-limit must be a number of seconds in (0, 1e7)" in err and "Traceback" not in err


def test_release_on_cuda_is_the_gpu_form_and_cpu_keeps_its_own():
    """`all --suite release --device cuda` runs checks/release.cuda.toml; a device with no form of
    its own (and the CPU) runs checks/release.toml. Negative control: the two files differ."""
    from k3verify.suites import suite as suites

    gpu, cpu = suites.suite_path("release", "cuda"), suites.suite_path("release", "cpu")
    assert gpu.name == "release.cuda.toml" and cpu.name == "release.toml"
    assert suites.suite_path("release", "mps").name == "release.toml"
    assert suites.load_suite("release", "cuda").sha256 != suites.load_suite("release").sha256
    models = {c.model for c in suites.load_suite("release", "cuda").checks}
    assert {"k3-small", "golden/k3-dims"} <= models, "the GPU gate judges at K3's head dims"


def test_an_attempt_killed_mid_run_is_timed_to_its_last_finished_unit(tmp_path):
    """A device call's hard timeout kills `all` before it records its end: the attempt is on file
    from its start and is timed to the last unit it finished (a lower bound, marked estimated).
    Control: a completed attempt keeps its measured seconds."""
    import time
    from datetime import datetime, timedelta, timezone
    from k3verify.suites import run_all

    run = tmp_path / "run"
    (run / "checks").mkdir(parents=True)
    t0 = time.time() - 100
    run_all.record_attempt(run, t0, None)                       # killed: never completed
    done = datetime.fromtimestamp(t0, timezone.utc) + timedelta(seconds=42)
    (run / "checks" / "u1.json").write_text(json.dumps({"finished": done.isoformat()}), encoding="utf-8")
    run_all.record_attempt(run, t0 + 60, None)
    run_all.record_attempt(run, t0 + 60, t0 + 65, 0)            # the resume that wrote the report
    got = run_all.attempt_seconds(run)
    assert [a["seconds"] for a in got] == [42.0, 5.0]
    assert got[0]["estimated"] and "estimated" not in got[1]
