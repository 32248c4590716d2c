"""Judge toggles on scenarios and write one report: the engine behind `diff`, `selftest`
and `all`.
"""
from __future__ import annotations

from k3verify import REPO_ROOT

import time
from pathlib import Path
from typing import Any, Callable, Iterable

from optimized_stack import toggles as toggle_registry

from k3verify.scenarios import workloads
from k3verify.verdict.gate import CheckResult, ReferenceRuns, check_toggle
from k3verify.report import build_report, environment_fingerprint, new_run_id, write_report

DEFAULT_SCENARIOS = ("single", "multi_length", "boundaries")


def scenarios_for(toggle, names: Iterable[str] | None, scale: float, seed: int = 0) -> list:
    """Explicit scenario names, or the defaults plus every scenario tagged for the toggle."""
    if names:
        return [workloads.build(n, scale=scale, seed=seed) for n in names]
    chosen = list(DEFAULT_SCENARIOS)
    tags = set(toggle.scenario_tags) | set(toggle.exercised_by)
    if tags:
        chosen += [n for n in workloads.SCENARIOS
                   if set(workloads.build(n, scale=scale, seed=seed).tags) & tags]
    return [workloads.build(n, scale=scale, seed=seed) for n in dict.fromkeys(chosen)]


def judge(model, toggle_names: list[str], scenario_names: list[str] | None = None, *, scale: float = 1.0,
          seed: int = 0, references: ReferenceRuns | None = None,
          progress: Callable[[str], None] | None = None, world_size: int = 1) -> list[CheckResult]:
    """At world_size W > 1 each toggle is judged under tensor parallelism against the same W
    without it (the W ranks start once and are stopped here unless `references` was given)."""
    owned = references is None
    references = references or ReferenceRuns(model, world_size)
    results: list[CheckResult] = []
    try:
        for name in toggle_names:
            toggle = toggle_registry.get(name)
            for sc in scenarios_for(toggle, scenario_names, scale, seed):
                if progress:
                    progress(f"{name} on {sc.name}" + (f" at world size {world_size}" if world_size > 1 else ""))
                results.extend(check_toggle(model, name, sc, references=references))
    finally:
        if owned:
            references.close()
    return results


def default_report_dir(kind: str) -> tuple[str, Path]:
    run_id = new_run_id(kind)
    return run_id, REPO_ROOT / "reports" / run_id


def write(report_dir: Path, run_id: str, command: str, model, results: list[dict[str, Any]],
          seeds: dict | None = None) -> tuple[dict, dict]:
    env = environment_fingerprint(model=model, seeds=seeds or {"scenario_seed": 0})
    report = build_report(run_id, command, env, results)
    paths = write_report(report_dir, report)
    return report, paths


def timed(fn, *a, **kw):
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t0
