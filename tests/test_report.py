"""k3verify.report: schema validation, the four renderers, atomic writing, environment fingerprint."""

import json
import os
import re
import xml.etree.ElementTree as ET
from datetime import datetime
from types import SimpleNamespace

import pytest
import torch

from k3verify.compare.tensors import compare_logits, compare_tensors
from k3verify.errors import UsageError
from k3verify.report import (SCHEMA_VERSION, build_report, load_report, new_run_id, render_html, render_junit,
                             render_markdown, validate_report, write_report)
from k3verify.report.environment import environment_fingerprint, sha256_file
from k3verify.report.render_md import finding_message, key_numbers

FAIL_INDEX = 37


def _fail_finding() -> dict:
    ref = torch.linspace(-1.0, 1.0, 64)
    cand = ref.clone()
    cand[FAIL_INDEX] = torch.nextafter(cand[FAIL_INDEX], torch.tensor(2.0))  # one ULP up at one index
    finding = compare_tensors(ref, cand, label="logits[step 3]")
    assert not finding.passed and finding.n_mismatched == 1
    return finding.to_dict()


def _result(**over) -> dict:
    base = {"toggle": "absorbed_mla", "kind": "optimization", "contract": "exact", "check": "logits",
            "scenario": "single", "status": "pass", "reason": "", "findings": [], "first_divergence": None,
            "localization": None, "caught": None, "duration_s": 0.5, "speedup": None}
    base.update(over)
    return base


def _report() -> dict:
    equal = compare_tensors(torch.ones(8), torch.ones(8), label="logits").to_dict()
    results = [
        _result(findings=[equal], speedup={"ratio": 1.31, "ci": [1.2, 1.4], "counted": True}),
        _result(toggle="prefix_subblock", check="kda_state", scenario="shared_prefix_forks", status="fail",
                reason="KDA state differs from the reference", findings=[_fail_finding()],
                first_divergence={"request": "fork128", "step": 3, "tensor": "logits", "index": FAIL_INDEX},
                localization={"layer": 2, "sublayer": "kda"}, duration_s=1.25,
                per_step=[{"step": s, "max_abs": 1e-7 * s, "max_ulp": s, "kl": 1e-9 * s} for s in range(5)]),
        _result(toggle="fp8_allgather", contract="approx(max_kl=0.001)", check="gsm8k", scenario=None,
                status="skip", reason="needs CUDA and world size 2", duration_s=0.0),
    ]
    return build_report("20260101-000000-test-abc123", "k3verify diff --toggle x", {"python": "3.12"}, results,
                        created="2026-01-01T00:00:00+00:00")


# ---------------------------------------------------------------- schema


def test_hand_built_report_validates_and_summary_counts():
    report = _report()
    validate_report(report)
    assert report["schema_version"] == SCHEMA_VERSION == 1
    assert report["summary"] == {"passed": 1, "failed": 1, "skipped": 1, "errors": 0, "inconclusive": 0,
                                 "not_exercised": 0, "verdict": "fail"}


def test_validate_rejects_missing_summary():
    report = _report()
    del report["summary"]
    with pytest.raises(ValueError, match=r"report: missing required field 'summary'"):
        validate_report(report)


def test_validate_rejects_unknown_status():
    report = _report()
    report["results"][0]["status"] = "maybe"
    expected = r"results\[0\]\.status: expected one of pass, fail, skip, error, inconclusive, not_exercised, got 'maybe'"
    with pytest.raises(ValueError, match=expected):
        validate_report(report)


@pytest.mark.parametrize("path, value, match", [
    (("schema_version",), 2, r"schema_version: expected 1, got 2"),
    (("created",), "yesterday", r"created: expected an ISO 8601 timestamp"),
    (("results", 0, "duration_s"), "fast", r"duration_s: expected integer or number, got str"),
    (("results", 0, "caught"), "yes", r"caught: expected boolean or null"),
    (("results", 0, "kind"), "feature", r"kind: expected one of optimization, mutant"),
    (("results", 1, "reason"), "  ", r"a fail must state its reason"),
    (("results", 1, "findings"), ["text"], r"findings\[0\]: expected object"),
    (("summary", "failed"), 0, r"summary.failed: results give 1, summary says 0"),
    (("summary", "verdict"), "pass", r"summary.verdict: results give 'fail', summary says 'pass'"),
    (("summary", "passed"), True, r"summary.passed: expected integer, got bool"),
], ids=["version", "created", "duration-type", "caught-type", "kind", "empty-reason", "finding-type",
        "count-mismatch", "verdict-lies", "bool-count"])
def test_validate_rejects_ill_typed_fields(path, value, match):
    report = _report()
    target = report
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValueError, match=match):
        validate_report(report)


def test_verdict_passes_only_without_failures_or_errors():
    ok = build_report("r", "c", {}, [_result(), _result(status="skip", reason="cpu only")])
    assert ok["summary"]["verdict"] == "pass"
    bad = build_report("r", "c", {}, [_result(), _result(status="error", reason="backend crashed")])
    assert bad["summary"]["verdict"] == "fail"


# ---------------------------------------------------------------- inconclusive


def _inconclusive(**over) -> dict:
    """A gsm8k result at n=2 with zero discordance, as the gate writes it."""
    from k3verify.quality.stats import paired_from_counts

    paired = paired_from_counts(2, 0, 0, 0).to_dict()
    return _result(toggle="kda_chunked", contract="approx(max_kl=0.001)", check="gsm8k/strict-match",
                   scenario="gsm8k_synth n=2", status="inconclusive", reason=paired["verdict_reason"],
                   accuracy=paired, mde=paired["mde"], n_min=paired["n_min"], **over)


def test_inconclusive_round_trips_through_every_view(tmp_path):
    report = build_report("r-inc", "k3verify gsm8k --toggle kda_chunked", {}, [_result(), _inconclusive()])
    assert report["summary"] == {"passed": 1, "failed": 0, "skipped": 0, "errors": 0, "inconclusive": 1,
                                 "not_exercised": 0, "verdict": "inconclusive"}
    paths = write_report(tmp_path, report)
    assert load_report(tmp_path) == json.loads(json.dumps(report))
    reason = "inconclusive: n=2 cannot resolve a margin of 1 point; need n >= 268"
    md = paths["md"].read_text()
    assert "**Verdict: INCONCLUSIVE** - 1 passed, 0 failed, 0 skipped, 0 errors, 1 inconclusive" in md
    assert "| *inconclusive* |" in md and f"## Inconclusive (not a pass)\n\n- kda_chunked / gsm8k/strict-match" in md
    assert reason in md
    html = paths["html"].read_text()
    assert '<span class="verdict inconclusive">INCONCLUSIVE</span>' in html
    assert '<span class="inconclusive">inconclusive</span>' in html and "<h2>Inconclusive (not a pass)</h2>" in html
    root = ET.parse(paths["junit"]).getroot()
    assert (root.get("tests"), root.get("failures"), root.get("skipped"), root.get("errors")) == ("2", "0", "1", "0")
    case = root.find("testsuite[@name='kda_chunked']/testcase")
    skipped = case.find("skipped")
    assert skipped is not None and case.find("failure") is None, "an inconclusive gate is never a passing test"
    assert skipped.get("message") == reason and skipped.get("type") == "Inconclusive"
    # the unprefixed reason of another gate gets the word
    other = render_junit(build_report("r", "c", {}, [_result(status="inconclusive", reason="no needle recalled")]))
    assert ET.fromstring(other).find(".//skipped").get("message") == "inconclusive: no needle recalled"


def test_smoke_inconclusive_leaves_the_verdict_alone_but_a_smoke_failure_fails():
    smoke = build_report("r", "c", {}, [_result(), _inconclusive(role="smoke")])
    assert smoke["summary"]["verdict"] == "pass" and smoke["summary"]["inconclusive"] == 1
    assert "inconclusive (smoke)" in render_markdown(smoke)
    assert "role: smoke" in render_junit(smoke)
    broken = build_report("r", "c", {}, [_result(status="fail", reason="worse", role="smoke")])
    assert broken["summary"]["verdict"] == "fail", "no mode turns a failure into a warning"


def test_validate_rejects_an_inconclusive_called_a_pass():
    # negative control: a summary that hides an undecided gate is refused
    report = build_report("r", "c", {}, [_inconclusive()])
    report["summary"]["verdict"] = "pass"
    with pytest.raises(ValueError, match=r"summary.verdict: results give 'inconclusive', summary says 'pass'"):
        validate_report(report)
    report = build_report("r", "c", {}, [_inconclusive()])
    report["results"][0]["reason"] = ""
    with pytest.raises(ValueError, match=r"an inconclusive must state its reason"):
        validate_report(report)
    report["results"][0].update(reason="r", role="warmup")
    with pytest.raises(ValueError, match=r"results\[0\]\.role: expected one of gate, smoke, got 'warmup'"):
        validate_report(report)


def test_not_exercised_is_never_a_pass_in_any_view(tmp_path):
    """A check whose toggle's code path never ran: counted apart, never as a pass; like a skip it
    leaves the run's verdict alone; JUnit shows it skipped with the reason."""
    from k3verify.verdict.result import Result, Subject

    row = Result.not_exercised(Subject("prefix_cache"), "tokens", "no prefix hit fired on single",
                               scenario="single").to_dict()
    report = build_report("r-nx", "k3verify diff --toggle prefix_cache", {}, [_result(), row])
    assert report["summary"]["passed"] == 1 and report["summary"]["not_exercised"] == 1
    assert report["summary"]["verdict"] == "pass"
    paths = write_report(tmp_path, report)
    md = paths["md"].read_text()
    assert "| *not exercised* |" in md and "## Not exercised (not a pass" in md and "no prefix hit fired" in md
    assert "1 not exercised" in md
    assert "<h2>Not exercised (not a pass)</h2>" in paths["html"].read_text()
    root = ET.parse(paths["junit"]).getroot()
    assert (root.get("tests"), root.get("skipped"), root.get("failures")) == ("2", "1", "0")
    skipped = root.find("testsuite[@name='prefix_cache']/testcase/skipped")
    assert skipped.get("message") == "not exercised: no prefix hit fired on single"
    assert skipped.get("type") == "NotExercised"
    # negative control: the same row called a pass fails validation of the summary
    report["summary"]["passed"] = 2
    with pytest.raises(ValueError, match=r"summary.passed: results give 1, summary says 2"):
        validate_report(report)


def test_the_schema_reads_its_fields_and_statuses_from_the_result_type():
    from k3verify.report import schema
    from k3verify.verdict.result import STATUSES, Result, schema_fields

    assert schema.STATUSES == STATUSES and "not_exercised" in STATUSES
    assert set(schema._RESULT_FIELDS) == set(schema_fields()) >= {"toggle", "status", "reason", "findings"}
    with pytest.raises(Exception, match=r"must state its reason"):
        Result.failed(Subject_of("x"), "logits", "")
    with pytest.raises(Exception, match=r"result status: expected one of pass, fail, skip, error, inconclusive, "
                                        r"not_exercised, got 'ok'"):
        Result.make("ok", Subject_of("x"), "logits", "r")


def Subject_of(name):
    from k3verify.verdict.result import Subject
    return Subject(name)


def test_version_1_reports_from_before_inconclusive_still_load(tmp_path):
    old = _report()
    del old["summary"]["inconclusive"]
    del old["summary"]["not_exercised"]
    validate_report(old)                                   # absent count reads as 0
    old["results"].append(_inconclusive())
    old["summary"]["verdict"] = "fail"
    with pytest.raises(ValueError, match=r"summary.inconclusive: results give 1, summary says 0"):
        validate_report(old)


# ---------------------------------------------------------------- renderers


def test_markdown_names_failing_check_and_index():
    md = render_markdown(_report())
    assert "FAIL: prefix_subblock / kda_state / shared_prefix_forks" in md
    assert f"at index ({FAIL_INDEX},)" in md  # the comparator's message, rebuilt from the finding dict
    assert "Mismatched elements: 1 / 64" in md
    assert "first divergence: request=fork128, step=3" in md and "localization: layer=2, sublayer=kda" in md
    assert "needs CUDA and world size 2" in md
    row = next(line for line in md.splitlines() if line.startswith("| prefix_subblock"))
    assert "1 / 64" in row and "| 1 |" in row  # mismatched n/N and max ULP in the summary table
    assert "1.31x [1.20, 1.40]" in md


def test_markdown_escapes_pipes_in_cells():
    report = build_report("r", "c", {}, [_result(status="fail", reason="a | b\nc", check="x|y")])
    row = next(line for line in render_markdown(report).splitlines() if line.startswith("| absorbed_mla"))
    assert "x\\|y" in row and row.count(" | ") == 14  # 15 columns, no cell broken by the pipe


def test_junit_parses_and_counts():
    root = ET.fromstring(render_junit(_report()))
    assert root.tag == "testsuites"
    assert (root.get("tests"), root.get("failures"), root.get("skipped"), root.get("errors")) == ("3", "1", "1", "0")
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    assert set(suites) == {"absorbed_mla", "prefix_subblock", "fp8_allgather"}
    failure = suites["prefix_subblock"].find("testcase/failure")
    assert failure.get("message") == "KDA state differs from the reference"
    assert f"at index ({FAIL_INDEX},)" in failure.text
    assert suites["fp8_allgather"].find("testcase/skipped").get("message") == "needs CUDA and world size 2"
    assert suites["absorbed_mla"].find("testcase/failure") is None


def test_junit_escapes_markup_and_control_characters():
    nasty = 'bad <tag> & "quote" \x00\x1b end'
    report = build_report("r", "c", {}, [_result(toggle="t<1>", status="error", reason=nasty)])
    root = ET.fromstring(render_junit(report))
    error = root.find("testsuite/testcase/error")
    assert error.get("message").startswith('bad <tag> & "quote" ') and "\x00" not in error.get("message")
    assert root.find("testsuite").get("name") == "t<1>"


def test_html_is_self_contained_with_plots():
    html = render_html(_report())
    assert html.startswith("<!DOCTYPE html>") and "<style>" in html
    assert "<svg" in html or "<img" in html
    assert "ULP distance: logits[step 3]" in html  # the histogram of the failing finding
    assert "max ULP by step" in html  # per_step data plotted
    assert not re.search(r"""(src|href)=["']?https?:""", html)  # nothing fetched from the network
    assert "<script" not in html


def test_html_plots_accuracy_with_intervals():
    from k3verify.quality.stats import paired_from_counts

    paired = paired_from_counts(n=200, ref_correct=150, b=6, c=3).to_dict()
    report = build_report("r", "c", {}, [_result(check="gsm8k", accuracy=paired),
                                          _result(check="needle", accuracy=[{"label": "64K", "value": 1.0,
                                                                              "ci": [0.9, 1.0]}])])
    html = render_html(report)
    assert "Wilson 90% interval" in html and "-margin 0.01" in html  # accuracies and the paired panel
    assert "accuracy with intervals" in html
    assert "paired difference (cand - ref)" in html and "64K" in html


def test_html_escapes_text():
    report = build_report("r", "c", {}, [_result(status="fail", reason="<script>alert(1)</script>")])
    html = render_html(report)
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)" in html


def test_finding_message_survives_partial_dicts():
    assert finding_message({"message": "given text"}) == "given text"
    partial = {"what": "kda_state[layer 1]", "n_mismatched": 3, "n_total": 10, "max_ulp": 9}
    text = finding_message(partial)
    assert "kda_state[layer 1]" in text and "n_mismatched=3" in text


def test_key_numbers_include_logit_distances():
    ref = torch.tensor([[0.0, 1.0, 2.0], [3.0, 1.0, 0.0]])
    cand = torch.tensor([[0.0, 2.5, 2.0], [3.0, 1.0, 0.0]])  # row 0 argmax flips from 2 to 1
    k = key_numbers([compare_logits(ref, cand, label="logits").to_dict()])
    assert k["flips"] == "1 / 2" and k["mismatched"] == "1 / 6" and k["kl"] != ""
    assert finding_message(compare_logits(ref, cand, label="logits").to_dict()).count("Argmax flips: 1 / 2") == 1


# ---------------------------------------------------------------- writing and loading


def test_write_report_writes_all_four_and_round_trips(tmp_path):
    report = _report()
    paths = write_report(tmp_path / "run" / "nested", report)
    assert sorted(p.name for p in paths.values()) == ["junit.xml", "report.html", "report.json", "report.md"]
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths.values())
    assert load_report(paths["json"].parent) == json.loads(json.dumps(report))
    assert not list(paths["json"].parent.glob("*.tmp"))  # atomic writes leave no temp files


def test_write_report_files_are_readable_like_any_other_output(tmp_path):
    """0644 under umask 022 (mkstemp alone made them 0600: unreadable to every other user)."""
    saved = os.umask(0o022)
    try:
        paths = write_report(tmp_path / "run", _report())
    finally:
        os.umask(saved)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in paths.values()} == {
        n: "0o644" for n in ("report.json", "report.md", "report.html", "junit.xml")}


def test_write_report_refuses_invalid_report_and_writes_nothing(tmp_path):
    report = _report()
    report["results"][0]["status"] = "maybe"
    with pytest.raises(ValueError, match="status"):
        write_report(tmp_path / "out", report)
    assert not (tmp_path / "out").exists()


def test_write_report_spells_non_finite_numbers_as_strings(tmp_path):
    report = _report()
    report["results"][0]["speedup"] = {"ratio": float("nan")}
    paths = write_report(tmp_path, report)
    text = paths["json"].read_text()
    assert '"ratio": "nan"' in text and "NaN" not in text


def test_load_report_errors_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="no report at"):
        load_report(tmp_path)
    (tmp_path / "report.json").write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_report(tmp_path)
    broken = _report()
    del broken["summary"]
    (tmp_path / "report.json").write_text(json.dumps(broken))
    with pytest.raises(UsageError, match="missing required field 'summary'"):
        load_report(tmp_path)


def test_new_run_id_shape_and_uniqueness():
    now = datetime(2026, 11, 29, 23, 45, 1)
    a, b = new_run_id("diff", now=now), new_run_id("diff", now=now)
    assert re.fullmatch(r"20261129-234501-diff-[0-9a-f]{6}", a)
    assert a != b
    with pytest.raises(ValueError, match=r"prefix must be .* got 'a/b'"):
        new_run_id("a/b")


# ---------------------------------------------------------------- environment


def test_environment_fingerprint_fields(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not really weights")
    model = SimpleNamespace(source=str(tmp_path), dtype=torch.float32)
    env = environment_fingerprint(model=model, seeds=[0, 1], extra={"backend": "embedded"})
    assert env["torch"] == torch.__version__ and env["python"]
    assert env["packages"]["k3verify"] is not None and "vllm" in env["packages"]
    assert env["model"]["sha256"] == sha256_file(weights) and len(env["model"]["sha256"]) == 64
    assert env["dtype"] == "float32" and env["seeds"] == [0, 1] and env["backend"] == "embedded"
    assert set(env["git"]) == {"commit", "dirty", "branch"}
    json.dumps(env)  # JSON-ready


def test_environment_fingerprint_tolerates_missing_git(tmp_path, monkeypatch):
    from k3verify.report import environment

    monkeypatch.setattr(environment.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("git")))
    assert environment.git_state(tmp_path) == {"commit": None, "dirty": None, "branch": None}
    assert environment_fingerprint()["model"] is None
