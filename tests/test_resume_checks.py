"""`k3verify all --resume RUN_ID` reuses only what it can verify (issue 29 item 5): a checks file
whose model sha256, suite (name + content hash) or plan differ from the run's is refused with one
line and exit 2, and so is a RUN_ID that is not the run the directory holds. A genuine resume
still finishes (negative control).

The units' work is replaced by a stub (kinds.run): what is judged here is which files a resume
accepts, not the checks' numerics."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from k3verify import cli
from k3verify.io import atomic_write_json
from k3verify.report import load_report
from k3verify.suites import run_all
from k3verify.suites import suite as suites
from k3verify.verdict.result import Result, Subject
from optimized_stack import load_model

TOGGLES = ("state_offload_roundtrip", "projected_kv_cache")


class _Killed(Exception):
    pass


def _suite(tmp_path: Path) -> Path:
    body = "version = 2\ndescription = \"tiny\"\n" + "".join(
        f'[[check]]\nname = "d-{t}"\nkind = "diff"\ntoggles = ["{t}"]\nscenarios = ["single"]\nscale = 0.25\n'
        for t in TOGGLES)
    path = tmp_path / "tiny.toml"
    path.write_text(body)
    return path


@pytest.fixture(autouse=True)
def stub_units(monkeypatch):
    """Every unit 'runs' in no time: four passing exact rows."""
    def run(unit, ctx):
        return [Result.passed(Subject.of(unit.toggle), c, "bit-identical (3 compared)", scenario=unit.scenario)
                for c in ("tokens", "logits", "kda_state", "mla_rows")]
    monkeypatch.setattr(run_all.kinds, "run", run)


@pytest.fixture(scope="module")
def models():
    return {None: load_model(), "k3-mini": load_model("k3-mini")}


def _interrupted(tmp_path: Path, models, run_id: str, model_arg: str | None = None) -> tuple[Path, dict]:
    """A run of the tiny suite killed after its first unit's checks file is on disk."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    suite = suites.load_suite(str(_suite(tmp_path)))
    run_dir = tmp_path / run_id
    plan = run_all.new_plan(suite, model_arg, models[model_arg], run_id, "k3verify all --suite tiny")

    def die(unit):
        raise _Killed(unit.id)
    with pytest.raises(_Killed):
        run_all.execute(plan, models[model_arg], run_dir, after_unit=die)
    return run_dir, plan


def _first_checks_file(run_dir: Path) -> Path:
    (p,) = (run_dir / "checks").glob("*.json")
    return p


def _one_line_exit_2(capsys, argv) -> str:
    t0 = time.perf_counter()
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert time.perf_counter() - t0 < 30, "refused before any unit runs"
    return err[0]


def test_negative_control_a_genuine_resume_finishes(tmp_path, models, capsys):
    run_dir, plan = _interrupted(tmp_path, models, "r-a")
    assert json.loads(_first_checks_file(run_dir).read_text())["provenance"] == run_all.provenance(plan)
    assert cli.main(["all", "--resume", "r-a", "--report-dir", str(run_dir)]) == 0
    assert "1 of 2 units run now" in capsys.readouterr().out
    assert load_report(run_dir)["summary"]["passed"] == 8


def test_negative_control_resume_by_directory_path_still_works(tmp_path, models, capsys):
    run_dir, _ = _interrupted(tmp_path, models, "r-a")
    assert cli.main(["all", "--resume", str(run_dir)]) == 0


def test_a_run_id_that_is_not_the_directorys_run_is_refused(tmp_path, models, capsys):
    run_dir, _ = _interrupted(tmp_path, models, "r-a")
    err = _one_line_exit_2(capsys, ["all", "--resume", "r-other", "--report-dir", run_dir])
    assert f"--resume r-other: {run_dir} holds run 'r-a', not 'r-other'" in err, err
    assert not (run_dir / "report.json").exists()


def test_a_checks_file_from_another_models_run_is_refused(tmp_path, models, capsys):
    run_dir, plan = _interrupted(tmp_path / "a", models, "r-a")
    other_dir, other = _interrupted(tmp_path / "b", models, "r-b", model_arg="k3-mini")
    assert other["model_id"] != plan["model_id"], "the two runs are on different weights"
    mine = _first_checks_file(run_dir)
    shutil.copyfile(_first_checks_file(other_dir), mine)          # copied in from the other run
    err = _one_line_exit_2(capsys, ["all", "--resume", "r-a", "--report-dir", run_dir])
    assert f"cannot resume: {mine} is not this run's: model {other['model_id'][:30]} (this run: " \
           f"{plan['model_id'][:30]})" in err, err
    assert not (run_dir / "report.json").exists(), "no report mixes two models"


@pytest.mark.parametrize("field, edit, named", [
    pytest.param("suite", lambda p: p["suite"].update(sha256="0" * 64), "suite content sha256 000000000000",
                 id="suite-content"),
    pytest.param("suite", lambda p: p["suite"].update(name="release"), "suite 'release' (this run: 'tiny')",
                 id="suite-name"),
    pytest.param("plan", lambda p: p.update(plan_sha256="f" * 64), "plan sha256 ffffffffffff", id="plan"),
    pytest.param("none", None, "it records no model, suite or plan", id="no-provenance"),
])
def test_a_checks_file_of_another_suite_or_plan_is_refused(tmp_path, models, capsys, field, edit, named):
    run_dir, _ = _interrupted(tmp_path, models, "r-a")
    path = _first_checks_file(run_dir)
    data = json.loads(path.read_text())
    if edit is None:
        del data["provenance"]
    else:
        edit(data["provenance"])
    atomic_write_json(path, data)
    err = _one_line_exit_2(capsys, ["all", "--resume", "r-a", "--report-dir", run_dir])
    assert named in err, err
