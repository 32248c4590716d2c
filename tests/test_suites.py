"""Suite files: loading, strict validation with "did you mean" (each kind's own validation),
expansion into units through the check-kind registry. No model runs here: the whole file is fast."""
from __future__ import annotations

import pytest

from k3verify import cli, kinds
from k3verify.errors import UsageError
from k3verify.kinds.base import CheckSpec, Context, select_toggles
from k3verify.suites import run_all
from k3verify.suites import suite as suites
from optimized_stack import toggles as registry

GOOD = """
version = 2
description = "t"
[[check]]
kind = "diff"
toggles = ["prefix_cache"]
scenarios = ["single"]
scale = 0.25
"""


def _suite(body: str, header: str = "version = 2\n") -> str:
    return header + body


@pytest.mark.parametrize("name, kinds", [
    ("premerge", {"selftest", "drift", "golden", "gsm8k", "needle", "kvv"}),
    ("release", {"selftest", "diff", "drift", "golden", "gsm8k", "needle", "kvv", "bench", "spec_sampling"}),
])
def test_builtin_suites_load_and_expand(name, kinds):
    s = suites.load_suite(name)
    units = suites.expand(s)
    assert s.version == suites.SUITE_VERSION and s.description
    assert {u.kind for u in units} == kinds
    ids = [u.id for u in units]
    assert len(ids) == len(set(ids)), "unit ids must be unique: they name the files a resumed run looks for"


def test_good_suite_parses_with_defaults_filled():
    s = suites.parse_suite(GOOD, path="good.toml")
    (c,) = s.checks
    assert c.kind == "diff" and c.options["seed"] == 0 and c.options["scale"] == 0.25
    (u,) = suites.expand(s)
    assert (u.toggle, u.scenario, u.id) == ("prefix_cache", "single", "001-diff-prefix_cache-single")


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
    with pytest.raises(UsageError, match=r"bad.toml: missing 'version' \(expected version = 2\)"):
        suites.parse_suite('[[check]]\nkind = "golden"\n', path="bad.toml")


def test_wrong_version_is_refused():
    with pytest.raises(UsageError, match=r"version must be 2, got 3"):
        suites.parse_suite(_suite('[[check]]\nkind = "golden"\n', "version = 3\n"), path="bad.toml")


def test_a_version_1_suite_is_refused_with_what_moved():
    v1 = '[[check]]\nkind = "gsm8k"\nargs = ["--num-fewshot", "0"]\n'
    with pytest.raises(UsageError, match=r"version must be 2, got 1; version 1 passed options as command-line words "
                                         r"in `args`; version 2 names each as a key \(gsm8k: num_fewshot"):
        suites.parse_suite(_suite(v1, "version = 1\n"), path="old.toml")


def test_unknown_top_level_key_is_refused():
    with pytest.raises(UsageError, match=r"unknown top-level key 'checks'; did you mean 'check'\?"):
        suites.parse_suite('version = 2\n[[checks]]\nkind = "golden"\n', path="bad.toml")


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
    exact = select_toggles("all-exact", "diff")
    approx = select_toggles("all-approx", "drift")
    for name in exact:
        t = registry.get(name)
        assert t.kind == "optimization" and t.contract.kind == "exact"
    assert approx and all(registry.get(n).contract.kind == "approx" for n in approx)
    assert not any(registry.get(n).kind == "mutant" for n in exact + approx), "mutants only when named"
    gated = select_toggles("all-approx", "gsm8k")
    assert all("gsm8k" in registry.get(n).contract.quality for n in gated)


def test_gate_without_toggles_is_one_reference_unit():
    s = suites.parse_suite(_suite('[[check]]\nkind = "needle"\n'))
    (u,) = suites.expand(s)
    assert u.toggle is None and u.kind == "needle"


def test_the_invariance_kind_off_the_gpu_and_interpreter_is_a_skip_saying_where_it_runs(monkeypatch):
    """The invariance check needs the profile's kernels (CUDA, or Triton's interpreter): elsewhere a
    skip with the reason, never a pass."""
    from optimized_stack import load_model
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    (unit,) = suites.expand(suites.parse_suite(_suite('[[check]]\nkind = "invariance"\n')))
    (r,) = kinds.run(unit, Context(load_model("k3-mini")))
    assert r.status == "skip" and "Triton's interpreter" in r.reason


def test_the_registry_refuses_an_unknown_kind_with_a_suggestion():
    with pytest.raises(UsageError, match=r"unknown check kind 'benhc'; did you mean 'bench'\?"):
        kinds.get("benhc")


def test_a_command_and_a_suite_plan_the_same_units():
    """One path: the spec a command builds and the one a suite reads give the same units."""
    from_suite = suites.expand(suites.parse_suite(_suite('[[check]]\nkind = "diff"\ntoggles = ["prefix_cache"]\n')))
    from_command = kinds.plan(CheckSpec("diff", options={"toggles": ["prefix_cache"]}))
    assert [(u.toggle, u.scenario) for u in from_suite] == [(u.toggle, u.scenario) for u in from_command]
    assert [u.scenario for u in from_command][:3] == ["single", "multi_length", "boundaries"]


def test_an_option_error_is_spelled_as_a_flag_on_the_command_line_and_as_a_key_in_a_suite():
    with pytest.raises(UsageError, match=r"^--max-new-tokens must be an integer >= 1, got 0$"):
        CheckSpec("gsm8k", options={"max_new_tokens": 0})
    with pytest.raises(UsageError, match=r"^s.toml: check 1 \(gsm8k\): max_new_tokens must be an integer >= 1, got 0$"):
        suites.parse_suite(_suite('[[check]]\nkind = "gsm8k"\nmax_new_tokens = 0\n'), path="s.toml")


# ---- the suite refuses every value the run would refuse (issue 16.8): the kind's own validation ---

@pytest.mark.parametrize("body, match", [
    pytest.param('[[check]]\nkind = "gsm8k"\nlimit = 0\n', r"limit must be an integer >= 1 \(questions\), got 0",
                 id="gsm8k-limit-0"),
    pytest.param('[[check]]\nkind = "needle"\nlengths = [10]\n',
                 r"lengths \[10\] with 0 distractors: length_tokens must be at least \d+ for this case",
                 id="needle-too-short"),
    pytest.param('[[check]]\nkind = "needle"\nlengths = [2000000]\n', r"lengths must be .* token counts in \[1, 1048576\]",
                 id="needle-too-long"),
    pytest.param('[[check]]\nkind = "needle"\nlengths = [1024]\ndepths = []\n', r"depths must be a non-empty list",
                 id="needle-no-depths"),
    pytest.param('[[check]]\nkind = "needle"\nsamples = 0\n', r"samples must be an integer >= 1, got 0",
                 id="needle-samples"),
    pytest.param('[[check]]\nkind = "needle"\ndistractors = 20\n', r"length_tokens must be at least \d+",
                 id="needle-distractors"),     # 20 needles do not fit in 1024 tokens
    pytest.param('[[check]]\nkind = "needle"\nmin_recall = 2\n', r"min_recall is a fraction", id="needle-min-recall"),
    pytest.param('[[check]]\nkind = "selftest"\nscale = 100\n', r"scale must be a number in \(0, 64\], got 100",
                 id="selftest-scale"),
    pytest.param('[[check]]\nkind = "diff"\nseed = -1\n', r"seed must be an integer >= 0, got -1", id="negative-seed"),
    pytest.param('[[check]]\nkind = "bench"\nrepeats = 1\n', r"repeats must be an integer >= 2", id="bench-repeats"),
    pytest.param('[[check]]\nkind = "bench"\nworkload = "chat"\n', r"workload must be one of agentic, decode, prefill",
                 id="bench-workload"),
    pytest.param('[[check]]\nkind = "bench"\nscale = "big"\n', r"scale must be a number in \(0, 64\], got 'big'",
                 id="bench-scale"),
    pytest.param('[[check]]\nkind = "bench"\nrepeat = 3\n', r"unknown key 'repeat'; did you mean 'repeats'", id="bench-typo"),
    pytest.param('[[check]]\nkind = "gsm8k"\nnum_fewshot = -1\n', r"num_fewshot must be an integer >= 0",
                 id="gsm8k-fewshot"),
    pytest.param('[[check]]\nkind = "gsm8k"\nmargin = 5\n', r"margin is a fraction", id="gsm8k-margin"),
    pytest.param('[[check]]\nkind = "gsm8k"\nsmoke = "yes"\n', r"smoke must be true or false", id="gsm8k-smoke"),
    pytest.param('[[check]]\nkind = "kvv"\nbase_url = "http://"\n', r"base_url must be an http\(s\) URL with a host",
                 id="kvv-no-host"),
    pytest.param('[[check]]\nkind = "kvv"\nbase_url = "ftp://h/v1"\n', r"base_url must be an http\(s\) URL", id="kvv-ftp"),
    pytest.param('[[check]]\nkind = "kvv"\nmax_tokens = 0\n', r"max_tokens must be an integer >= 1", id="kvv-max-tokens"),
    pytest.param('[[check]]\nkind = "kvv"\nonly = ["nosuch"]\n', r"only 'nosuch': no KVV check starts with it",
                 id="kvv-only"),
    pytest.param('[[check]]\nkind = "gsm8k"\nargs = ["--limit", "5"]\n', r"unknown key 'args'", id="args-is-gone"),
])
def test_values_the_run_would_refuse_are_refused_by_the_suite(body, match):
    with pytest.raises(UsageError, match=match) as info:
        suites.parse_suite(_suite(body), path="bad.toml")
    assert "\n" not in str(info.value) and str(info.value).startswith("bad.toml: check 1")


@pytest.mark.parametrize("body", [
    '[[check]]\nkind = "gsm8k"\nlimit = 1\n',
    '[[check]]\nkind = "needle"\nlengths = [512, 108000]\n',
    '[[check]]\nkind = "bench"\nworkload = "agentic"\nscale = 0.5\nrepeats = 2\n',
    '[[check]]\nkind = "kvv"\nbase_url = "http://127.0.0.1:8000/v1"\nonly = ["params"]\n',
], ids=["limit-1", "needle-512-and-108k", "bench-keys", "kvv-url"])
def test_negative_control_the_boundary_values_pass(body):
    suites.parse_suite(_suite(body), path="ok.toml")


def test_all_refuses_a_bad_gate_value_before_the_first_unit_runs(tmp_path, capsys):
    """The cheap diff unit comes first; the needle check's bad value must stop the run before it."""
    path = tmp_path / "s.toml"
    path.write_text(_suite('[[check]]\nkind = "diff"\ntoggles = ["prefill_step_api"]\nscenarios = ["single"]\n'
                           'scale = 0.25\n[[check]]\nkind = "needle"\nlengths = [512]\nsamples = 0\n'))
    assert cli.main(["all", "--suite", str(path), "--report-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "check 2 (needle): samples must be an integer >= 1, got 0" in err
    assert not (tmp_path / "run").exists(), "no plan, no unit file: nothing ran"


def test_suite_file_that_is_not_utf8_is_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'version = 1\n# \xff\n[[check]]\nkind = "golden"\n')
    with pytest.raises(UsageError, match=r"bad.toml: a suite is UTF-8 TOML text; byte 0xff at offset 14 is not UTF-8"):
        suites.load_suite(str(bad))


def test_resume_of_a_plan_of_another_version_is_refused_in_one_line(tmp_path):
    (tmp_path / "plan.json").write_text('{"format": "k3verify.all-plan", "version": 1, "units": []}')
    with pytest.raises(UsageError, match=r"expected k3verify.all-plan v2, got 'k3verify.all-plan' v1 \(a plan written "
                                         r"by another k3verify: run the suite again\)"):
        run_all.load_plan(tmp_path)


def test_resume_of_a_plan_that_is_not_utf8_is_one_line(tmp_path):
    (tmp_path / "plan.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(UsageError, match=r"cannot resume: no readable plan at"):
        run_all.load_plan(tmp_path)
