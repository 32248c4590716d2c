"""perf/unit_times: a run directory's units as rows, longest first, GSM8K's engine seconds beside
them; a directory that is not a run, or a unit file that is not one, is one line and exit 2."""
from __future__ import annotations

import json

from k3verify.perf import unit_times


def _unit(run, uid, check, seconds, statuses, engine=None):
    results = [{"status": s} for s in statuses]
    if engine:
        results[0].update(engine={"timing": engine}, reference_source="run_dir")
    (run / "checks").mkdir(parents=True, exist_ok=True)
    (run / "checks" / f"{uid}.json").write_text(json.dumps(
        {"unit": {"id": uid, "check": check}, "results": results, "duration_s": seconds}))


def test_rows_longest_first_with_the_worst_status_and_gsm8k_timing(tmp_path, capsys):
    _unit(tmp_path, "001-exact-a", "exact", 12.0, ["pass", "skip"])
    _unit(tmp_path, "002-gsm8k-b", "gsm8k", 99.5, ["pass", "inconclusive"],
          {"prefill_s": 60.25, "decode_s": 30.0, "prefill_tokens": 1000})
    _unit(tmp_path, "003-exact-c", "exact", 40.0, ["pass", "fail", "error"])
    assert unit_times.main([str(tmp_path)]) == 0
    lines = (tmp_path / "units.tsv").read_text().splitlines()
    assert lines[0].split("\t") == list(unit_times.COLUMNS)
    assert [ln.split("\t")[:3] for ln in lines[1:]] == [
        ["002-gsm8k-b", "inconclusive", "99.5"], ["003-exact-c", "error", "40.0"], ["001-exact-a", "skip", "12.0"]]
    assert lines[1].split("\t")[3:] == ["60.2", "30.0", "1000", "run_dir"]
    assert lines[3].split("\t")[3:] == ["", "", "", ""], "a unit without engine timing has blank columns"
    out = capsys.readouterr().out
    assert "3 units, 152 s of unit work" in out and "exact" in out


def test_not_a_run_dir_and_a_foreign_file_are_exit_2(tmp_path, capsys):
    assert unit_times.main([str(tmp_path / "missing")]) == 2
    assert "no checks/ directory" in capsys.readouterr().err
    (tmp_path / "checks").mkdir()
    assert unit_times.main([str(tmp_path)]) == 2
    assert "no finished units" in capsys.readouterr().err
    (tmp_path / "checks" / "x.json").write_text('{"hello": 1}')
    assert unit_times.main([str(tmp_path)]) == 2
    assert "not a unit file" in capsys.readouterr().err
    (tmp_path / "checks" / "x.json").write_text('{"unit": ')
    assert unit_times.main([str(tmp_path)]) == 2
    assert "unreadable unit file" in capsys.readouterr().err
    assert not (tmp_path / "units.tsv").exists(), "nothing written on bad input"
