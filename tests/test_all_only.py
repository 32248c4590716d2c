"""`k3verify all --only T`: one toggle's units of a suite (with its mutants), the ids and priors of the
whole suite, recorded as a restricted run that sign-off refuses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3verify import cli
from k3verify.errors import UsageError
from k3verify.suites import run_all, shards
from k3verify.suites import suite as suites


def test_only_selects_the_release_suites_own_units_of_the_toggle_and_its_mutant():
    s = suites.load_suite("release", device="cuda")
    units = suites.expand(s)
    picked = run_all.only_units(s, units, ("mla_flash_bf16",))
    want = [u for u in units if u.toggle in ("mla_flash_bf16", "mut_mla_flash_diag_unmasked")]
    assert [u.id for u in picked] == [u.id for u in want] and len(picked) == 8
    assert {u.kind for u in picked} == {"selftest", "drift", "gsm8k", "needle"}
    assert any(u.toggle == "mut_mla_flash_diag_unmasked" for u in picked), "the negative control comes with it"
    # the ids are the full suite's, so the suite's measured priors size them (no CPU prior of 4,470 s)
    assert all(shards.prior_key(u.id) in s.priors for u in picked)


def test_negative_control_without_only_every_unit_of_the_suite_is_planned():
    s = suites.load_suite("release", device="cuda")
    units = suites.expand(s)
    assert len(units) > 100 and any(u.toggle is None or u.toggle == "batched_decode" for u in units)
    assert len(run_all.only_units(s, units, ("mla_flash_bf16",))) < len(units)


def test_a_name_that_is_no_toggle_or_that_the_suite_never_judges_is_refused(tmp_path):
    s = suites.load_suite("release", device="cuda")
    units = suites.expand(s)
    with pytest.raises(UsageError, match="--only 'mla_flash': not a registered toggle"):
        run_all.only_units(s, units, ("mla_flash",))
    one = tmp_path / "one.toml"
    one.write_text('version = 2\n[[check]]\nname = "a"\nkind = "diff"\ntoggles = ["projected_kv_cache"]\n'
                   'scenarios = ["single"]\nscale = 0.25\n')
    small = suites.load_suite(str(one))
    with pytest.raises(UsageError, match="has no unit of it"):
        run_all.only_units(small, suites.expand(small), ("prefix_cache",))


def _two_toggle_suite(tmp_path: Path) -> Path:
    p = tmp_path / "two.toml"
    p.write_text('version = 2\n' + "".join(
        f'[[check]]\nname = "{n}"\nkind = "diff"\ntoggles = ["{t}"]\nscenarios = ["single"]\nscale = 0.25\n'
        for n, t in (("a", "projected_kv_cache"), ("b", "state_offload_roundtrip"))))
    return p


def test_a_restricted_run_judges_only_its_toggle_and_cannot_be_signed(tmp_path):
    run = tmp_path / "run"
    assert cli.main(["all", "--suite", str(_two_toggle_suite(tmp_path)), "--report-dir", str(run),
                     "--only", "state_offload_roundtrip"]) == 0
    report = json.loads((run / "report.json").read_text())
    assert {r["toggle"] for r in report["results"]} == {"state_offload_roundtrip"}
    assert report["suite"]["only"] == ["state_offload_roundtrip"]
    plan = json.loads((run / "plan.json").read_text())
    assert [u["id"] for u in plan["units"]] == ["002-b-state_offload_roundtrip-single"], "the whole suite's id"
    assert cli.main(["signoff", "--report", str(run), "--out", str(tmp_path / "s.md")]) == 1
    assert "a release is signed from a run of the whole suite" in (tmp_path / "s.md").read_text()


def test_negative_control_the_same_suite_unrestricted_signs(tmp_path):
    run = tmp_path / "run"
    assert cli.main(["all", "--suite", str(_two_toggle_suite(tmp_path)), "--report-dir", str(run)]) == 0
    report = json.loads((run / "report.json").read_text())
    assert "only" not in report["suite"]
    assert {r["toggle"] for r in report["results"]} == {"projected_kv_cache", "state_offload_roundtrip"}
    assert cli.main(["signoff", "--report", str(run), "--out", str(tmp_path / "s.md")]) == 0


def test_bad_only_is_exit_2_and_writes_no_run(tmp_path, capsys):
    suite = str(_two_toggle_suite(tmp_path))
    assert cli.main(["all", "--suite", suite, "--report-dir", str(tmp_path / "r1"), "--only", ","]) == 2
    assert "--only: expected a comma-separated list of toggle names" in capsys.readouterr().err
    assert cli.main(["all", "--suite", suite, "--report-dir", str(tmp_path / "r2"), "--only", "prefix_cache"]) == 2
    assert "has no unit of it" in capsys.readouterr().err
    assert cli.main(["all", "--resume", "x", "--only", "prefix_cache"]) == 2
    assert "--only restricts a new run" in capsys.readouterr().err
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()
