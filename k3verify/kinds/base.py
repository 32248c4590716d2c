"""What every check kind shares: the spec it plans from, the units it runs, the context they
run in, and the validators of the option values several kinds take.

    spec = CheckSpec(kind="diff", name="exact", options={"toggles": ["prefix_cache"]})
    units = kinds.plan(spec)                     # validated, expanded: one unit per (toggle, scenario)
    with Context(model) as ctx:
        results = [r for u in units for r in kinds.run(u, ctx)]

A spec's `options` are the kind's OPTIONS keys with defaults filled; a bad value is an
OptionError naming the key, which a suite spells `check 2 (needle): samples must be ...`
and a command `--samples must be ...` (one rule, two spellings).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from k3verify.errors import UsageError

TOGGLE_SELECTORS = ("all", "all-exact", "all-approx")


class OptionError(UsageError):
    """A bad option value: `key` and what is wrong with it (`text`), spelled by the caller
    ("limit must be ..." in a suite, "--limit must be ..." on the command line). `bare`: the
    text names the problem on its own (an unknown toggle's did-you-mean)."""

    def __init__(self, key: str, text: str, *, bare: bool = False):
        self.key, self.text, self.bare = key, text, bare
        super().__init__(text if bare else f"{key} {text}")

    def as_flag(self) -> UsageError:
        return UsageError(self.text if self.bare else f"--{self.key.replace('_', '-')} {self.text}")


def hint(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(str(word), known, n=1)
    return f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(known)})"


@dataclass(frozen=True)
class CheckSpec:
    """One check to plan: a kind and its options (validated and filled on construction).

    `where` prefixes every error (a suite passes "premerge.toml: check 3"; a command leaves it
    empty and spells errors as flags)."""

    kind: str
    name: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    index: int = 1
    description: str = ""
    where: str = ""
    model: str | None = None        # a suite check's own model; None: the run's (--model)

    def __post_init__(self) -> None:
        from . import get
        kind = get(self.kind, self.where)
        allowed = kind.OPTIONS
        for key in self.options:
            if key not in allowed:
                raise UsageError(f"{self._at()}unknown key {key!r}{hint(key, list(allowed) + list(COMMON_KEYS))}")
        filled = {**allowed, **self.options}
        object.__setattr__(self, "options", filled)
        object.__setattr__(self, "name", self.name or self.kind)
        try:
            kind.validate(filled)
        except OptionError as exc:
            raise (UsageError(f"{self._at()}{exc}") if self.where else exc.as_flag()) from None

    def _at(self) -> str:
        return f"{self.where} ({self.kind}): " if self.where else ""


COMMON_KEYS = ("kind", "name", "description", "model", "dtype")


@dataclass(frozen=True)
class Unit:
    """The smallest piece of a check that runs and is recorded on its own (one file per unit
    in `k3verify all`, so a resumed run skips finished ones). `id` is given by the suite."""

    kind: str
    check: str
    options: Mapping[str, Any]
    toggle: str | None = None
    scenario: str | None = None
    note: str = ""
    check_index: int = 1
    id: str = ""
    model: str | None = None        # a suite check's own model (preset or directory); None: the run's

    def to_dict(self) -> dict[str, Any]:
        d = {"id": self.id, "check_index": self.check_index, "check": self.check, "kind": self.kind,
             "toggle": self.toggle, "scenario": self.scenario, "options": dict(self.options), "note": self.note}
        return {**d, "model": self.model} if self.model is not None else d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Unit":
        return cls(kind=d["kind"], check=d["check"], options=d["options"], toggle=d.get("toggle"),
                   scenario=d.get("scenario"), note=d.get("note", ""), check_index=d.get("check_index", 1),
                   id=d.get("id", ""), model=d.get("model"))

    @property
    def label(self) -> str:
        """'prefix_cache on multi_turn' (+ ' at world size 2' under tensor parallelism, + ' on model M')."""
        text = " on ".join(x for x in (self.toggle or self.check, self.scenario) if x)
        world = self.options.get("world_size", 1)
        return text + (f" at world size {world}" if world > 1 else "") + (f" on model {self.model}" if self.model else "")


def units_for(spec: CheckSpec, toggles: list[str | None], scenarios: Callable[[str | None], tuple] | None = None
              ) -> list[Unit]:
    """One unit per toggle (and, with `scenarios`, per (toggle, scenario) with its note)."""
    out = []
    for t in toggles:
        if scenarios is None:
            out.append(Unit(spec.kind, spec.name, spec.options, t, check_index=spec.index))
            continue
        names, note = scenarios(t)
        out += [Unit(spec.kind, spec.name, spec.options, t, s, note, spec.index) for s in names]
    return out


class Progress(Protocol):
    def note(self, message: str) -> None: ...     # a message within the current item
    def done(self, message: str) -> None: ...     # one item finished (a needle case)
    def advance(self, n: int = 1) -> None: ...    # n items finished (gsm8k questions answered)


class NullProgress:
    def note(self, message: str) -> None:
        pass

    def done(self, message: str) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass


class Context:
    """What units share in one process: the model, its device, the scenario runners (one per
    world size, reference captures cached), where a unit may write, and the progress line."""

    def __init__(self, model, *, model_arg: str | None = None, run_dir=None, progress: Progress | None = None,
                 load_options: Mapping[str, bool] | None = None, tp_backend: str = "gloo",
                 placement: Mapping[str, Any] | None = None, model_id: str | None = None):
        self.model, self.model_arg, self.run_dir = model, model_arg, run_dir
        self._model_id = model_id             # the caller's, when it has hashed the weights already
        # where a model this context loads itself (the KVV gate's served model) lives: the run
        # model's device and dtype, or `placement` ({"device", "dtype"}) when there is none
        self.placement = dict(placement) if placement is not None else (
            {"device": next(model.parameters()).device.type, "dtype": next(model.parameters()).dtype}
            if model is not None else {})
        self.progress = progress or NullProgress()
        self.load_options = dict(load_options or {})
        self.device = next(model.parameters()).device.type if model is not None else "cpu"
        self.tp_backend = tp_backend          # torch.distributed backend of W > 1 runs (nccl on GPUs)
        self._runners: dict[tuple[int, str], Any] = {}
        # the reference path's answers to a quality gate's prompts, reused by the next toggle's
        # unit in this process: the reference is deterministic, so only the candidates rerun
        # (under a run_dir, shared with the run's other processes too: quality/shared_answers.py)
        self.reference_answers: dict[tuple, list[str]] = {}

    @property
    def model_id(self) -> str:
        """The checkpoint identity reports and resumes use (compare/golden.py model_id: sha256 of
        the weights file, or the preset and seed), computed once per context and only when asked
        (a shared reference's key): sha256 reads 1.2 GB/s from the page cache on the dev CPU, so a
        100 GB checkpoint costs over a minute. `k3verify all` passes the run model's, hashed already."""
        if self._model_id is None:
            from k3verify.compare.golden import model_id
            self._model_id = model_id(self.model)
        return self._model_id

    def runner(self, world_size: int = 1, backend: str | None = None):
        from k3verify.run.runner import Runner
        backend = backend or self.tp_backend
        key = (world_size, backend)
        if key not in self._runners:
            self._runners[key] = Runner(self.model, world_size=world_size, backend=backend)
        return self._runners[key]

    def close(self) -> None:
        for r in self._runners.values():
            r.close()
        self._runners.clear()

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- validators of values several kinds take (each raises OptionError) -------------------------

def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_toggles(value: Any, *, approx_only: bool = False, allow_none: bool = True) -> None:
    from optimized_stack import toggles as registry
    from optimized_stack.errors import K3Error

    if value is None and allow_none:
        return
    if isinstance(value, str):
        if value not in TOGGLE_SELECTORS:
            raise OptionError("toggles", f"must be one of {', '.join(TOGGLE_SELECTORS)} or a list of toggle names, "
                                         f"got {value!r}{hint(value, list(TOGGLE_SELECTORS))}")
        return
    if not (isinstance(value, list) and value and all(isinstance(x, str) for x in value)):
        raise OptionError("toggles", f"must be a selector string or a non-empty list of names, got {value!r}")
    for name in value:
        try:
            t = registry.get(name)
        except K3Error as exc:
            raise OptionError("toggles", str(exc), bare=True) from None
        if approx_only and t.contract.kind != "approx":
            raise OptionError("toggles", f"drift checks approx toggles; {name!r} has an exact contract "
                                         f"(use kind = \"diff\")", bare=True)


def check_scenarios(value: Any) -> None:
    from k3verify.scenarios.workloads import SCENARIOS
    if value is None:
        return
    if not isinstance(value, list) or not value or not all(isinstance(x, str) for x in value):
        raise OptionError("scenarios", f"must be a non-empty list of names, got {value!r}")
    for name in value:
        if name not in SCENARIOS:
            raise OptionError("scenarios", f"unknown scenario {name!r}{hint(name, list(SCENARIOS))}", bare=True)


def check_scale(value: Any, key: str = "scale") -> None:
    if not is_number(value) or not 0 < value <= 64:
        raise OptionError(key, f"must be a number in (0, 64], got {value!r}")


def check_int(value: Any, key: str, low: int, what: str = "") -> None:
    if not is_int(value) or value < low:
        raise OptionError(key, f"must be an integer >= {low}{f' ({what})' if what else ''}, got {value!r}")


def check_fraction(value: Any, key: str, *, nullable: bool = True, closed: bool = True) -> None:
    if value is None and nullable:
        return
    ok = is_number(value) and (0.0 <= value <= 1.0 if closed else 0.0 <= value < 1.0)
    if not ok:
        raise OptionError(key, f"is a fraction in [0, 1{']' if closed else ')'}, got {value!r}")


def select_toggles(selector: str | list[str] | None, kind: str) -> list[str]:
    """Toggle names a check applies to; mutants only when named explicitly. A quality gate's
    selector picks the approx toggles whose contract names that gate."""
    from optimized_stack import toggles as registry

    if selector is None:
        return []
    if isinstance(selector, list):
        return list(selector)
    opts = registry.all_toggles("optimization")
    if kind in QUALITY_KINDS:
        opts = [t for t in opts if t.contract.kind == "approx" and kind in t.contract.quality]
    if selector == "all-exact":
        opts = [t for t in opts if t.contract.kind == "exact"]
    elif selector == "all-approx":
        opts = [t for t in opts if t.contract.kind == "approx"]
    return [t.name for t in opts]


QUALITY_KINDS = ("gsm8k", "needle", "kvv")


def gate_units(spec: CheckSpec) -> list[Unit]:
    """A quality gate's units: one per toggle its selector picks, or one reference run when the
    check names no toggles (or its selector picks none: the note says so)."""
    o = spec.options
    toggles = select_toggles(o["toggles"], spec.kind)
    if o["toggles"] is not None and toggles:
        return units_for(spec, toggles)
    note = "" if o["toggles"] is None else \
        f"no toggle selected by {o['toggles']!r} names {spec.kind} in its contract: reference only"
    return [Unit(spec.kind, spec.name, o, None, note=note, check_index=spec.index)]


def device_skip(toggle_name: str | None, device: str) -> str | None:
    """Why a toggle's check cannot run on this device (a CUDA kernel's gate on a CPU run), or None."""
    if toggle_name is None:
        return None
    from optimized_stack import toggles as registry
    t = registry.get(toggle_name)
    return None if device in t.devices else f"toggle runs on {', '.join(t.devices)}, not {device}"
