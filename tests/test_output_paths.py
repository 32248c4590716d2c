"""Output locations are refused before any work (issue 26 item 6, issue 29 item 6), and the
report's four files are written as one set.

A report dir that is a dangling symlink, read-only, or on a filesystem with < 16 MiB free, and a
read-only `golden record --dir`, are each refused in one line, exit 2, in under 2 s (the fault
campaign saw them fail after 117-126 s of work). A write that fails in the middle of the report
(a full disk) leaves the complete old set, never half of the new one."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import time
from collections import namedtuple
from pathlib import Path

import pytest

from k3verify import cli
from k3verify import io as kio
from k3verify.errors import UsageError
from k3verify.report import REPORT_FILES, build_report, write_report

Usage = namedtuple("Usage", "total used free")


def _refused_fast(capsys, argv) -> str:
    t0 = time.perf_counter()
    code = cli.main([str(a) for a in argv])
    took = time.perf_counter() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert took < 2.0, f"refused after {took:.1f} s: before any work means before the model loads"
    return err[0]


@contextlib.contextmanager
def read_only(path: Path, monkeypatch):
    """`path` read-only: chmod, and (root ignores modes) mkstemp under it failing with EROFS."""
    real = tempfile.mkstemp

    def mkstemp(*a, dir=None, **kw):
        if dir is not None and Path(dir).resolve().is_relative_to(path.resolve()):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*a, dir=dir, **kw)
    path.chmod(0o555)
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    try:
        yield path
    finally:
        monkeypatch.undo()
        path.chmod(0o755)


# ---- refused before any work ---------------------------------------------------------------------

def test_a_dangling_symlink_report_dir_is_refused_at_once(tmp_path, capsys):
    link = tmp_path / "reports"
    link.symlink_to(tmp_path / "gone")
    err = _refused_fast(capsys, ["diff", "--toggle", "prefill_step_api", "--report-dir", link])
    assert f"--report-dir {link}: {link} is a symlink to {tmp_path / 'gone'}, which does not exist" in err, err


def test_a_dangling_symlink_above_the_report_dir_is_refused(tmp_path, capsys):
    link = tmp_path / "reports"
    link.symlink_to(tmp_path / "gone")
    err = _refused_fast(capsys, ["diff", "--toggle", "prefill_step_api", "--report-dir", link / "run-1"])
    assert "is a symlink to" in err and "which does not exist" in err, err


def test_a_read_only_report_dir_is_refused_at_once(tmp_path, capsys, monkeypatch):
    (tmp_path / "ro").mkdir()
    with read_only(tmp_path / "ro", monkeypatch):
        err = _refused_fast(capsys, ["diff", "--toggle", "prefill_step_api", "--report-dir", tmp_path / "ro"])
    assert "cannot write in" in err and "Read-only file system" in err, err


def test_a_report_dir_on_a_nearly_full_filesystem_is_refused_at_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 * 2**30, 10 * 2**30 - 2**20, 2**20))
    err = _refused_fast(capsys, ["diff", "--toggle", "prefill_step_api", "--report-dir", tmp_path / "r"])
    assert "only 1.0 MiB free on its filesystem" in err and "a run needs at least 16 MiB" in err, err


def test_a_read_only_golden_record_dir_is_refused_at_once(tmp_path, capsys, monkeypatch):
    (tmp_path / "golden").mkdir()
    with read_only(tmp_path / "golden", monkeypatch):
        err = _refused_fast(capsys, ["golden", "record", "--reason", "r", "--dir", tmp_path / "golden"])
    assert err.startswith(f"k3verify: error: --dir {tmp_path / 'golden'}: cannot write in"), err


def test_negative_control_a_writable_dir_with_room_is_accepted(tmp_path, monkeypatch):
    kio.check_writable_dir(tmp_path / "new" / "run")             # creatable under a writable parent
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(2**40, 2**40 - 17 * 2**20, 17 * 2**20))
    kio.check_writable_dir(tmp_path)                              # 17 MiB free: enough
    link = tmp_path / "to-dir"
    link.symlink_to(tmp_path)
    kio.check_writable_dir(link)                                  # a symlink to a directory is fine
    with pytest.raises(UsageError, match="only 15.0 MiB free"):   # and the same rule can refuse
        monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(2**40, 2**40, 15 * 2**20))
        kio.check_writable_dir(tmp_path)


# ---- the report's files are one set ---------------------------------------------------------------

def _row(reason: str) -> dict:
    return {"toggle": "prefill_step_api", "kind": "optimization", "contract": "exact", "check": "logits",
            "scenario": "single", "status": "pass", "reason": reason, "findings": [], "first_divergence": None,
            "localization": None, "caught": None, "duration_s": 0.1, "speedup": None}


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _fail_on_call(n: int, real, exc: OSError):
    calls = {"n": 0}

    def wrapped(*a, **kw):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc
        return real(*a, **kw)
    return wrapped


@pytest.fixture
def old_set(tmp_path) -> tuple[Path, dict[str, bytes]]:
    d = tmp_path / "run"
    write_report(d, build_report("run-1", "k3verify diff", {}, [_row("old")]))
    before = _snapshot(d)
    assert set(before) == set(REPORT_FILES.values())
    return d, before


def test_a_third_write_that_fails_replaces_nothing(old_set, monkeypatch):
    d, before = old_set
    monkeypatch.setattr(kio, "_write_temp", _fail_on_call(3, kio._write_temp,
                                                          OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(kio.WriteError, match="No space left on device; no file of the set was replaced"):
        write_report(d, build_report("run-1", "k3verify diff", {}, [_row("new")]))
    assert _snapshot(d) == before, "the complete old set, no temp file left"


def test_a_rename_that_fails_puts_the_old_files_back(old_set, monkeypatch):
    d, before = old_set
    monkeypatch.setattr(kio.os, "replace", _fail_on_call(3, os.replace, OSError(errno.EIO, "Input/output error")))
    with pytest.raises(kio.WriteError, match="Input/output error"):
        write_report(d, build_report("run-1", "k3verify diff", {}, [_row("new")]))
    monkeypatch.undo()
    assert _snapshot(d) == before, "two renamed files were put back: the complete old set"


def test_negative_control_without_a_fault_the_new_set_is_complete(old_set):
    d, before = old_set
    write_report(d, build_report("run-1", "k3verify diff", {}, [_row("new")]))
    after = _snapshot(d)
    assert set(after) == set(before) and after["report.json"] != before["report.json"]
    assert b'"reason": "new"' in after["report.json"] and b'"reason": "old"' in before["report.json"]


def test_negative_control_file_by_file_writes_would_leave_half_a_set(old_set, monkeypatch):
    """What the test above catches: the former write, file by file, with the third one failing."""
    d, before = old_set
    new = {"report.md": b"new md", "report.html": b"new html", "junit.xml": b"new junit", "report.json": b"{}"}
    monkeypatch.setattr(kio, "_replace", _fail_on_call(3, kio._replace, OSError(errno.ENOSPC, "No space left")))
    with pytest.raises(kio.WriteError):
        for name, data in new.items():
            kio.atomic_write_bytes(d / name, data)
    after = _snapshot(d)
    assert after != before and any(after[n] == new[n] for n in new), "a mixed set: new md and html, old rest"
