"""`k3verify all --jobs N`: a suite's units across N processes, one report (issue 26 item 5: the
checks are dispatch-bound, so a GPU host or the second CPU core needs more than one process)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3verify import cli, kinds
from k3verify.errors import UsageError
from k3verify.suites import shards
from k3verify.suites import suite as suites

# golden too: its hashes are keyed by the thread count, so a worker with other threads than the
# run's would read skip where one process reads pass (measured before the workers kept them)
SUITE = '''version = 2
[[check]]
kind = "diff"
toggles = ["state_offload_roundtrip", "continuous_batching"]
scenarios = ["single", "multi_length"]
scale = 0.25
[[check]]
kind = "golden"
'''


def _suite(tmp: Path) -> Path:
    p = tmp / "jobs.toml"
    p.write_text(SUITE, encoding="utf-8")
    return p


def test_assignment_keeps_a_scenario_in_one_process_and_balances_by_cost():
    units = suites.expand(suites.load_suite("premerge"))
    got = shards.assign(units, 2)
    assert set(got) == {u.id for u in units} and set(got.values()) == {0, 1}
    assert got == shards.assign(units, 2), "every process must compute the same assignment"
    by_group: dict[tuple, set[int]] = {}
    for u in units:
        by_group.setdefault((u.model or "", u.scenario or u.kind), set()).add(got[u.id])
    share = sum(kinds.cost_s(u) for u in units) / 2
    for key, where in by_group.items():
        cost = sum(kinds.cost_s(u) for u in units if (u.model or "", u.scenario or u.kind) == key)
        assert len(where) == 1 or cost > share, f"{key}: a scenario's reference is computed in one process"
    assert set(shards.assign(units, 1).values()) == {0}


def _needle_units(n: int) -> list:
    from k3verify.kinds.base import Unit
    opts = {"toggles": "all-approx", "lengths": [4096, 32768, 108000], "depths": [0.25, 0.75], "seed": 0,
            "samples": 1, "distractors": 0, "fast": False, "min_recall": None}
    return [Unit(id=f"{i:03d}-needle-t{i}", check_index=0, check="needle-grid", kind="needle", toggle=f"t{i}",
                 scenario=None, options=opts) for i in range(n)]


def test_a_group_larger_than_a_fair_share_is_split_across_processes():
    """12 needle units are one (model, kind) group: kept whole they would run serially in one
    process while five idle. Cut into parts, every process gets two."""
    units = _needle_units(12)
    got = shards.assign(units, 6)
    assert sorted(list(got.values()).count(s) for s in range(6)) == [2] * 6
    assert got == shards.assign(units, 6)
    # the control: a group within its share stays in one process
    small = _needle_units(12) + [u for u in suites.expand(suites.load_suite("premerge"))]
    got = shards.assign(small, 2)
    assert len({got[u.id] for u in small if u.kind == "needle"}) == 2          # 12 needles > half
    premerge = [u for u in small if u.kind != "needle"]
    groups = {(u.model or "", u.scenario or u.kind) for u in premerge}
    kept_whole = [k for k in groups if len({got[u.id] for u in premerge if (u.model or "", u.scenario or u.kind) == k}) == 1]
    assert len(kept_whole) == len(groups), "groups within their share are not cut"


@pytest.mark.parametrize("text", ["2/2", "x", "1/0", "-1/3"])
def test_a_bad_shard_is_one_line(text):
    with pytest.raises(UsageError, match=r"--shard expects I/N"):
        shards.parse_shard(text)


def _statuses(run_dir: Path) -> list[tuple]:
    report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    return sorted((r["toggle"], r["scenario"], r["check"], r["status"]) for r in report["results"])


def test_two_jobs_give_the_one_process_report(tmp_path, capsys):
    one, two = tmp_path / "one", tmp_path / "two"
    assert cli.main(["all", "--suite", str(_suite(tmp_path)), "--report-dir", str(one)]) == 0
    capsys.readouterr()
    assert cli.main(["all", "--suite", str(_suite(tmp_path)), "--report-dir", str(two), "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert _statuses(two) == _statuses(one) and len(_statuses(two)) >= 17
    log = (two / "workers" / "shard-1.log").read_text(encoding="utf-8")
    assert "shard 1/2 of" in log and " units run" in log and " 0 units run" not in log, log   # the worker ran its share
    assert "of 5 units run now" in out and "5 of 5" not in out, out  # ... and the parent the rest


def test_negative_control_a_worker_that_dies_loses_no_unit(tmp_path, capsys, monkeypatch):
    def dying(run_id, run_dir, n, extra):
        return [(i, subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]), run_dir / "none.log")
                for i in range(1, n)]
    monkeypatch.setattr(shards, "start_workers", dying)
    run_dir = tmp_path / "run"
    assert cli.main(["all", "--suite", str(_suite(tmp_path)), "--report-dir", str(run_dir), "--jobs", "2"]) == 0
    out, err = capsys.readouterr()
    assert "worker 1/2 exited 3" in err and "its unfinished units run here" in err, err
    assert "5 of 5 units run now" in out and len(_statuses(run_dir)) >= 17, out


def test_jobs_and_shard_are_refused_where_they_make_no_sense(tmp_path, capsys):
    assert cli.main(["all", "--suite", str(_suite(tmp_path)), "--jobs", "0"]) == 2
    assert "--jobs must be an integer in 1..64, got 0" in capsys.readouterr().err
    assert cli.main(["all", "--suite", str(_suite(tmp_path)), "--shard", "0/2"]) == 2
    assert "--shard I/N is a worker of `all --jobs`: it needs --resume RUN_ID" in capsys.readouterr().err


def test_a_shard_that_finishes_early_takes_the_others_unstarted_units(tmp_path):
    """Work stealing: shard 0 alone, its own units done, runs shard 1's too (last first), each
    once; a unit another process has claimed is left to it. Control: without steal it runs only its own."""
    from k3verify.suites import run_all
    from optimized_stack import load_model

    suite = suites.load_suite(_suite(tmp_path))
    model = load_model(None)
    plan = run_all.new_plan(suite, None, model, "steal-test", "test")
    units = run_all.plan_units(plan)
    mine = shards.assign(units, 2)
    own = [u for u in units if mine[u.id] == 0]
    others = [u for u in units if mine[u.id] == 1]
    assert own and len(others) >= 2

    alone = tmp_path / "alone"
    _, ran = run_all.execute(plan, model, alone, only=lambda u: mine[u.id] == 0)
    assert ran == len(own), "control: no steal, only its own units"

    stealing = tmp_path / "stealing"
    run_all.claim_unit(stealing, others[0])          # another process is running this one
    _, ran = run_all.execute(plan, model, stealing, only=lambda u: mine[u.id] == 0, steal=True)
    assert ran == len(units) - 1
    done = {p.stem for p in (stealing / "checks").glob("*.json")}
    assert others[0].id not in done and {u.id for u in others[1:]} <= done
    run_all.clear_claims(stealing)
    assert run_all.claim_unit(stealing, others[0]), "a cleared claim is claimable again"
