"""Every file reader refuses hostile input in one line (exit 2), never with a traceback.

Issue 29's fault campaign: nesting ~1,000 deep (RecursionError), an integer over 4,300
digits (Python's int-string ValueError) and bytes that are not UTF-8 each gave a
traceback from one of seven readers. The bounds live in optimized_stack/safe_load.py;
here each reader is held to them with the same three hostile files, each hostile file is
first shown to break the unbounded parser (the negative control: without the bound the
test input really does crash), and a valid file of each kind still loads.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from safetensors import safe_open

from k3verify.cli import main
from k3verify.compare import golden
from k3verify.errors import UsageError
from k3verify.quality.evals.kvv_ranges import import_kvv_results
from k3verify.report import load_report, write_report
from k3verify.suites import run_all
from k3verify.suites.suite import load_suite
from optimized_stack import K3Config
from optimized_stack.checkpoint import read_state_dict
from optimized_stack.errors import CheckpointError, ConfigError, K3Error
from optimized_stack.safe_load import MAX_DEPTH, MAX_INT_DIGITS, loads_json, loads_toml

REPO = Path(__file__).resolve().parents[1]
MINI = REPO / "golden" / "k3-mini"
DEEP = 5000                 # far past the parsers' recursion limit (~1,000)
HUGE = 5000                 # digits: past Python's 4,300-digit int-string limit

# defect -> (JSON bytes, the one-line message expected after "<file>: ")
JSON_DEFECTS = {
    "deep": (b'{"a": {"b": ' + b"[" * DEEP + b"]" * DEEP + b"}}",
             rf"nested deeper than {MAX_DEPTH} levels at \$\.a\.b\[0\]\[0\]"),
    "huge-int": (b'{"a": [1, ' + b"9" * HUGE + b"]}", rf"an integer of 5,000 digits at \$\.a\[1\] \(more than 300\)"),
    "not-utf8": (b'{"a": "caf\xe9"}', r"not UTF-8 text; byte 0xe9 at offset 10 is not UTF-8"),
}
TOML_DEFECTS = {
    "deep": (b"version = 2\nx = " + b"[" * DEEP + b"]" * DEEP + b"\n",
             rf"nested deeper than {MAX_DEPTH} levels at line 2"),
    "huge-int": (b"version = 2\nx = " + b"9" * HUGE + b"\n", r"a number of 5,000 digits at line 2 \(more than 300\)"),
    "not-utf8": (b'version = 2\ndescription = "caf\xe9"\n', r"a suite is UTF-8 TOML text; byte 0xe9 at offset 30 is not UTF-8"),
}


@pytest.mark.parametrize("defect", ["deep", "huge-int"])
def test_negative_control_the_hostile_files_break_the_unbounded_parsers(defect):
    """Without the bounds these very inputs are tracebacks: RecursionError / the int-limit ValueError."""
    crash = RecursionError if defect == "deep" else ValueError
    with pytest.raises(crash):
        json.loads(JSON_DEFECTS[defect][0])
    with pytest.raises(crash):
        tomllib.loads(TOML_DEFECTS[defect][0].decode())


def test_bounds_are_inclusive_and_strings_do_not_count():
    ok = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads_json(ok, "f.json") == json.loads(ok), "64 levels is within the bound"
    with pytest.raises(K3Error, match=rf"f.json: nested deeper than {MAX_DEPTH} levels"):
        loads_json("[" + ok + "]", "f.json")
    assert loads_json("9" * MAX_INT_DIGITS, "f.json") == int("9" * MAX_INT_DIGITS)
    with pytest.raises(K3Error, match=r"an integer of 301 digits at \$"):
        loads_json("9" * (MAX_INT_DIGITS + 1), "f.json")
    inert = json.dumps({"s": "[" * DEEP + "9" * HUGE, "f": float("1" * 400)})   # brackets/digits in a string, a float
    assert loads_json(inert, "f.json")["s"].startswith("[[")
    with pytest.raises(K3Error, match=rf"nested deeper than {MAX_DEPTH} levels at \$\.a\.a\.a"):
        loads_toml(".".join(["a"] * 100) + " = 1", "s.toml")          # dotted keys nest without brackets
    with pytest.raises(K3Error, match=r"an integer of about 6,02\d digits at \$\.x"):
        loads_toml("x = 0x" + "f" * HUGE, "s.toml")                    # hex has no int-string limit


# ---- the seven readers: reader(directory, bytes) -> writes the file, reads it the reader's way -----

def _config(d: Path, data: bytes):
    (d / "config.json").write_bytes(data)
    return K3Config.from_file(d), d / "config.json"


def _index(d: Path, data: bytes):
    (d / "model.safetensors.index.json").write_bytes(data)
    return read_state_dict(d), d / "model.safetensors.index.json"


def _golden(d: Path, data: bytes):
    (d / "golden.json").write_bytes(data)
    return golden._read(d / "golden.json"), d / "golden.json"


def _report(d: Path, data: bytes):
    (d / "report.json").write_bytes(data)
    return load_report(d), d / "report.json"


def _kvv(d: Path, data: bytes):
    (d / "kvv.json").write_bytes(data)
    return import_kvv_results(d / "kvv.json"), d / "kvv.json"


def _plan(d: Path, data: bytes):
    (d / "plan.json").write_bytes(data)
    return run_all.load_plan(d), d / "plan.json"


def _suite(d: Path, data: bytes):
    (d / "suite.toml").write_bytes(data)
    return load_suite(str(d / "suite.toml")), d / "suite.toml"


READERS = {"config": (_config, ConfigError), "safetensors-index": (_index, CheckpointError),
           "golden": (_golden, UsageError), "signoff-report": (_report, UsageError),
           "kvv-import": (_kvv, K3Error), "plan": (_plan, UsageError), "suite": (_suite, UsageError)}


@pytest.mark.parametrize("defect", ["deep", "huge-int", "not-utf8"])
@pytest.mark.parametrize("reader", list(READERS))
def test_each_reader_refuses_a_hostile_file_in_one_line_naming_it(tmp_path, reader, defect):
    read, error = READERS[reader]
    data, expected = (TOML_DEFECTS if reader == "suite" else JSON_DEFECTS)[defect]
    with pytest.raises(error) as info:
        read(tmp_path, data)
    message = str(info.value)
    assert "\n" not in message, f"one line, got {message!r}"
    name = {"config": "config.json", "safetensors-index": "model.safetensors.index.json", "golden": "golden.json",
            "signoff-report": "report.json", "kvv-import": "kvv.json", "plan": "plan.json", "suite": "suite.toml"}
    assert f"{tmp_path / name[reader]}: " in message, f"the message names the file: {message!r}"
    assert re.search(expected, message), f"expected /{expected}/ in {message!r}"


# ---- negative controls: a valid file of each kind still loads ----------------------------------

def test_valid_files_still_load(tmp_path):
    assert K3Config.from_file(MINI).hidden_size > 0
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(MINI / "config.json", ckpt)
    shutil.copy(MINI / "model.safetensors", ckpt / "shard-1.safetensors")
    with safe_open(str(MINI / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "shard-1.safetensors" for n in names}}))
    assert sorted(read_state_dict(ckpt)) == sorted(names)
    for path in (REPO / "golden" / "hashes").glob("*.json"):
        assert golden._read(path)["models"]
    from test_report import _report as a_report
    write_report(tmp_path / "run", a_report())
    assert load_report(tmp_path / "run")["summary"]
    (tmp_path / "kvv.json").write_text(json.dumps({"OCRBench": 0.89}))
    assert import_kvv_results(tmp_path / "kvv.json")["passed"]
    (tmp_path / "plan.json").write_text(json.dumps({"format": run_all.PLAN_FORMAT, "version": run_all.PLAN_VERSION}))
    assert run_all.load_plan(tmp_path)["format"] == run_all.PLAN_FORMAT
    for name in ("premerge", "release"):
        assert load_suite(name).checks


# ---- end to end: the CLI prints one line and exits 2 ------------------------------------------

def _cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("defect", ["deep", "huge-int", "not-utf8"])
def test_cli_exits_2_with_one_line(tmp_path, capsys, defect):
    data = JSON_DEFECTS[defect][0]
    cases = []
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes(data)
    cases.append(("info", "--model", model))
    (tmp_path / "kvv.json").write_bytes(data)
    cases.append(("kvv", "import", tmp_path / "kvv.json"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_bytes(data)
    cases.append(("signoff", "--report", run, "--out", tmp_path / "signoff.md"))
    (tmp_path / "suite.toml").write_bytes(TOML_DEFECTS[defect][0])
    cases.append(("all", "--suite", tmp_path / "suite.toml", "--report-dir", tmp_path / "out"))
    for argv in cases:
        code, err = _cli(capsys, *argv)
        assert code == 2 and err.count("\n") == 1 and err.startswith("k3verify: error: "), (argv[0], code, err)
    assert not (tmp_path / "signoff.md").exists() and not (tmp_path / "out" / "report.json").exists()


# ---- the campaign's other tracebacks: each one line and exit 2 (a broken pipe: quiet exit 1) ------

def test_suite_kind_that_is_not_a_string_is_one_line(tmp_path, capsys):
    suite = tmp_path / "suite.toml"
    suite.write_text('version = 2\n[[check]]\nkind = ["diff"]\n')
    with pytest.raises(UsageError, match=r"suite.toml: check 1: expected kind to be a string, one of .*diff.*; got a list"):
        load_suite(str(suite))
    code, err = _cli(capsys, "all", "--suite", suite, "--report-dir", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1, err
    suite.write_text('version = 2\n[[check]]\nkind = "selftest"\n')       # negative control: a string kind loads
    assert load_suite(str(suite)).checks[0].kind == "selftest"


@pytest.mark.parametrize("url, reason", [("http://[::1/v1", "Invalid IPv6 URL"),
                                         ("http://h:x/v1", "Port could not be cast"),
                                         ("http://h:99999/v1", "Port out of range")],
                         ids=["ipv6-unclosed", "port-not-a-number", "port-out-of-range"])
@pytest.mark.parametrize("command", ["kvv", "gsm8k"])
def test_base_url_that_urllib_cannot_parse_is_one_line(tmp_path, capsys, command, url, reason):
    code, err = _cli(capsys, command, "--base-url", url, "--report-dir", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1, err
    assert f"--base-url must be an http(s) URL with a host, like http://127.0.0.1:8000/v1, got {url!r} ({reason}" in err


def test_a_good_base_url_passes_validation():
    """Negative control: the same validation accepts an IPv6 loopback URL with a port."""
    from k3verify.kinds import gsm8k, kvv

    assert gsm8k.completions_url("http://[::1]:8000/v1") == "http://[::1]:8000/v1/completions"
    kvv.validate({**kvv.OPTIONS, "base_url": "http://[::1]:8000/v1"})
    with pytest.raises(UsageError):
        kvv.validate({**kvv.OPTIONS, "base_url": "http://[::1:8000/v1"})


def _shell(command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


K3 = f"{sys.executable} -m k3verify"


def test_closed_stdout_is_refused_in_one_line_before_any_work():
    r = _shell(f"{K3} toggles >&-")
    assert r.returncode == 2, r
    assert r.stderr == "k3verify: error: stdout is closed: nothing could be printed (to discard the output: >/dev/null)\n"
    r = _shell(f"{K3} toggles >/dev/null")                                  # negative control: open stdout
    assert r.returncode == 0 and r.stderr == "", r


@pytest.mark.parametrize("json_flag", ["", "--json"], ids=["table", "json"])
def test_a_reader_that_goes_away_is_a_quiet_exit_1(json_flag):
    """`| true` closes the pipe before k3verify (seconds to start) writes: rich's tables and
    the plain JSON writer both meet EPIPE; each ends quietly with 1, no traceback, no message."""
    r = _shell(f'{K3} toggles {json_flag} 2>/tmp/k3v-pipe-$$.err | true; echo "rc=${{PIPESTATUS[0]}}"; '
               f'grep -v "^[│┃┏┡└ ]" /tmp/k3v-pipe-$$.err; rm -f /tmp/k3v-pipe-$$.err')
    assert r.stdout == "rc=1\n", r
