"""Check kind `invariance` (issue 18): every row op of the reference path, at every shape the
model uses, gives a row the same bits in an M-row call as in a larger call (compare/invariance.py),
with its negative controls, each of which must fail. Runs where the GPU profile's kernels run: on
CUDA, or on a CPU through Triton's interpreter (TRITON_INTERPRET=1, triton installed)."""
from __future__ import annotations

import os

from k3verify.verdict.result import Result, Subject

from .base import CheckSpec, Context, OptionError, Unit, is_int

NAME = "invariance"
OPTIONS = {"ms": None, "ops": None}      # row counts (None: the default ladder), ops (None: all)
INVARIANCE_S = 120.0                     # measured: 127 s for k3-mini's 1,472 rows on the H200


def validate(o: dict) -> None:
    from k3verify.compare.invariance import OPS
    if o["ms"] is not None and not (isinstance(o["ms"], list) and o["ms"] and all(is_int(m) and m >= 1 for m in o["ms"])):
        raise OptionError("ms", f"must be a non-empty list of row counts >= 1, got {o['ms']!r}")
    if o["ops"] is not None:
        bad = [x for x in (o["ops"] if isinstance(o["ops"], list) else [o["ops"]]) if x not in OPS]
        if not isinstance(o["ops"], list) or bad:
            raise OptionError("ops", f"must be a list of some of {', '.join(OPS)}, got {o['ops']!r}")


def plan(spec: CheckSpec) -> list[Unit]:
    return [Unit(spec.kind, spec.name, spec.options, check_index=spec.index)]


def cost_s(unit: Unit) -> float:
    return INVARIANCE_S


def label(unit: Unit) -> str:
    return "invariance of the reference profile"


def run(unit: Unit, ctx: Context) -> list[Result]:
    subject = Subject.of_optional(None)
    if ctx.device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return [Result.skipped(subject, NAME, "the invariant profile's kernels run on CUDA or through Triton's "
                                              "interpreter (TRITON_INTERPRET=1, `make test-triton`); neither here")]
    from k3verify.compare import invariance
    res = invariance.run(ctx.model, unit.options["ms"], ops_filter=unit.options["ops"])
    return [Result.from_dict(r) for r in res.results + res.controls]
