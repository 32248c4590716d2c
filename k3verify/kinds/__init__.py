"""The check-kind registry: every kind of check k3verify can run, one module each.

A kind module defines
    NAME                       its name in suites and results ("needle")
    OPTIONS                    the keys a check of this kind takes, with their defaults
    validate(options)          every value the run would refuse, refused first (OptionError)
    plan(spec) -> [Unit]       the check expanded into units (a spec is validated on construction)
    run(unit, ctx) -> [Result] one unit run in a Context (model, runners, progress)
    cost_s(unit) -> float      prior seconds on the 2-core dev CPU (the progress estimate only)
and may define label(unit) -> str (its progress line; default "toggle on scenario").

`k3verify <kind>` (commands/) and `k3verify all` (suites/run_all.py) both go through
`plan` and `run` here: a command parses its flags into a CheckSpec, a suite reads one from
TOML, and both get the same units, the same validation and the same results.

Kinds named in PENDING are reserved for work that has not landed; a suite may name them and
gets one skip per check saying so (never a pass).
"""
from __future__ import annotations

from types import ModuleType

from k3verify.errors import UsageError

from . import bench, diff, drift, golden, gsm8k, invariance, kvv, needle, patch_diff, selftest, spec_sampling
from .base import CheckSpec, Context, Unit, hint

_MODULES = (selftest, diff, drift, golden, gsm8k, needle, kvv, bench, patch_diff, invariance, spec_sampling)
_REQUIRED = ("NAME", "OPTIONS", "validate", "plan", "run", "cost_s")
NOT_AVAILABLE = "not available in this build"
# reserved kinds: name -> what will bring them
PENDING: dict[str, str] = {}


def _registry() -> dict[str, ModuleType]:
    found: dict[str, ModuleType] = {}
    for module in _MODULES:
        missing = [a for a in _REQUIRED if not hasattr(module, a)]
        if missing:
            raise TypeError(f"check kind {module.__name__} must define {', '.join(_REQUIRED)}; missing {', '.join(missing)}")
        if module.NAME in found or module.NAME in PENDING:
            raise TypeError(f"check kind {module.NAME!r} registered twice")
        found[module.NAME] = module
    return found


KINDS = _registry()


def names() -> list[str]:
    return [*KINDS, *PENDING]


def get(name: str, where: str = ""):
    """The kind module (or the pending stand-in); an unknown name is a UsageError with a did-you-mean."""
    if name in KINDS:
        return KINDS[name]
    if name in PENDING:
        return _Pending(name)
    at = f"{where}: " if where else ""
    raise UsageError(f"{at}unknown check kind {name!r}{hint(name, names())}")


def plan(spec: CheckSpec) -> list[Unit]:
    return get(spec.kind).plan(spec)


def run(unit: Unit, ctx: Context):
    return get(unit.kind).run(unit, ctx)


def cost_s(unit: Unit) -> float:
    return get(unit.kind).cost_s(unit)


def label(unit: Unit) -> str:
    kind = get(unit.kind)
    return kind.label(unit) if hasattr(kind, "label") else unit.label


class _Pending:
    """A reserved kind: it plans one unit and runs it as a skip with the reason."""

    OPTIONS: dict = {}

    def __init__(self, name: str):
        self.NAME = name

    def validate(self, options: dict) -> None:
        pass

    def plan(self, spec: CheckSpec) -> list[Unit]:
        return [Unit(spec.kind, spec.name, spec.options, check_index=spec.index)]

    def run(self, unit: Unit, ctx: Context):
        from k3verify.verdict.result import REFERENCE, Result
        return [Result.skipped(REFERENCE, unit.kind, f"{NOT_AVAILABLE}: check kind {unit.kind!r} {PENDING[unit.kind]}")]

    def cost_s(self, unit: Unit) -> float:
        return 0.0
