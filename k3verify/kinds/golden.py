"""Check kind `golden`: the reference path itself against the golden hashes recorded for this
numerics environment (compare/golden.py): one result per golden scenario, or one skip when
this environment or model has no hashes (bits legitimately differ across environments), or one
`not exercised` when the model's entry holds no scenarios. Neither is a pass: a report of only
those verifies nothing (report/schema.py)."""
from __future__ import annotations

import time
from pathlib import Path

from k3verify.compare import golden
from k3verify.verdict.result import REFERENCE, Result

from .base import CheckSpec, Context, OptionError, Unit

NAME = "golden"
OPTIONS = {"dir": None}          # golden hash directory (default golden/hashes)
GOLDEN_S = 5.0                   # measured: ~4 s of reference compute on the 2-core dev CPU


def validate(o: dict) -> None:
    if o["dir"] is not None and not isinstance(o["dir"], (str, Path)):
        raise OptionError("dir", f"must be a directory path, got {o['dir']!r}")
    if o["dir"] is not None and not Path(o["dir"]).is_dir():      # a typo, not an environment without hashes
        raise OptionError("dir", f"{o['dir']}: no such directory (expected a golden hash directory)")


def plan(spec: CheckSpec) -> list[Unit]:
    return [Unit(spec.kind, spec.name, spec.options, check_index=spec.index)]


def cost_s(unit: Unit) -> float:
    return GOLDEN_S


def run(unit: Unit, ctx: Context) -> list[Result]:
    t0 = time.perf_counter()
    gc = golden.check(ctx.model, Path(unit.options["dir"] or golden.GOLDEN_DIR))
    return results(gc, time.perf_counter() - t0)


def results(gc: golden.GoldenCheck, duration_s: float = 0.0) -> list[Result]:
    """One result per scenario, or one (a skip) when there is nothing to compare."""
    evidence = {"env_key": gc.env_key, "golden_file": gc.path, "model_id": gc.model_id,
                **({"machine_difference": gc.primitive} if gc.primitive else {})}
    if not gc.scenarios:
        return [Result.make(gc.status, REFERENCE, "golden", gc.reason, duration_s=duration_s, evidence=evidence)]
    each = duration_s / len(gc.scenarios)
    return [Result.make(v.status, REFERENCE, "golden", v.reason, scenario=v.scenario,
                        first_divergence=v.first_divergence, duration_s=each,
                        evidence={**evidence, "divergences": v.divergences}) for v in gc.scenarios]
