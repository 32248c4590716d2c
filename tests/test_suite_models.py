"""One pipeline on every device, at the dims that run (issue 26 item 1, 2): a suite names its
models (`model = "k3-dims"` on a check), `k3verify all` takes --device / --dtype, and a toggle has
one verdict per model. The GPU-only halves (--device cuda) are refused with one line on a CPU."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from k3verify import cli
from k3verify.errors import UsageError
from k3verify.kinds.base import Unit
from k3verify.suites import suite as suites

DIMS_SUITE = '''version = 2
[[check]]
name = "fast-path"
kind = "selftest"
toggles = ["batched_decode"]
{model}
'''


def _write(tmp: Path, model_line: str) -> Path:
    p = tmp / "s.toml"
    p.write_text(DIMS_SUITE.format(model=model_line), encoding="utf-8")
    return p


def test_a_check_names_its_model_and_its_units_carry_it(tmp_path):
    s = suites.load_suite(str(_write(tmp_path, 'model = "k3-dims"')))
    units = suites.expand(s)
    assert units and all(u.model == "k3-dims" and u.id.endswith("-k3-dims") for u in units), [u.id for u in units]
    assert {u.toggle for u in units} >= {"batched_decode", "mut_fast_kda_stale_value_tiles"}
    assert Unit.from_dict(units[0].to_dict()) == units[0]
    plain = suites.expand(suites.load_suite(str(_write(tmp_path, ""))))      # negative control: the run's model
    assert all(u.model is None for u in plain) and "model" not in plain[0].to_dict()


def test_a_model_that_is_not_a_name_is_refused_in_one_line(tmp_path):
    with pytest.raises(UsageError, match=r"check 1: model must be a preset name or a checkpoint directory, got 5"):
        suites.load_suite(str(_write(tmp_path, "model = 5")))


def test_an_unknown_model_is_exit_2_before_any_unit_runs(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = cli.main(["all", "--suite", str(_write(tmp_path, 'model = "k3-dimz"')), "--report-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and "k3-dimz" in err and "k3-dims" in err, err            # did-you-mean
    assert not list((run_dir / "checks").glob("*.json")) if (run_dir / "checks").exists() else True


def test_the_fast_path_is_judged_on_k3_dims_with_a_verdict_of_its_own(tmp_path):
    run_dir = tmp_path / "run"
    code = cli.main(["all", "--suite", str(_write(tmp_path, 'model = "k3-dims"')), "--report-dir", str(run_dir)])
    report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    assert code == 0, report["summary"]
    (v,) = report["verdicts"]
    assert (v["toggle"], v.get("model"), v["verdict"]) == ("batched_decode", "k3-dims", "counted"), v
    assert (run_dir / v["report"]).is_file() and "@k3-dims" in v["report"]
    dims = next(r for r in report["results"] if r["toggle"] == "mut_fast_kda_stale_value_tiles")
    assert dims["status"] == "pass" and dims["caught"] is True and dims["model"] == "k3-dims", dims["reason"]
    nc = report["negative_controls"]
    assert nc["localisation_accuracy"] == 1.0 and nc["localisable"] == nc["caught"] == 3, nc
    # summary.json: the figures a sign-off is read from (issue 26 item 5)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["models"] == ["embedded", "k3-dims"] and (summary["device"], summary["dtype"]) == ("cpu", "float32")
    assert set(summary["seconds_per_kind"]) == {"selftest@k3-dims"} and summary["suite_s"] > 0, summary
    assert summary["exact_verdicts"] == {"k3-dims": {"batched_decode": "counted"}}
    assert summary["mutants"] == {"k3-dims": {"caught": 3, "total": 3}} and summary["counted"] == ["batched_decode@k3-dims"]
    assert summary["localisation"]["localisation_accuracy"] == 1.0
    assert cli.main(["signoff", "--report", str(run_dir), "--out", str(tmp_path / "signoff.md")]) == 0
    assert "checks on their own model (same device; the run's dtype unless the model says `:float32` or " \
           "`:bfloat16`): fast-path on k3-dims" in \
        (tmp_path / "signoff.md").read_text(encoding="utf-8")


def test_summary_seconds_count_only_finished_units(tmp_path):
    from k3verify.suites.summary import unit_seconds
    plan = {"units": [{"id": "001-a", "kind": "selftest"}, {"id": "002-b", "kind": "selftest", "model": "k3-dims"},
                      {"id": "003-c", "kind": "drift"}]}
    (tmp_path / "checks").mkdir()
    (tmp_path / "checks" / "001-a.json").write_text('{"duration_s": 2.5}')
    (tmp_path / "checks" / "002-b.json").write_text('{"duration_s": 1.0}')
    (tmp_path / "checks" / "003-c.json").write_text('{"duration_s": 9')            # cut short: not finished
    assert unit_seconds(plan, tmp_path) == {"selftest": 2.5, "selftest@k3-dims": 1.0}


def test_negative_control_on_k3_mini_the_real_dims_mutant_does_not_apply(tmp_path):
    run_dir = tmp_path / "run"
    cli.main(["all", "--suite", str(_write(tmp_path, "")), "--report-dir", str(run_dir)])
    report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    dims = next(r for r in report["results"] if r["toggle"] == "mut_fast_kda_stale_value_tiles")
    assert dims["status"] == "skip" and "kda_head_dim 16 <= 64" in dims["reason"], dims
    assert "model" not in report["verdicts"][0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("command", [["all"], ["gsm8k", "--dataset", "synth", "--limit", "1"],
                                     ["needle", "--lengths", "512"], ["kvv", "--self"], ["serve", "--port", "0"],
                                     ["generate", "--prompt", "hi"]], ids=lambda c: c[0])
def test_device_cuda_on_a_cpu_machine_is_one_line_and_exit_2(command, capsys):
    assert cli.main([*command, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "--device cuda: torch.cuda.is_available() is False" in err[-1], err


def test_resume_refuses_another_device(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["all", "--suite", str(_write(tmp_path, "")), "--report-dir", str(run_dir),
                     "--dtype", "bfloat16"]) in (0, 1)
    plan = json.loads((run_dir / "plan.json").read_text(encoding="utf-8"))
    assert (plan["device"], plan["dtype"]) == ("cpu", "bfloat16")
    capsys.readouterr()
    assert cli.main(["all", "--resume", plan["run_id"], "--report-dir", str(run_dir), "--dtype", "float32",
                     "--device", "cpu"]) in (0, 1)       # cpu/float32 are the defaults: the plan's are taken
    assert cli.main(["all", "--resume", plan["run_id"], "--report-dir", str(run_dir), "--device", "cuda"]) == 2
