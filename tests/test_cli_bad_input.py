"""Bad input at the CLI's edges: one line on stderr, exit 2, nothing written half-way.

Output locations are refused before any work (so every case here is fast: no model loads),
no run writes into another run's directory, a write that fails after all is one line too."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from k3verify import cli
from k3verify import io as k3io
from k3verify.errors import UsageError
from k3verify.report import build_report, claim_report_dir, write_report

KVV_SCORES = {"OCRBench": 0.88, "MMMU-Pro Vision": 0.81, "BEAM 1M": 0.30, "DeepSWE": 0.67}
# the least each report-writing command needs besides --report-dir
REPORT_COMMANDS = {
    "all": [], "bench": ["--toggle", "prefill_step_api"], "diff": ["--toggle", "prefill_step_api"],
    "gsm8k": [], "kvv": ["--self"], "needle": [], "selftest": [], "spec-sampling": [],
}


def one_line_error(capsys, argv) -> str:
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("k3verify: error: ") and err.count("\n") == 1, err
    return err


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def test_every_report_command_is_covered():
    parser = cli.build_parser(cli.discover_commands())
    sub = next(a for a in parser._actions if a.dest == "command")                 # noqa: SLF001
    have = {n for n, p in sub.choices.items() if "--report-dir" in p._option_string_actions}  # noqa: SLF001
    assert have == set(REPORT_COMMANDS)


# ---- --report-dir that cannot be written ---------------------------------------------------

@pytest.mark.parametrize("name", sorted(REPORT_COMMANDS))
@pytest.mark.parametrize("where", ["regular-file", "under-a-file"])
def test_report_dir_that_is_not_a_directory_is_refused_before_any_work(name, where, tmp_path, capsys):
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory\n")
    target = blocker if where == "regular-file" else blocker / "sub"
    before = _tree(tmp_path)
    err = one_line_error(capsys, [name, *REPORT_COMMANDS[name], "--report-dir", target])
    expected = "expected a directory, got a regular file" if where == "regular-file" else "is a regular file, not a directory"
    assert f"--report-dir {target}: " in err and expected in err
    assert _tree(tmp_path) == before, "nothing written"


@pytest.mark.parametrize("name", sorted(REPORT_COMMANDS))
def test_read_only_report_dir_is_refused_before_any_work(name, tmp_path, capsys):
    if _is_root():
        pytest.skip("running as root: chmod does not stop root's writes (the under-a-file case covers root)")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        err = one_line_error(capsys, [name, *REPORT_COMMANDS[name], "--report-dir", ro / "run"])
    finally:
        ro.chmod(0o755)
    assert "cannot write in" in err and not (ro / "run").exists()


def test_unwritable_report_dir_even_for_root(tmp_path, capsys, monkeypatch):
    """What the read-only case exercises, where chmod cannot (root, ACLs, a read-only mount): the
    probe's own PermissionError becomes the one line."""
    def denied(*a, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(k3io.tempfile, "mkstemp", denied)
    err = one_line_error(capsys, ["diff", "--toggle", "prefill_step_api", "--report-dir", tmp_path / "run"])
    assert err == f"k3verify: error: --report-dir {tmp_path / 'run'}: cannot write in {tmp_path} (Permission denied)\n"


def test_the_writability_probe_leaves_nothing(tmp_path):
    k3io.check_writable_dir(tmp_path / "new" / "deeper")
    k3io.check_writable_dir(tmp_path)
    assert list(tmp_path.iterdir()) == [], "the probe's temp file is removed, no directory created"


def test_a_write_that_fails_after_the_checks_is_one_line(tmp_path, capsys, monkeypatch):
    """The disk fills up between the check and the write: one line, exit 2, no traceback."""
    (tmp_path / "kvv.json").write_text(json.dumps(KVV_SCORES))

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(k3io.os, "fsync", full)
    err = one_line_error(capsys, ["kvv", "import", tmp_path / "kvv.json", "--report-dir", tmp_path / "r"])
    assert "cannot write " in err and "No space left on device" in err
    assert not list((tmp_path / "r").glob("*.json")) and not list((tmp_path / "r").glob(".*tmp"))


def test_an_oserror_anywhere_in_a_command_is_one_line(tmp_path, capsys, monkeypatch):
    import k3verify.commands.toggles as toggles_cmd

    def boom(args):
        raise PermissionError(13, "Permission denied", "/some/cache")

    monkeypatch.setattr(toggles_cmd, "run", boom)
    err = one_line_error(capsys, ["toggles"])
    assert err == "k3verify: error: PermissionError: Permission denied (/some/cache)\n"


# ---- signoff --out ---------------------------------------------------------------------

@pytest.fixture
def report_dir(tmp_path) -> Path:
    """A directory holding a (diff-style) report of run r-1."""
    d = tmp_path / "run"
    write_report(d, build_report("r-1", "k3verify diff --toggle x", {}, []))
    return d


@pytest.mark.parametrize("out, message", [
    ("dir", "expected a file path, got a directory"),
    ("taken/sub.md", "is a regular file, not a directory"),
    ("run/report.json", "that is a file of run r-1"),
], ids=["a-directory", "under-a-file", "the-runs-own-report"])
def test_signoff_out_that_cannot_be_written_is_refused(out, message, report_dir, tmp_path, capsys):
    (tmp_path / "dir").mkdir()
    (tmp_path / "taken").write_text("x")
    before = _tree(tmp_path)
    err = one_line_error(capsys, ["signoff", "--report", report_dir, "--out", tmp_path / out])
    assert message in err
    assert _tree(tmp_path) == before, "the report (and everything else) untouched"


# ---- no run overwrites another run's report ------------------------------------------

def test_diff_refuses_the_directory_of_an_all_run(tmp_path, capsys):
    run = tmp_path / "all-run"
    write_report(run, build_report("all-1", "k3verify all --suite premerge", {}, []))
    (run / "plan.json").write_text(json.dumps({"run_id": "all-1", "command": "k3verify all --suite premerge"}))
    before = _tree(run)
    err = one_line_error(capsys, ["diff", "--toggle", "prefill_step_api", "--report-dir", run])
    assert "already holds run all-1 (k3verify all --suite premerge)" in err
    assert "k3verify all --resume all-1" in err, "an unfinished or finished all run says how to finish it"
    assert _tree(run) == before


@pytest.mark.parametrize("name", sorted(REPORT_COMMANDS))
def test_no_command_writes_into_a_directory_holding_another_runs_report(name, report_dir, capsys):
    before = _tree(report_dir)
    err = one_line_error(capsys, [name, *REPORT_COMMANDS[name], "--report-dir", report_dir])
    assert "already holds run r-1" in err and "no run overwrites another's" in err
    assert _tree(report_dir) == before


def test_write_report_enforces_the_rule_at_write_time_too(report_dir):
    """The same run (resuming, the same id) may rewrite its report; another run may not."""
    write_report(report_dir, build_report("r-1", "k3verify diff --toggle x", {}, []))
    with pytest.raises(UsageError, match=r"already holds run r-1"):
        write_report(report_dir, build_report("r-2", "k3verify diff --toggle y", {}, []))
    assert json.loads((report_dir / "report.json").read_text())["run_id"] == "r-1"
    claim_report_dir(report_dir / "elsewhere", None)          # an empty or absent directory is free


def test_an_unreadable_marker_is_refused_not_overwritten(tmp_path):
    (tmp_path / "report.json").write_bytes(b"\xff not json")
    with pytest.raises(UsageError, match=r"already holds run \? \(an unreadable report.json\)"):
        claim_report_dir(tmp_path, None)


# ---- text arguments ----------------------------------------------------------------------

def test_generate_prompt_that_is_not_utf8(capsys):
    prompt = os.fsdecode(b"caf\xe9 au lait")            # what Python makes of argv bytes in latin-1
    err = one_line_error(capsys, ["generate", "--prompt", prompt])
    assert err == "k3verify: error: --prompt must be UTF-8 text; byte 0xe9 at offset 3 is not UTF-8\n"


def test_suite_file_that_is_not_utf8(tmp_path, capsys):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('version = 1\ndescription = "caf\xe9"\n[[check]]\nkind = "golden"\n'.encode("latin-1"))
    err = one_line_error(capsys, ["all", "--suite", bad, "--report-dir", tmp_path / "run"])
    assert f"{bad}: a suite is UTF-8 TOML text; byte 0xe9 at offset 30 is not UTF-8" in err
    assert not (tmp_path / "run").exists()
