"""Helpers shared by the tests that drive the CLI end to end (quality gates, endpoints)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3verify.cli import main


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    """lm-eval task files and gsm8k-synth data in a temp cache, not ~/.cache."""
    monkeypatch.setenv("K3VERIFY_CACHE", str(tmp_path_factory.getbasetemp() / "k3verify-cache"))


def cli(capsys, *argv) -> tuple[int, str, str]:
    """Run `k3verify ARGV` in-process -> (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def load(report_dir: Path) -> dict:
    return json.loads((report_dir / "report.json").read_text())
