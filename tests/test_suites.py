"""Suite files: loading, strict validation with "did you mean", expansion into units, and
the quality-gate adapter's argument mapping. No model runs here: the whole file is fast."""
from __future__ import annotations

import argparse
import sys

import pytest

from k3verify import cli
from k3verify.suites import run_all
from k3verify.suites import suite as suites
from k3verify.errors import UsageError
from optimized_stack import toggles as registry

GOOD = """
version = 1
description = "t"
[[check]]
kind = "diff"
toggles = ["prefix_cache"]
scenarios = ["single"]
scale = 0.25
"""


def _suite(body: str, header: str = "version = 1\n") -> str:
    return header + body


@pytest.mark.parametrize("name, kinds", [
    ("premerge", {"selftest", "drift", "golden", "gsm8k", "needle"}),
    ("release", {"selftest", "diff", "drift", "golden", "gsm8k", "needle", "kvv", "bench"}),
])
def test_builtin_suites_load_and_expand(name, kinds):
    s = suites.load_suite(name)
    units = suites.expand(s)
    assert s.version == suites.SUITE_VERSION and s.description
    assert {u["kind"] for u in units} == kinds
    ids = [u["id"] for u in units]
    assert len(ids) == len(set(ids)), "unit ids must be unique: they name the files a resumed run looks for"


def test_good_suite_parses_with_defaults_filled():
    s = suites.parse_suite(GOOD, path="good.toml")
    (c,) = s.checks
    assert c.kind == "diff" and c.options["seed"] == 0 and c.options["scale"] == 0.25
    (u,) = suites.expand(s)
    assert (u["toggle"], u["scenario"], u["id"]) == ("prefix_cache", "single", "001-diff-prefix_cache-single")


@pytest.mark.parametrize("body, match", [
    pytest.param('[[check]]\nkind = "dif"\n', r"unknown check kind 'dif'; did you mean 'diff'\?", id="bad-kind"),
    pytest.param('[[check]]\nkind = "diff"\ntoggles = ["prefix_cach"]\n',
                 r"unknown toggle 'prefix_cach'; did you mean 'prefix_cache'\?", id="unknown-toggle"),
    pytest.param('[[check]]\nkind = "diff"\nscenario = ["single"]\n',
                 r"unknown key 'scenario'; did you mean 'scenarios'\?", id="unknown-key"),
    pytest.param('[[check]]\nkind = "diff"\nscenarios = ["singel"]\n',
                 r"unknown scenario 'singel'; did you mean 'single'\?", id="unknown-scenario"),
    pytest.param('[[check]]\nkind = "diff"\ntoggles = "all-exactt"\n', r"did you mean 'all-exact'\?", id="bad-selector"),
    pytest.param('[[check]]\nkind = "drift"\ntoggles = ["prefix_cache"]\n',
                 r"drift checks approx toggles; 'prefix_cache' has an exact contract", id="drift-on-exact"),
    pytest.param('[[check]]\nkind = "diff"\nscale = 0\n', r"scale must be a number in \(0, 64\], got 0", id="bad-scale"),
    pytest.param('[[check]]\nkind = "gsm8k"\ndataset = "mmlu"\n', r"dataset must be 'synth' or 'gsm8k'", id="bad-dataset"),
    pytest.param('[[check]]\nkind = "needle"\ndepths = [1.5]\n', r"depths must be .* fractions in \[0, 1\]", id="bad-depth"),
    pytest.param('[[check]]\ntoggles = "all"\n', r"check 1: every \[\[check\]\] needs kind", id="no-kind"),
    pytest.param('', r"expected at least one \[\[check\]\]", id="no-checks"),
    pytest.param('[[check]]\nkind = "golden"\nverison = 2\n', r"unknown key 'verison'", id="typo-in-check"),
])
def test_bad_suite_is_one_line_error(body, match):
    with pytest.raises(UsageError, match=match) as info:
        suites.parse_suite(_suite(body), path="bad.toml")
    assert "\n" not in str(info.value) and str(info.value).startswith("bad.toml")


def test_missing_version_is_refused():
    with pytest.raises(UsageError, match=r"bad.toml: missing 'version' \(expected version = 1\)"):
        suites.parse_suite('[[check]]\nkind = "golden"\n', path="bad.toml")


def test_wrong_version_is_refused():
    with pytest.raises(UsageError, match=r"version must be 1, got 2"):
        suites.parse_suite(_suite('[[check]]\nkind = "golden"\n', "version = 2\n"), path="bad.toml")


def test_unknown_top_level_key_is_refused():
    with pytest.raises(UsageError, match=r"unknown top-level key 'checks'; did you mean 'check'\?"):
        suites.parse_suite('version = 1\n[[checks]]\nkind = "golden"\n', path="bad.toml")


def test_unknown_builtin_suite_suggests():
    with pytest.raises(UsageError, match=r"unknown suite 'premerg'; did you mean 'premerge'\?"):
        suites.load_suite("premerg")


def test_cli_all_with_bad_suite_exits_2_before_any_work(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(_suite('[[check]]\nkind = "diff"\ntoggles = ["prefix_cach"]\n'))
    assert cli.main(["all", "--suite", str(bad), "--report-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "did you mean 'prefix_cache'?" in err
    assert not (tmp_path / "run").exists(), "a rejected suite must not start a run"


def test_selectors_follow_the_registry():
    exact = suites.select_toggles("all-exact", "diff")
    approx = suites.select_toggles("all-approx", "drift")
    for name in exact:
        t = registry.get(name)
        assert t.kind == "optimization" and t.contract.kind == "exact"
    assert approx and all(registry.get(n).contract.kind == "approx" for n in approx)
    assert not any(registry.get(n).kind == "mutant" for n in exact + approx), "mutants only when named"
    gated = suites.select_toggles("all-approx", "gsm8k")
    assert all("gsm8k" in registry.get(n).contract.quality for n in gated)


def test_gate_without_toggles_is_one_reference_unit():
    s = suites.parse_suite(_suite('[[check]]\nkind = "needle"\n'))
    (u,) = suites.expand(s)
    assert u["toggle"] is None and u["kind"] == "needle"


def test_argv_mapping_joins_lists_and_refuses_missing_flags():
    p = argparse.ArgumentParser(prog="k3verify fake")
    p.add_argument("--lengths")
    p.add_argument("--many", nargs="+")
    p.add_argument("--rep", action="append")
    p.add_argument("--fast", action="store_true")
    argv = run_all._argv_for(p, {"--lengths": [512, 1024], "--many": [1, 2], "--rep": ["a", "b"], "--fast": True,
                                 "--absent-but-none": None})
    assert argv == ["--lengths", "512,1024", "--many", "1", "2", "--rep", "a", "--rep", "b", "--fast"]
    with pytest.raises(UsageError, match=r"k3verify fake has no --limit option, which this suite needs"):
        run_all._argv_for(p, {"--limit": 3})


def test_absent_gate_command_is_a_skip_with_reason_not_a_pass(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "k3verify.commands.gsm8k", None)   # as if the command were not built
    unit = suites.expand(suites.parse_suite(_suite('[[check]]\nkind = "gsm8k"\n')))[0]
    ctx = run_all.Context(None, None, tmp_path, lambda m: None)
    (r,) = run_all.run_unit(unit, ctx)
    assert r["status"] == "skip" and "not available in this build" in r["reason"]


def test_gate_arguments_the_command_rejects_are_a_usage_error(tmp_path):
    pytest.importorskip("k3verify.commands.needle")
    unit = suites.expand(suites.parse_suite(_suite('[[check]]\nkind = "needle"\nargs = ["--no-such-flag"]\n')))[0]
    with pytest.raises(UsageError, match=r"check 'needle': k3verify needle rejects"):
        run_all.gate_args(unit, None, tmp_path)


# ---- the pre-check refuses every value the run would refuse (issue 16.8) -----------------

@pytest.mark.parametrize("body, match", [
    pytest.param('[[check]]\nkind = "gsm8k"\nlimit = 0\n', r"limit must be an integer >= 1 \(questions\), got 0",
                 id="gsm8k-limit-0"),
    pytest.param('[[check]]\nkind = "needle"\nlengths = [10]\n',
                 r"lengths \[10\]: length_tokens must be at least \d+ for this case", id="needle-too-short"),
    pytest.param('[[check]]\nkind = "needle"\nlengths = [2000000]\n', r"lengths must be .* token counts in \[1, 1048576\]",
                 id="needle-too-long"),
    pytest.param('[[check]]\nkind = "needle"\nlengths = [1024]\ndepths = []\n', r"depths must be a non-empty list",
                 id="needle-no-depths"),
    pytest.param('[[check]]\nkind = "selftest"\nscale = 100\n', r"scale must be a number in \(0, 64\], got 100",
                 id="selftest-scale"),
    pytest.param('[[check]]\nkind = "diff"\nseed = -1\n', r"seed must be an integer >= 0, got -1", id="negative-seed"),
    pytest.param('[[check]]\nkind = "bench"\nargs = ["repeats=1"]\n', r"repeats must be an integer >= 2", id="bench-repeats"),
    pytest.param('[[check]]\nkind = "bench"\nargs = ["workload=chat"]\n', r"workload must be one of agentic, decode, prefill",
                 id="bench-workload"),
    pytest.param('[[check]]\nkind = "bench"\nargs = ["scale=big"]\n', r"scale must be a number in \(0, 64\], got 'big'",
                 id="bench-scale"),
    pytest.param('[[check]]\nkind = "bench"\nargs = ["repeat=3"]\n', r"expected key=value with key one of .*did you mean 'repeats'",
                 id="bench-unknown-key"),
    pytest.param('[[check]]\nkind = "bench"\nargs = ["--repeats", "3"]\n', r"expected key=value", id="bench-flag-style"),
    pytest.param('[[check]]\nkind = "kvv"\nbase_url = "http://"\n', r"base_url must be an http\(s\) URL with a host",
                 id="kvv-no-host"),
    pytest.param('[[check]]\nkind = "kvv"\nbase_url = "ftp://h/v1"\n', r"base_url must be an http\(s\) URL", id="kvv-ftp"),
    pytest.param('[[check]]\nkind = "gsm8k"\nargs = ["--report-dir", "x"]\n', r"args may not set --report-dir",
                 id="args-report-dir"),
    pytest.param('[[check]]\nkind = "needle"\nargs = ["--json"]\n', r"args may not set --json", id="args-json"),
    pytest.param('[[check]]\nkind = "gsm8k"\nargs = ["--model=k3-mini"]\n', r"args may not set --model", id="args-model"),
    pytest.param('[[check]]\nkind = "gsm8k"\nargs = ["--limit", "5"]\n', r"args may not set --limit: use the suite key 'limit'",
                 id="args-shadow-a-key"),
    pytest.param('[[check]]\nkind = "kvv"\nargs = ["--self"]\n', r"args may not set --self: use the suite key 'base_url'",
                 id="kvv-args-self"),
])
def test_values_the_run_would_refuse_are_refused_by_the_suite(body, match):
    with pytest.raises(UsageError, match=match) as info:
        suites.parse_suite(_suite(body), path="bad.toml")
    assert "\n" not in str(info.value) and str(info.value).startswith("bad.toml: check 1")


@pytest.mark.parametrize("body", [
    '[[check]]\nkind = "gsm8k"\nlimit = 1\n',
    '[[check]]\nkind = "needle"\nlengths = [512, 108000]\n',
    '[[check]]\nkind = "bench"\nargs = ["workload=agentic", "scale=0.5", "repeats=2"]\n',
    '[[check]]\nkind = "kvv"\nbase_url = "http://127.0.0.1:8000/v1"\nargs = ["--only", "params"]\n',
], ids=["limit-1", "needle-512-and-108k", "bench-args", "kvv-url"])
def test_negative_control_the_boundary_values_pass(body):
    suites.parse_suite(_suite(body), path="ok.toml")


@pytest.mark.parametrize("kind, args, match", [
    ("needle", ["--samples", "0"], r"--samples must be >= 1, got 0"),
    ("needle", ["--distractors", "20"], r"length_tokens must be at least \d+"),      # 20 needles do not fit in 1024
    ("needle", ["--min-recall", "2"], r"--min-recall is a fraction"),
    ("gsm8k", ["--num-fewshot", "-1"], r"--num-fewshot must be >= 0"),
    ("gsm8k", ["--margin", "5"], r"--margin is a fraction"),
    ("kvv", ["--max-tokens", "0"], r"--max-tokens must be >= 1"),
    ("kvv", ["--only", "nosuch"], r"--only 'nosuch': no KVV check starts with it"),
], ids=["needle-samples", "needle-distractors", "needle-min-recall", "gsm8k-fewshot", "gsm8k-margin",
        "kvv-max-tokens", "kvv-only"])
def test_gate_arguments_the_run_would_refuse_fail_the_precheck(kind, args, match, tmp_path):
    """The gate command's own validate(args) runs in the pre-check: what its run() refuses first."""
    unit = suites.expand(suites.parse_suite(_suite(f'[[check]]\nkind = "{kind}"\nargs = {args!r}\n'.replace("'", '"'))))[0]
    with pytest.raises(UsageError, match=match):
        run_all.gate_args(unit, None, tmp_path)


def test_all_refuses_a_bad_gate_argument_before_the_first_unit_runs(tmp_path, capsys):
    """The cheap diff unit comes first; the needle unit's bad argument must stop the run before it."""
    path = tmp_path / "s.toml"
    path.write_text(_suite('[[check]]\nkind = "diff"\ntoggles = ["prefill_step_api"]\nscenarios = ["single"]\n'
                           'scale = 0.25\n[[check]]\nkind = "needle"\nlengths = [512]\nargs = ["--samples", "0"]\n'))
    assert cli.main(["all", "--suite", str(path), "--report-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "check 'needle': k3verify needle would refuse it: --samples must be >= 1" in err
    assert not (tmp_path / "run").exists(), "no plan, no unit file: nothing ran"


def test_suite_file_that_is_not_utf8_is_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'version = 1\n# \xff\n[[check]]\nkind = "golden"\n')
    with pytest.raises(UsageError, match=r"bad.toml: a suite is UTF-8 TOML text; byte 0xff at offset 14 is not UTF-8"):
        suites.load_suite(str(bad))


def test_resume_of_a_plan_that_is_not_utf8_is_one_line(tmp_path):
    (tmp_path / "plan.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(UsageError, match=r"cannot resume: no readable plan at"):
        run_all.load_plan(tmp_path)
