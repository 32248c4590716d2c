"""`k3verify all` on tiny suites: a valid combined report with verdicts, resume after an
interruption (each unit exactly once), a broken toggle rejected with its divergence
(the negative control), verdict rules, and the release sign-off (signed vs not)."""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from k3verify import cli
from k3verify.report import load_report
from k3verify.suites import run_all
from k3verify.suites import suite as suites
from k3verify.suites import verdicts
from k3verify.suites.signoff import render_signoff
from optimized_stack import load_model
from optimized_stack import toggles as registry
from optimized_stack.model import ops

REPO = Path(__file__).resolve().parent.parent


def _diff_suite(tmp_path: Path, toggles: list[str], name: str = "tiny.toml") -> Path:
    """A diff check per toggle on `single`: toggles whose path events fire there (a state round
    trip per decode step, projected rows reused by every decode step)."""
    body = "version = 2\ndescription = \"tiny\"\n" + "".join(
        f'[[check]]\nname = "d-{t}"\nkind = "diff"\ntoggles = ["{t}"]\nscenarios = ["single"]\nscale = 0.25\n'
        for t in toggles)
    path = tmp_path / name
    path.write_text(body)
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One exact toggle on the single scenario, run through the CLI as a user would."""
    tmp = tmp_path_factory.mktemp("all")
    run_dir = tmp / "run"
    code = cli.main(["all", "--suite", str(_diff_suite(tmp, ["state_offload_roundtrip"])), "--report-dir", str(run_dir)])
    return code, run_dir


def test_tiny_suite_writes_a_valid_combined_report(tiny_run):
    code, run_dir = tiny_run
    assert code == 0
    report = load_report(run_dir)                     # validates against the schema
    assert report["summary"]["verdict"] == "pass" and report["summary"]["passed"] == 4
    (v,) = report["verdicts"]
    assert (v["toggle"], v["verdict"]) == ("state_offload_roundtrip", "counted") and v["scenarios"] == ["single"]
    assert v["events"]["declared"] == ["state_roundtrip"] and v["events"]["fired"]["state_roundtrip"] > 0
    assert v["events"]["missing"] == []
    assert (run_dir / v["report"]).is_file(), "the verdict links to the toggle's own diff report"
    assert [c["status"] for c in report["suite"]["checks"]] == ["pass"]
    assert len(list((run_dir / "checks").glob("*.json"))) == 1
    assert "## Toggle verdicts" in (run_dir / "report.md").read_text()
    assert "Toggle verdicts" in (run_dir / "report.html").read_text()
    assert ET.parse(run_dir / "junit.xml").getroot().get("failures") == "0"


class _Killed(Exception):
    pass


def test_resume_after_interruption_runs_each_unit_exactly_once(tmp_path, capsys):
    suite = suites.load_suite(str(_diff_suite(tmp_path, ["state_offload_roundtrip", "projected_kv_cache"])))
    model = load_model()
    run_dir = tmp_path / "run"
    plan = run_all.new_plan(suite, None, model, "test-resume", "k3verify all --suite tiny")

    def die(unit):
        raise _Killed(unit.id)                  # the process "dies" right after the first unit's file

    with pytest.raises(_Killed):
        run_all.execute(plan, model, run_dir, after_unit=die)
    assert [p.name for p in (run_dir / "checks").glob("*.json")] == [
        "001-d-state_offload_roundtrip-state_offload_roundtrip-single.json"]
    assert not (run_dir / "report.json").exists()
    first_file = (run_dir / "checks").glob("*.json").__next__()
    before = first_file.stat().st_mtime_ns

    assert cli.main(["all", "--resume", "test-resume", "--report-dir", str(run_dir)]) == 0
    assert "1 of 2 units run now" in capsys.readouterr().out
    assert first_file.stat().st_mtime_ns == before, "a finished unit must not run again"
    report = load_report(run_dir)
    seen = collections.Counter((r["unit"], r["check"]) for r in report["results"])
    assert set(seen.values()) == {1} and len(seen) == 8, f"each check exactly once: {seen}"
    assert {v["toggle"]: v["verdict"] for v in report["verdicts"]} == {
        "state_offload_roundtrip": "counted", "projected_kv_cache": "counted"}


def test_a_toggle_whose_path_never_ran_is_not_counted(tmp_path):
    """The vacuous pass this gate exists to refuse: continuous batching on one request is
    bit-identical because nothing was batched. Not exercised, never counted."""
    run_dir = tmp_path / "run"
    assert cli.main(["all", "--suite", str(_diff_suite(tmp_path, ["continuous_batching"])), "--report-dir",
                     str(run_dir)]) == 1                      # nothing failed, but nothing was verified (exit 1)
    report = load_report(run_dir)
    assert report["summary"]["passed"] == 0 and report["summary"]["not_exercised"] == 4
    assert report["summary"]["verdict"] == "nothing_verified"
    (v,) = report["verdicts"]
    assert v["verdict"] == "skipped" and "batched_forward never fired on single" in v["reason"]
    assert v["events"]["missing"] == ["batched_forward"]
    assert [c["status"] for c in report["suite"]["checks"]] == ["not_exercised"]
    text, signed = render_signoff(report)
    assert not signed, "... but a suite whose check never ran its toggle's path is not signed off"


def test_resume_refuses_a_different_suite(tmp_path, capsys):
    run_dir = tmp_path / "run"
    suite = suites.load_suite(str(_diff_suite(tmp_path, ["state_offload_roundtrip"])))
    (run_dir).mkdir()
    from k3verify.io import atomic_write_json
    atomic_write_json(run_dir / "plan.json", run_all.new_plan(suite, None, load_model(), "r1", "k3verify all"))
    assert cli.main(["all", "--resume", "r1", "--report-dir", str(run_dir), "--suite", "release"]) == 2
    assert "ran suite 'tiny', got --suite 'release'" in capsys.readouterr().err


@pytest.fixture
def broken_toggle():
    """An 'optimization' that swaps the row-stable GEMM for torch's batch-dependent one."""
    t = registry.register(registry.Toggle(
        name="broken_plain_linear", description="test: torch GEMM instead of the row-stable one",
        contract=registry.EXACT, touches=("logits",), ops={"linear": ops.plain_linear}))
    yield t.name
    del registry._REGISTRY[t.name]


def test_broken_toggle_is_rejected_with_first_divergence(tmp_path, broken_toggle):
    """Negative control for `all`: a toggle that breaks bits must be rejected and exit 1."""
    run_dir = tmp_path / "run"
    assert cli.main(["all", "--suite", str(_diff_suite(tmp_path, [broken_toggle])), "--report-dir", str(run_dir)]) == 1
    report = load_report(run_dir)
    (v,) = report["verdicts"]
    assert v["verdict"] == "rejected" and v["failed_check"] in ("tokens", "logits", "kda_state", "mla_rows")
    assert v["first_divergence"]["scenario"] == "single" and "failed on single" in v["reason"]
    assert (run_dir / v["report"]).is_file()
    text, signed = render_signoff(report)
    assert not signed and text.rstrip().endswith("NOT SIGNED-OFF")
    assert f"toggle {broken_toggle} rejected" in text


def _row(toggle, check, status, reason="r", **extra):
    t = registry.get(toggle)
    fired = {"events": dict.fromkeys(t.events, 1), "events_missing": []}    # its path ran
    return {"toggle": toggle, "kind": t.kind, "contract": t.contract.describe(), "check": check, "scenario": "single",
            "status": status, "reason": reason, "findings": [], "first_divergence": None, "localization": None,
            "caught": None, "duration_s": 0.0, "speedup": None, "evidence": fired, **extra}


def test_approx_toggle_counts_only_when_its_quality_gates_pass():
    approx = next(t for t in registry.all_toggles("optimization") if t.contract.kind == "approx" and t.contract.quality)
    drift = _row(approx.name, "drift_budget", "pass")
    gates_skipped = [_row(approx.name, f"{g}", "skip", "not available in this build", gate=g) for g in approx.contract.quality]
    (v,) = verdicts.toggle_verdicts([drift, *gates_skipped])
    assert v["verdict"] == "skipped" and "quality gates did not pass" in v["reason"] and "not available" in v["reason"]
    gates_passed = [_row(approx.name, f"{g}", "pass", gate=g) for g in approx.contract.quality]
    bench = _row(approx.name, "bench", "pass", speedup={"ratio": 1.5, "ci": [1.4, 1.6], "counted": True})
    (v,) = verdicts.toggle_verdicts([drift, *gates_passed, bench])
    assert v["verdict"] == "counted" and v["speedup"]["ratio"] == 1.5
    (v,) = verdicts.toggle_verdicts([drift, _row(approx.name, "gsm8k", "fail", "worse", gate="gsm8k")])
    assert v["verdict"] == "rejected" and "gsm8k failed" in v["reason"]


N2 = "inconclusive: n=2 cannot resolve a margin of 1 point; need n >= 268"


def _gsm8k_row(status, reason=N2, **extra):
    """A gate row as `k3verify gsm8k` writes it: the long evidence reason, the verdict line in accuracy."""
    return _row("kda_chunked", "gsm8k/strict-match", status, f"{reason}. Paired non-inferiority ... MDE 124.32 points",
                gate="gsm8k", accuracy={"verdict": status, "verdict_reason": reason}, **extra)


def test_an_inconclusive_or_smoke_quality_gate_is_not_counted():
    drift = _row("kda_chunked", "drift_budget", "pass")
    needle_ok = _row("kda_chunked", "needle", "pass", gate="needle")
    bench = _row("kda_chunked", "bench", "pass", speedup={"ratio": 1.5, "ci": [1.4, 1.6], "counted": True})
    # negative control first: the same rows with gsm8k passing count, with the speedup
    (v,) = verdicts.toggle_verdicts([drift, _gsm8k_row("pass", "pass: non-inferior"), needle_ok, bench])
    assert v["verdict"] == "counted" and v["speedup"]["counted"] is True
    (v,) = verdicts.toggle_verdicts([drift, _gsm8k_row("inconclusive"), needle_ok, bench])
    assert v["verdict"] == "skipped" and v["speedup"] is None and v["checks"]["inconclusive"] == 1
    assert v["reason"].endswith(f"quality gates did not pass here: gsm8k inconclusive ({N2})")
    for status in ("inconclusive", "pass"):            # a smoke test never proves the gate, even when it passes
        (v,) = verdicts.toggle_verdicts([drift, _gsm8k_row(status, role="smoke"), needle_ok, bench])
        assert v["verdict"] == "skipped" and v["speedup"] is None
        assert "gsm8k ran only as a smoke test, which counts toward no verdict" in v["reason"]
    (v,) = verdicts.toggle_verdicts([drift, _gsm8k_row("fail", "fail: the candidate is worse", role="smoke"), needle_ok])
    assert v["verdict"] == "rejected" and "gsm8k/strict-match failed" in v["reason"], "a smoke failure still rejects"


@pytest.mark.parametrize("smoke, code", [pytest.param(False, 1, id="gate-inconclusive-exits-1"),
                                         pytest.param(True, 0, id="smoke-exits-0", marks=pytest.mark.slow)])
def test_all_with_a_gsm8k_gate_that_cannot_decide(tmp_path, capsys, smoke, code):
    keys = "num_fewshot = 0\nmax_new_tokens = 4\n" + ("smoke = true\n" if smoke else "")
    body = ('version = 2\ndescription = "undecided"\n'
            '[[check]]\nkind = "drift"\ntoggles = ["kda_chunked"]\nscenarios = ["single"]\nscale = 0.25\n'
            f'[[check]]\nkind = "gsm8k"\ntoggles = ["kda_chunked"]\nlimit = 2\n{keys}')
    (tmp_path / "u.toml").write_text(body)
    run_dir = tmp_path / "run"
    assert cli.main(["all", "--suite", str(tmp_path / "u.toml"), "--report-dir", str(run_dir)]) == code
    report = load_report(run_dir)
    assert report["summary"]["inconclusive"] == 2
    assert report["summary"]["verdict"] == ("pass" if smoke else "inconclusive")
    (v,) = report["verdicts"]
    assert v["verdict"] == "skipped" and v["speedup"] is None
    assert ("gsm8k ran only as a smoke test" if smoke else f"gsm8k inconclusive ({N2})") in v["reason"]
    skipped = ET.parse(run_dir / "junit.xml").getroot().findall(".//testcase/skipped")
    assert len(skipped) == 2 and all("n=2 cannot resolve a margin of 1 point" in s.get("message") for s in skipped)


def test_a_check_with_an_inconclusive_result_is_inconclusive():
    plan = {"suite": {"checks": [{"index": 1, "name": "gsm8k-synth", "kind": "gsm8k"}]}}
    rows = [{**_gsm8k_row("inconclusive"), "suite_check": "gsm8k-synth"},
            {**_gsm8k_row("pass", "pass: non-inferior"), "suite_check": "gsm8k-synth"}]
    (c,) = verdicts.check_statuses(plan, rows)
    assert c["status"] == "inconclusive" and c["counts"]["inconclusive"] == 1 and c["reason"].startswith(N2)


def test_signoff_signed_on_a_passing_all_report(tiny_run, tmp_path, capsys):
    _, run_dir = tiny_run
    out = tmp_path / "signoff.md"
    assert cli.main(["signoff", "--report", str(run_dir), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.rstrip().endswith("\nSIGNED-OFF") and "state_offload_roundtrip" in text
    assert "weights sha256" in text and "numerics key" in text and "sha256 `" in text


def test_signoff_not_signed_when_a_suite_check_was_skipped(tiny_run, tmp_path):
    _, run_dir = tiny_run
    report = json.loads((run_dir / "report.json").read_text())
    report["suite"]["checks"].append({"index": 2, "name": "gsm8k", "kind": "gsm8k", "status": "skip",
                                      "counts": {"skip": 1}, "reason": "not available in this build"})
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert cli.main(["signoff", "--report", str(path)]) == 1
    text = (tmp_path / "signoff.md").read_text()
    assert text.rstrip().endswith("NOT SIGNED-OFF") and "suite check 'gsm8k' (gsm8k) skip" in text


def test_signoff_refuses_a_report_that_is_not_from_all(tiny_run, tmp_path):
    _, run_dir = tiny_run
    report = json.loads((run_dir / "toggles" / "state_offload_roundtrip" / "report.json").read_text())
    _, signed = render_signoff(report)
    assert not signed


@pytest.mark.slow
def test_kill_9_then_resume_finishes_with_a_valid_report(tmp_path):
    """The real thing: SIGKILL the CLI once the first unit's file is on disk, then --resume."""
    suite = _diff_suite(tmp_path, ["state_offload_roundtrip", "projected_kv_cache", "prefill_step_api"])
    run_dir = tmp_path / "run"
    exe = [sys.executable, "-m", "k3verify.cli"]
    proc = subprocess.Popen([*exe, "all", "--suite", str(suite), "--report-dir", str(run_dir)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list((run_dir / "checks").glob("*.json")) if (run_dir / "checks").exists() else True:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "report.json").exists()
    run_id = json.loads((run_dir / "plan.json").read_text())["run_id"]     # a wrong id is refused
    done = subprocess.run([*exe, "all", "--resume", run_id, "--report-dir", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = load_report(run_dir)
    seen = collections.Counter((r["unit"], r["check"]) for r in report["results"])
    assert set(seen.values()) == {1} and len(seen) == 12


def test_quality_gate_of_a_cuda_toggle_on_cpu_is_a_skip_with_the_reason(tmp_path):
    """A suite's `all-approx` gates include CUDA-only kernels: on a CPU run they must skip
    with the reason (they errored on fla's import before), while a CPU toggle's gate runs."""
    body = ('version = 2\ndescription = "gates"\n[[check]]\nkind = "needle"\n'
            'toggles = ["kda_fla_chunk", "mla_sdpa"]\nlengths = [512]\ndepths = [0.5]\n')
    (tmp_path / "g.toml").write_text(body)
    run_dir = tmp_path / "run"
    cli.main(["all", "--suite", str(tmp_path / "g.toml"), "--report-dir", str(run_dir)])
    rows = {r["toggle"]: r for r in load_report(run_dir)["results"] if r["check"] == "needle" or r.get("gate")}
    assert rows["kda_fla_chunk"]["status"] == "skip"
    assert "runs on cuda, not cpu" in rows["kda_fla_chunk"]["reason"]
    assert rows["mla_sdpa"]["status"] in ("pass", "fail", "inconclusive")   # negative control: it really ran


@pytest.fixture
def gate_unit_with_leftover(tmp_path):
    """A needle unit (a gate faked to pass at once) and the report an earlier, interrupted attempt
    of the same run left in its gates/<unit>/ directory before its unit file was written."""
    from k3verify.report import build_report, write_report
    from k3verify.verdict.result import Result, Subject

    suite = suites.parse_suite('version = 2\n[[check]]\nkind = "needle"\nlengths = [512]\n')
    (unit,) = suites.expand(suite)
    plan = {"run_id": "r-1", "command": "k3verify all", "model": None, "units": [unit.to_dict()]}
    stale = tmp_path / "gates" / unit.id
    write_report(stale, build_report(f"r-1-{unit.id}", "k3verify all  # earlier attempt", {}, []))
    fake = [Result.passed(Subject("reference"), "needle", "fake gate", gate="needle")]
    return plan, unit, stale, fake


def test_a_gate_rerun_on_resume_replaces_its_own_leftover_report(gate_unit_with_leftover, tmp_path, monkeypatch):
    """The gate report's run id is derived from the run's and the unit's, so the rerun of an
    interrupted unit writes the same run's report over its own leftover."""
    plan, unit, stale, fake = gate_unit_with_leftover
    monkeypatch.setattr(run_all.kinds, "run", lambda u, ctx: fake)
    results, ran = run_all.execute(plan, None, tmp_path)
    assert ran == 1 and [(r["status"], r["reason"]) for r in results] == [("pass", "fake gate")]
    assert json.loads((stale / "report.json").read_text())["command"] == "k3verify all  # unit " + unit.id


def test_negative_control_another_runs_leftover_blocks_the_gate_report(gate_unit_with_leftover, tmp_path,
                                                                      monkeypatch):
    """A report of another run in the unit's gates/ directory is never overwritten."""
    from k3verify.errors import UsageError
    from k3verify.report import build_report, write_report

    plan, unit, stale, fake = gate_unit_with_leftover
    write_report(tmp_path / "other", build_report("another-run", "k3verify needle", {}, []))
    (stale / "report.json").write_text((tmp_path / "other" / "report.json").read_text())
    monkeypatch.setattr(run_all.kinds, "run", lambda u, ctx: fake)
    with pytest.raises(UsageError, match=r"already holds run another-run"):
        run_all.execute(plan, None, tmp_path)


def test_a_unit_that_crashes_is_an_error_result_and_the_run_goes_on(tmp_path, monkeypatch):
    suite = suites.parse_suite('version = 2\n[[check]]\nkind = "golden"\n[[check]]\nkind = "golden"\n')
    plan = {"run_id": "r-2", "command": "k3verify all", "model": None,
            "units": [u.to_dict() for u in suites.expand(suite)]}

    def crash_first(unit, ctx):
        if unit.id.startswith("001"):
            raise RuntimeError("boom")
        from k3verify.verdict.result import REFERENCE, Result
        return [Result.passed(REFERENCE, "golden", "ok")]
    monkeypatch.setattr(run_all.kinds, "run", crash_first)
    results, ran = run_all.execute(plan, None, tmp_path)
    assert ran == 2 and [r["status"] for r in results] == ["error", "pass"]
    assert results[0]["reason"] == "RuntimeError: boom" and "Traceback" in results[0]["traceback"]
