"""Atomic writes: new content lands whole, a failure mid-write leaves the old file and no temp files."""

import json
import os

import pytest

from k3verify import io as k3io
from k3verify.io import atomic_write_bytes, atomic_write_json, atomic_write_text


def test_writes_and_creates_parents(tmp_path):
    p = tmp_path / "a" / "b" / "out.txt"
    assert atomic_write_text(p, "héllo\n") == p
    assert p.read_text(encoding="utf-8") == "héllo\n"
    atomic_write_bytes(p, b"\x00\xff")
    assert p.read_bytes() == b"\x00\xff"
    atomic_write_json(p, {"x": [1, 2], "k": "月"})
    assert json.loads(p.read_text(encoding="utf-8")) == {"x": [1, 2], "k": "月"}
    assert os.listdir(p.parent) == ["out.txt"], "no temp files left behind"


def _fail_on_fsync(monkeypatch):
    def boom(fd):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(k3io.os, "fsync", boom)


@pytest.mark.parametrize("writer,payload", [(atomic_write_text, "NEW"), (atomic_write_bytes, b"NEW"), (atomic_write_json, {"new": 1})], ids=["text", "bytes", "json"])
def test_failure_mid_write_keeps_old_file(tmp_path, monkeypatch, writer, payload):
    p = tmp_path / "report.json"
    p.write_text("OLD")
    _fail_on_fsync(monkeypatch)  # fails after the temp file holds the new bytes, before the rename
    with pytest.raises(OSError, match="disk full"):
        writer(p, payload)
    assert p.read_text() == "OLD"
    assert os.listdir(tmp_path) == ["report.json"], "the temp file is cleaned up"


def test_failure_in_replace_keeps_old_file(tmp_path, monkeypatch):
    p = tmp_path / "f.txt"
    p.write_text("OLD")

    def no_replace(src, dst):
        raise KeyboardInterrupt  # even an interrupt must not leave debris

    monkeypatch.setattr(k3io.os, "replace", no_replace)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(p, "NEW")
    assert p.read_text() == "OLD" and os.listdir(tmp_path) == ["f.txt"]


def test_negative_control_plain_write_is_not_atomic(tmp_path, monkeypatch):
    # The same failure during a non-atomic open(..., "w") truncates the old file:
    # this is the hazard the tests above prove atomic_write_* avoids.
    p = tmp_path / "f.txt"
    p.write_text("OLD")
    _fail_on_fsync(monkeypatch)
    with pytest.raises(OSError):
        with open(p, "w") as f:
            f.write("NE")
            f.flush()
            k3io.os.fsync(f.fileno())
    assert p.read_text() != "OLD"


def test_unserializable_json_changes_nothing(tmp_path):
    p = tmp_path / "r.json"
    p.write_text("OLD")
    with pytest.raises(TypeError):
        atomic_write_json(p, {"bad": object()})
    assert p.read_text() == "OLD"


def test_nan_policy(tmp_path):
    p = tmp_path / "r.json"
    atomic_write_json(p, {"x": float("nan")})
    assert "NaN" in p.read_text()
    with pytest.raises(ValueError, match="Out of range float"):
        atomic_write_json(p, {"x": float("inf")}, allow_nan=False)


@pytest.mark.parametrize("writer,payload,match", [(atomic_write_text, b"x", "expects str, got bytes"), (atomic_write_bytes, "x", "expects bytes, got str")], ids=["text-gets-bytes", "bytes-gets-str"])
def test_type_errors(tmp_path, writer, payload, match):
    with pytest.raises(TypeError, match=match):
        writer(tmp_path / "x", payload)


@pytest.fixture
def umask():
    """Set the process umask for one test; restored after."""
    saved = os.umask(0o022)
    os.umask(saved)
    yield lambda mask: os.umask(mask)
    os.umask(saved)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)],
                         ids=["umask022", "umask027", "umask002"])
def test_new_files_get_the_mode_the_umask_gives(tmp_path, umask, mask, mode):
    umask(mask)
    assert k3io.process_umask() == mask
    plain = tmp_path / "plain.txt"
    plain.write_text("x")                                  # what open(path, "w") gives: the reference
    p = atomic_write_text(tmp_path / "report.json", "{}")
    assert oct(p.stat().st_mode & 0o777) == oct(mode) == oct(plain.stat().st_mode & 0o777)


def test_negative_control_mkstemp_alone_is_0600(tmp_path, umask):
    import tempfile
    umask(0o022)
    fd, name = tempfile.mkstemp(dir=tmp_path)
    os.close(fd)
    assert os.stat(name).st_mode & 0o777 == 0o600, "the hazard the fchmod in atomic_write_bytes removes"


def test_a_failed_write_is_a_one_line_write_error(tmp_path):
    from k3verify.errors import UsageError
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(k3io.WriteError, match=r"cannot write .*taken/sub/r.json: .*/taken is a regular file, not a directory") as info:
        atomic_write_text(tmp_path / "taken" / "sub" / "r.json", "x")
    assert isinstance(info.value, OSError) and isinstance(info.value, UsageError), "exit 2 in the CLI, still an OSError"
    with pytest.raises(k3io.WriteError, match=r"cannot create directory .*taken/d: .*/taken is a regular file"):
        k3io.make_dir(tmp_path / "taken" / "d")
    assert sorted(os.listdir(tmp_path)) == ["taken"]


@pytest.mark.parametrize("make, what, match", [
    (lambda d: (d / "f").write_text("x") and d / "f", "--report-dir", r"--report-dir .*/f: expected a directory, got a regular file"),
    (lambda d: (d / "f").write_text("x") and d / "f" / "sub", "--report-dir", r"/f is a regular file, not a directory"),
], ids=["a-file", "under-a-file"])
def test_check_writable_dir(tmp_path, make, what, match):
    from k3verify.errors import UsageError
    with pytest.raises(UsageError, match=match):
        k3io.check_writable_dir(make(tmp_path), what)


def test_check_writable_file(tmp_path):
    from k3verify.errors import UsageError
    with pytest.raises(UsageError, match=r"--out .*: expected a file path, got a directory"):
        k3io.check_writable_file(tmp_path, "--out")
    k3io.check_writable_file(tmp_path / "new" / "signoff.md", "--out")   # creatable: fine, nothing made
    assert os.listdir(tmp_path) == []
