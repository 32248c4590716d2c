"""Run reports: report.json (versioned schema, the machine-readable truth) and its views.

    reports/<run-id>/report.json   the dict, validated against schema.py
                     report.md     summary table + failures
                     report.html   self-contained page with plots
                     junit.xml     for CI

write_report validates first and renders every view before touching the disk, so a
bad report writes nothing; the four files are written as one set (io.atomic_write_set: all
to temp files, then renamed, report.json last): a write that fails (a full disk) replaces
none of them, so the directory holds the complete old set or the complete new one.

No run overwrites another run's report. A run directory names its run in report.json
(or, for `k3verify all`, in plan.json, written first): writing into a directory that
names a different run id is refused (claim_report_dir), before the run starts (the CLI)
and again at write time (write_report). The same run resuming has the same id.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from k3verify.errors import UsageError
from k3verify.io import ReadError, atomic_write_set, make_dir, read_json
from k3verify.report.environment import environment_fingerprint
from k3verify.report.render_html import render_html
from k3verify.report.render_junit import render_junit
from k3verify.report.render_md import render_markdown
from k3verify.report.schema import SCHEMA_VERSION, summarize, validate_report

__all__ = [
    "SCHEMA_VERSION", "build_report", "environment_fingerprint", "load_report", "new_run_id", "render_html",
    "render_junit", "render_markdown", "summarize", "validate_report", "write_report", "REPORT_FILES",
    "claim_report_dir", "run_owner",
]

REPORT_FILES = {"json": "report.json", "md": "report.md", "html": "report.html", "junit": "junit.xml"}
RUN_MARKERS = ("plan.json", REPORT_FILES["json"])     # what names a directory's run, first found wins
_PREFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$")


def new_run_id(prefix: str = "run", now: datetime | None = None) -> str:
    """'20261129-234501-diff-ab12cd': local time, the prefix, 6 random hex digits (two runs a second apart differ)."""
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValueError(f"run id prefix must be 1-40 characters of [A-Za-z0-9_.-], got {prefix!r}")
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{prefix}-{secrets.token_hex(3)}"


def build_report(run_id: str, command: str, environment: Mapping[str, Any], results: Sequence[Mapping[str, Any]],
                 created: str | None = None) -> dict[str, Any]:
    """A schema-valid report dict with the summary computed from `results`."""
    report = {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "created": created or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "environment": dict(environment),
        "results": [dict(r) for r in results],
        "summary": summarize(results),
    }
    validate_report(report)
    return report


def _json_safe(obj: Any) -> Any:
    """NaN/inf as strings ("nan", "inf", "-inf"), the convention compare.Finding.to_dict uses; strict JSON after."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, Mapping):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_report(directory: str | os.PathLike, report: Mapping[str, Any],
                 decorate: Callable[[Mapping[str, Any], dict[str, str]], None] | None = None) -> dict[str, Path]:
    """Validate, render, then write all four files into `directory` (created) as one set. Returns
    kind -> path. `decorate(safe_report, rendered)` may edit the rendered views in memory (the
    combined report's verdict sections) before anything is written."""
    validate_report(report)
    safe = _json_safe(report)
    rendered = {
        "md": render_markdown(safe),
        "html": render_html(safe),
        "junit": render_junit(safe),
    }
    if decorate is not None:
        decorate(safe, rendered)
    rendered["json"] = json.dumps(safe, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    out_dir = Path(directory)
    claim_report_dir(out_dir, report["run_id"])
    make_dir(out_dir)
    paths = {kind: out_dir / name for kind, name in REPORT_FILES.items()}
    # one set: every file to a temp file first, then renamed (report.json last); a failed write
    # (a full disk) replaces nothing, so the directory never holds half of a report
    atomic_write_set({paths[kind]: rendered[kind].encode("utf-8") for kind in ("md", "html", "junit", "json")})
    return paths


def run_owner(directory: str | os.PathLike) -> tuple[str, str] | None:
    """(run id, command) of the run a directory holds (its plan.json or report.json), or None.

    An unreadable marker still means something is there: it is reported, not ignored."""
    d = Path(directory)
    if not d.is_dir():
        return None
    for name in RUN_MARKERS:
        p = d / name
        if not p.exists():
            continue
        try:
            data = read_json(p)
        except (OSError, ValueError, ReadError):
            return ("?", f"an unreadable {name}")
        if not isinstance(data, dict):
            return ("?", f"a {name} that is not a run's")
        return (str(data.get("run_id", "?")), str(data.get("command", name)))
    return None


def claim_report_dir(directory: str | os.PathLike, run_id: str | None, what: str = "--report-dir") -> None:
    """Refuse a directory that holds another run's report or plan; run_id None means a new run
    (every run found there is another's)."""
    owner = run_owner(directory)
    if owner is None or (run_id is not None and owner[0] == run_id):
        return
    found, command = owner
    hint = (f"; to finish it: k3verify all --resume {found} --report-dir {directory}"
            if command.startswith("k3verify all") and (Path(directory) / "plan.json").is_file() else "")
    raise UsageError(f"{what} {directory} already holds run {found} ({command}); no run overwrites another's "
                     f"report: choose another directory{hint}")


def load_report(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate report.json (or the run directory holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / REPORT_FILES["json"]
    if not p.is_file():
        raise UsageError(f"no report at {p}: expected a report.json file or a run directory holding one")
    try:
        obj = read_json(p)                       # bounded: ReadError names the file and the problem
    except json.JSONDecodeError as exc:
        raise UsageError(f"{p}: not valid JSON ({exc})") from None
    try:
        validate_report(obj)
    except ValueError as exc:
        raise UsageError(f"{p}: {exc}") from None
    return obj
