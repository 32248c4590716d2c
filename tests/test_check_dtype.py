"""A suite check's own dtype (`dtype = "float32"` beside its `model`): its model is loaded in that
dtype as a model of its own, with verdicts of its own (`toggle@model:float32`). The GPU release suite
judges approx mutants in fp32 this way, because in bf16 three of them drift no more than legitimate
reorderings (NOTES.md, session 10). Shown here on the CPU: one approx toggle judged in the run's
bf16 (where the CPU has no bf16 budget, so its fp32 budget fails on bf16 noise) and in fp32 (where it
holds and its mutant is caught), in one run."""
from __future__ import annotations

import json

import pytest

from k3verify import cli
from k3verify.errors import UsageError
from k3verify.kinds.base import CheckSpec
from k3verify.kinds import selftest
from k3verify.suites import suite as suites

SUITE = '''version = 2
[[check]]
name = "in-bf16"
kind = "selftest"
model = "k3-mini"
toggles = ["kda_chunked"]
entries = "toggles"

[[check]]
name = "in-fp32"
kind = "selftest"
model = "k3-mini"
dtype = "float32"
toggles = ["kda_chunked"]
'''


def test_model_spec_round_trip():
    assert suites.split_model_spec(suites.model_spec("golden/k3-dims", "float32")) == ("golden/k3-dims", "float32")
    assert suites.split_model_spec("k3-small") == ("k3-small", None)
    assert suites.split_model_spec("dir:with:colons") == ("dir:with:colons", None)     # not a dtype suffix


def test_a_dtype_needs_a_model_and_a_known_name(tmp_path):
    with pytest.raises(UsageError, match="needs the check's own model"):
        suites.parse_suite('version = 2\n[[check]]\nkind = "selftest"\ndtype = "float32"\n')
    with pytest.raises(UsageError, match="dtype must be one of"):
        suites.parse_suite('version = 2\n[[check]]\nkind = "selftest"\nmodel = "k3-mini"\ndtype = "fp16"\n')


def test_entries_keep_toggles_or_mutants():
    def names(entries):
        spec = CheckSpec("selftest", "s", {**selftest.OPTIONS, "toggles": ["kda_chunked"], "entries": entries})
        return {u.toggle for u in selftest.plan(spec)}
    both = names("all")
    assert "kda_chunked" in both and any(n.startswith("mut_") for n in both)
    assert names("toggles") == {"kda_chunked"}
    assert names("mutants") == both - {"kda_chunked"} and names("mutants")
    with pytest.raises(Exception, match="entries"):
        selftest.validate({**selftest.OPTIONS, "entries": "some"})


def test_one_toggle_two_dtypes_two_verdicts(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text(SUITE, encoding="utf-8")
    run_dir = tmp_path / "run"
    cli.main(["all", "--suite", str(p), "--dtype", "bfloat16", "--report-dir", str(run_dir)])
    report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    by = {(r["toggle"], r.get("model")): r for r in report["results"] if r["check"] == "selftest"}
    bf16, fp32 = by[("kda_chunked", "k3-mini")], by[("kda_chunked", "k3-mini:float32")]
    # the same toggle: bf16 noise fails the fp32 budget, fp32 holds it (the dtype took effect)
    assert bf16["status"] == "fail" and fp32["status"] == "pass", (bf16["reason"], fp32["reason"])
    mutants = [r for (t, m), r in by.items() if m == "k3-mini:float32" and t.startswith("mut_")]
    assert mutants and all(r["status"] == "pass" and r["caught"] for r in mutants), [r["reason"] for r in mutants]
    assert not [t for (t, m) in by if m == "k3-mini" and t.startswith("mut_")]     # entries = "toggles"
