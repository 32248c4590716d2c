"""scripts/pack_run.sh, the way a device run comes back (scripts/gpu_all.sh): the small resume kit
alone is enough for `k3verify all --resume` to finish the run, the whole run goes in a second
archive with the logs, and a directory with no run is refused (exit 2). The third H200 release run
could not be resumed because its single 30 MB archive did not come back."""
from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

from k3verify import cli

ROOT = Path(__file__).resolve().parents[1]
SUITE = '''version = 2
[[check]]
kind = "selftest"
toggles = ["batched_decode"]
'''


def _pack(out: Path, *logs: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "pack_run.sh"), str(out), *logs],
                          capture_output=True, text=True)


def test_the_resume_kit_alone_finishes_the_run(tmp_path):
    out, suite = tmp_path / "out", tmp_path / "s.toml"
    suite.write_text(SUITE, encoding="utf-8")
    assert cli.main(["all", "--suite", str(suite), "--report-dir", str(out / "run")]) == 0
    run_id = json.loads((out / "run" / "plan.json").read_text())["run_id"]
    done = sorted(p.name for p in (out / "run" / "checks").glob("*.json"))
    (out / "run" / "checks" / done[-1]).unlink()                # one unit left for the next call
    (out / "all.log").write_text("log", encoding="utf-8")
    (out / "warm-16x4.log").write_text("warm", encoding="utf-8")
    r = _pack(out, "all.log", "warm-*.log", "signoff.log")      # signoff.log absent: skipped
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["resume.tar.gz", "run.tar.gz"]
    with tarfile.open(out / "run.tar.gz") as t:
        names = t.getnames()
    assert {"all.log", "warm-16x4.log", "run/report.html"} <= set(names)
    with tarfile.open(out / "resume.tar.gz") as t:
        kit = t.getnames()
        assert "run/report.html" not in kit and "run/plan.json" in kit
        t.extractall(tmp_path / "next")
    # the next call: only the kit came back, and it finishes the run
    assert cli.main(["all", "--resume", run_id, "--report-dir", str(tmp_path / "next" / "run")]) == 0
    assert sorted(p.name for p in (tmp_path / "next" / "run" / "checks").glob("*.json")) == done
    report = json.loads((tmp_path / "next" / "run" / "report.json").read_text())
    assert report["summary"]["verdict"] == "pass"


def test_a_directory_without_a_run_is_refused(tmp_path):
    r = _pack(tmp_path)
    assert r.returncode == 2 and "no run/plan.json" in r.stderr
    assert not (tmp_path / "run.tar.gz").exists()
