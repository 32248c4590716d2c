"""What the check commands share: plan a spec through its kind, run the units with a progress
line, and write the run's report. A command is then: parse flags -> CheckSpec -> this -> render.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from k3verify import kinds
from k3verify.commands import REPORTS_DIR, command_line
from k3verify.commands._progress import Item, RunProgress
from k3verify.kinds.base import CheckSpec, Context, Unit
from k3verify.report import build_report, environment_fingerprint, new_run_id, write_report
from k3verify.verdict.result import Result


def plan(spec: CheckSpec) -> list[Unit]:
    return kinds.plan(spec)


def run_units(units: Sequence[Unit], ctx: Context, title: str, *, items: Sequence[Item] | None = None,
              log_prefix: str = "  running ") -> list[Result]:
    """Every unit through kinds.run. Without `items` each unit is one progress item (its label
    the line); with them the kind advances the line itself (questions, needle cases)."""
    per_unit = items is None
    items = [Item(kinds.label(u), u.kind, kinds.cost_s(u)) for u in units] if per_unit else list(items)
    results: list[Result] = []
    with RunProgress(title, items, log_prefix=log_prefix) as bar:
        ctx.progress = bar
        for u in units:
            if per_unit:
                bar.step(kinds.label(u))
            results += kinds.run(u, ctx)
    return results


def write(kind: str, report_dir: Path | None, model, results: Sequence[Result], seeds: dict[str, Any] | None = None
          ) -> tuple[str, dict, dict]:
    """(run id, report, paths) of this command's run, under --report-dir or reports/<run-id>."""
    run_id = new_run_id(kind)
    env = environment_fingerprint(model=model, seeds=seeds if seeds is not None else {"scenario_seed": 0})
    report = build_report(run_id, command_line(), env, [r.to_dict() for r in results])
    paths = write_report(report_dir or REPORTS_DIR / run_id, report)
    return run_id, report, paths
