"""`k3verify signoff [--run RUN_ID | --report PATH] [--out FILE] [--ships T1,T2,...]`: the release sign-off document.

Reads a `k3verify all` report (release or premerge suite) and writes one Markdown
document: model and environment fingerprint, each toggle's verdict with evidence and
counted speedup, quality gates with intervals, golden status, open risks, the report's
sha256, and a last line SIGNED-OFF or NOT SIGNED-OFF. Exit 0 when signed off, 1 when not.
--ships names the release configuration to sign (suites/signoff.py), in place of the suite's own.
"""
from __future__ import annotations

from pathlib import Path

from k3verify.commands import REPORTS_DIR, add_json_flag, console, emit_json
from k3verify.errors import UsageError

NAME = "signoff"
HELP = "write the release sign-off document from a `k3verify all` report; exit 1 unless signed off"


def add_arguments(parser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="RUN_ID", help="a run under reports/")
    src.add_argument("--report", type=Path, metavar="PATH", help="a report.json or the run directory holding it")
    parser.add_argument("--out", type=Path, metavar="FILE", help="where to write (default: signoff.md beside the report)")
    parser.add_argument("--ships", metavar="T1,T2,...", help="the toggles the release turns on (default: the suite's "
                        "`ships`; neither: every judged toggle must hold)")
    add_json_flag(parser)


def run(args) -> int:
    from k3verify.io import atomic_write_text, check_writable_file
    from k3verify.report import REPORT_FILES, RUN_MARKERS, load_report, run_owner
    from k3verify.suites.signoff import problems, render_signoff, report_sha256
    from k3verify.suites.suite import parse_ships

    path = args.report if args.report is not None else REPORTS_DIR / args.run
    if args.run is not None and not path.is_dir():
        raise UsageError(f"no run {args.run!r} under {REPORTS_DIR}")
    ships = None if args.ships is None else parse_ships([x.strip() for x in args.ships.split(",") if x.strip()], "--ships")
    report = load_report(path)
    text, signed = render_signoff(report, ships)
    out = args.out or (path if path.is_dir() else path.parent) / "signoff.md"
    if out.name in {*REPORT_FILES.values(), *RUN_MARKERS} and run_owner(out.parent) is not None:
        raise UsageError(f"--out {out}: that is a file of run {run_owner(out.parent)[0]}; no command overwrites "
                         f"a run's report: choose another file")
    check_writable_file(out, "--out")
    atomic_write_text(out, text)
    con = console()
    why_not = problems(report, ships)
    for p in why_not:
        con.print(f"  blocks sign-off: {p}")
    con.print(f"{'SIGNED-OFF' if signed else 'NOT SIGNED-OFF'}  document: {out}")
    if args.json:
        emit_json({"signed_off": signed, "document": str(out), "report_sha256": report_sha256(report),
                   "problems": why_not})
    return 0 if signed else 1
