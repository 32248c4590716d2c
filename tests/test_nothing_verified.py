"""Green on nothing: a check that compared 0 elements is never a pass, and a run whose rows are
all skipped or not exercised has its own verdict, nothing_verified, with exit 1 (issue 29 item 1).

Every rule below has its negative control: a run with one real pass still passes with exit 0."""
from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET

import pytest

from k3verify import cli
from k3verify.compare import captures as captures_module
from k3verify.compare import golden as gh
from k3verify.kinds import golden as golden_kind
from k3verify.report import build_report, render_html, render_junit, render_markdown, validate_report
from k3verify.report.schema import summarize
from k3verify.run.runner import Runner
from k3verify.scenarios.workloads import build
from k3verify.verdict import gate
from k3verify.verdict.result import Result, Subject
from optimized_stack import load_model

SUBJECT = Subject("prefill_step_api")


def _row(status: str, check: str = "logits", reason: str = "why", **more) -> dict:
    return Result.make(status, SUBJECT, check, reason, scenario="single", **more).to_dict()


# ---- the run verdict (report/schema.py summarize) -------------------------------------------

def test_all_not_exercised_is_nothing_verified_with_the_counts():
    s = summarize([_row("not_exercised", c) for c in ("tokens", "logits", "kda_state", "mla_rows")])
    assert s["verdict"] == "nothing_verified"
    assert s["reason"] == "no check compared anything: 4 not exercised, 0 passed"


@pytest.mark.parametrize("rows, reason", [
    pytest.param(["skip", "skip"], "no check compared anything: 2 skipped, 0 not exercised, 0 passed", id="skips"),
    pytest.param(["skip", "not_exercised"], "no check compared anything: 1 skipped, 1 not exercised, 0 passed",
                 id="mixed"),
    pytest.param([], "no check compared anything: 0 not exercised, 0 passed", id="no-rows"),
])
def test_skips_and_empty_runs_verify_nothing(rows, reason):
    s = summarize([_row(st) for st in rows])
    assert (s["verdict"], s["reason"]) == ("nothing_verified", reason)


@pytest.mark.parametrize("rows, verdict", [
    pytest.param(["pass", "not_exercised", "skip"], "pass", id="one-pass-is-a-pass"),
    pytest.param(["fail", "not_exercised"], "fail", id="fail-wins"),
    pytest.param(["error", "skip"], "fail", id="error-wins"),
    pytest.param(["inconclusive", "not_exercised"], "inconclusive", id="inconclusive-wins"),
])
def test_negative_controls_keep_their_verdicts(rows, verdict):
    s = summarize([_row(st) for st in rows])
    assert s["verdict"] == verdict and "reason" not in s


def test_validate_refuses_a_nothing_verified_run_called_a_pass():
    report = build_report("r", "c", {}, [_row("not_exercised")])
    assert report["summary"]["verdict"] == "nothing_verified"
    validate_report(report)
    report["summary"]["verdict"] = "pass"
    with pytest.raises(ValueError, match="summary.verdict: results give 'nothing_verified', summary says 'pass'"):
        validate_report(report)


def test_every_view_renders_the_verdict_and_its_reason():
    report = build_report("r", "c", {}, [_row("not_exercised", c) for c in ("tokens", "logits")])
    reason = "no check compared anything: 2 not exercised, 0 passed"
    assert "**Verdict: NOTHING_VERIFIED**" in render_markdown(report) and reason in render_markdown(report)
    page = render_html(report)
    assert 'class="verdict nothing_verified"' in page and reason in page
    root = ET.fromstring(render_junit(report))
    failure = root.find("testsuite[@name='k3verify.verdict']/testcase[@name='run_verdict']/failure")
    assert failure is not None and failure.get("message") == f"nothing_verified: {reason}"
    assert (root.get("tests"), root.get("failures"), root.get("skipped")) == ("3", "1", "2"), \
        "a run that verified nothing is not green in CI"


def test_a_passing_run_gets_no_verdict_testcase():
    root = ET.fromstring(render_junit(build_report("r", "c", {}, [_row("pass", reason=""), _row("not_exercised")])))
    assert root.find("testsuite[@name='k3verify.verdict']") is None and root.get("failures") == "0"


# ---- a check that compared 0 elements (verdict/gate.py) -------------------------------------

@pytest.fixture(scope="module")
def model():
    return load_model("k3-mini")


@pytest.fixture(scope="module")
def small():
    return build("single", scale=0.25)


@pytest.fixture(scope="module")
def runner(model):
    return Runner(model)          # the reference capture is computed once for the module


def _zero(check: str, tokens_part: bool = False):
    """compare_captures as it is, then `check` reports 0 compared (and the streams parted)."""
    real = captures_module.compare_captures

    def fake(ref, cand, scenario):
        out = real(ref, cand, scenario)
        out[check].update(compared=0, equal=True, reason="", first=None)
        if tokens_part:
            out["tokens"].update(equal=False, reason="token streams part at generated step 0 of request r0",
                                 first={"scenario": scenario, "request": "r0", "step": 0, "tensor": "tokens"})
        return out
    return fake


def test_zero_compared_is_not_exercised_never_bit_identical(model, small, runner, monkeypatch):
    monkeypatch.setattr(gate, "compare_captures", _zero("mla_rows"))
    by = {r.check: r for r in gate.check_toggle(model, "prefill_step_api", small, runner=runner,
                                                 localize_failures=False)}
    assert by["mla_rows"].status == "not_exercised"
    assert by["mla_rows"].reason == "nothing compared: 0 MLA cache layers captured on single"
    assert "bit-identical" not in by["mla_rows"].reason


def test_zero_compared_after_the_streams_parted_is_a_fail(model, small, runner, monkeypatch):
    monkeypatch.setattr(gate, "compare_captures", _zero("mla_rows", tokens_part=True))
    by = {r.check: r for r in gate.check_toggle(model, "prefill_step_api", small, runner=runner,
                                                 localize_failures=False)}
    assert by["mla_rows"].status == "fail"
    assert by["mla_rows"].reason == ("0 MLA cache layers compared: not comparable after token streams part at "
                                     "generated step 0 of request r0")


def test_negative_control_the_real_comparison_counts_and_passes(model, small, runner):
    """Without the patch the same judge compares items and holds (prefill_step_api fires on single)."""
    res = gate.check_toggle(model, "prefill_step_api", small, runner=runner, localize_failures=False)
    assert [r.status for r in res] == ["pass"] * 4, [(r.check, r.reason) for r in res]
    assert all("bit-identical (" in r.reason and "(0 compared)" not in r.reason for r in res)


# ---- the CLI: exit 1 on nothing verified, 0 on a real pass ----------------------------------

def test_diff_at_a_scale_that_generates_nothing_is_nothing_verified_exit_1(tmp_path, capsys):
    code = cli.main(["diff", "--toggle", "prefill_step_api", "--scenario", "single", "--scale", "1e-300",
                     "--report-dir", str(tmp_path / "r"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["verdict"] == "nothing_verified"
    assert out["summary"]["reason"] == "no check compared anything: 4 not exercised, 0 passed"
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["summary"]["verdict"] == "nothing_verified" and report["summary"]["passed"] == 0


def test_negative_control_a_real_pass_still_exits_0(tmp_path, capsys):
    code = cli.main(["diff", "--toggle", "prefill_step_api", "--scenario", "single", "--scale", "0.25",
                     "--report-dir", str(tmp_path / "r"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verdict"] == "pass" and out["summary"]["passed"] == 4


@pytest.mark.parametrize("argv, why", [
    pytest.param(["--toggle", "moe_grouped"], "runs on cuda, not cpu", id="cuda-only-toggle-on-cpu"),
    pytest.param(["--toggle", "prefill_step_api", "--world-size", "3"], "world size", id="world-size-3"),
])
def test_all_skipped_is_nothing_verified_exit_1(argv, why, tmp_path, capsys):
    code = cli.main(["diff", *argv, "--scenario", "single", "--report-dir", str(tmp_path / "r"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["verdict"] == "nothing_verified", out["summary"]
    assert all(r["status"] == "skip" and why in r["reason"] for r in out["results"])


# ---- repeated flags: 4 checks are 4 results ----------------------------------------------------

def test_a_repeated_toggle_and_scenario_are_judged_once(tmp_path, capsys):
    code = cli.main(["diff", "--toggle", "prefill_step_api", "--toggle", "prefill_step_api", "--scenario", "single",
                     "--scenario", "single", "--scale", "0.25", "--report-dir", str(tmp_path / "r"), "--json"])
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert code == 0 and len(out["results"]) == 4 and out["summary"]["passed"] == 4, out["summary"]
    assert "note: --toggle repeated (prefill_step_api x2): each judged once, 1 of 2 values kept" in cap.err
    assert "note: --scenario repeated (single x2): each judged once, 1 of 2 values kept" in cap.err


def test_negative_control_two_distinct_toggles_give_two_sets(monkeypatch):
    from k3verify.commands import diff as diff_cmd
    from k3verify.kinds import plan
    from types import SimpleNamespace
    args = SimpleNamespace(toggle=["prefill_step_api", "kda_chunked", "prefill_step_api"], scenario=["single"],
                           scale=0.25, seed=0, world_size=1, backend="embedded", model=None)
    units = plan(diff_cmd.spec_of(args))
    assert [(u.toggle, u.scenario) for u in units] == [("prefill_step_api", "single"), ("kda_chunked", "single")]


# ---- golden: nothing to compare is not a pass -------------------------------------------------

def test_golden_check_with_a_missing_dir_is_one_line_exit_2_before_any_work(tmp_path, capsys):
    t0 = time.perf_counter()
    code = cli.main(["golden", "check", "--dir", str(tmp_path / "golden-typo")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and time.perf_counter() - t0 < 2.0
    assert len(err) == 1 and "golden-typo: no such directory" in err[0], err


def test_golden_entry_without_scenarios_is_nothing_verified(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gh, "GOLDEN_SCENARIOS", ())
    gh.record(model, "an empty entry", tmp_path)
    gc = gh.check(model, tmp_path)
    assert gc.status == "not_exercised" and "holds no scenarios: nothing compared" in gc.reason
    assert summarize(r.to_dict() for r in golden_kind.results(gc))["verdict"] == "nothing_verified"
    code = cli.main(["golden", "check", "--dir", str(tmp_path), "--model", "k3-mini", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["verdict"] == "nothing_verified"


def test_negative_control_a_recorded_golden_check_passes_exit_0(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gh, "GOLDEN_SCENARIOS", (("single", 0.25),))
    gh.record(model, "one scenario", tmp_path)
    code = cli.main(["golden", "check", "--dir", str(tmp_path), "--model", "k3-mini", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verdict"] == "pass" and [s["status"] for s in out["scenarios"]] == ["pass"]
