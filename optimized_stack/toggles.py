"""The registry of named optimizations (and seeded faults) with their contracts.

A toggle is applied from outside the model, in one place (`applied`): it swaps named
op-table slots (`ops`, model/ops.py OpTable), sets engine options (`engine`) or the
verifier's runner options (`runner`), inside one context manager that always restores what
it changed. Nothing in the model branches on a toggle, and nothing patches a class.
Toggles are defined next to the code they switch, in modules named `toggle_defs`
(or `*_toggle_defs`) anywhere under optimized_stack; `_load_all` discovers them.

Contracts:
- exact: logits (every vocab entry, every step) and KDA state (every layer, every step)
  bit-identical to the reference on every scenario the toggle applies to.
- approx(budget): numerics may move within the budget (max KL, min top-1 agreement,
  max ULP on logits), and the quality gates named in the contract must pass.

Mutants are seeded faults with the same shape as toggles (`kind="mutant"`): each names
the check that must catch it and where it lives, so `k3verify selftest` can prove that
every check can fail.

Adding a toggle: the whole list (README links here; nothing else needs editing)
1. Write the form beside the other forms of its op, with the slot's signature:
   `kernels/<op>/<form>.py` (the slots, their roles and signatures: model/ops.py OpTable; a
   new role is a new OpTable field that the model calls, None meaning its plain reference
   code). A new `kernels/<op>/` folder needs an `__init__.py`: discovery walks packages, and
   a folder without one is silently not searched (tests/test_op_slots.py catches that). An
   engine mechanism is instead an `EngineOptions` field that defaults to off
   (engine/options.py), the option it needs in `REQUIRES`; a change of the verifier's plain
   loop is a runner option (k3verify/run/sequential.py RUNNER_OPTIONS).
2. Register it in that folder's `toggle_defs.py` (every module named `*toggle_defs` under
   optimized_stack is discovered; none is listed): `name`, a one-line `description`, the
   tensors it `touches`, its `contract` (EXACT, or an approx Contract with a drift budget
   and the quality gates it must pass: reuse the folder's budget when the numerics are
   alike), how it is applied (`ops={slot: fn}`, `engine={...}` or `runner={...}`), where it
   runs (`devices`, `world_sizes`), the scenario tags that put it under load (`exercised_by`;
   tags in k3verify/scenarios/workloads.py; `scenario_tags` only if it applies nowhere else),
   `phases` when it is the GPU's fast path of prefill or decode, and the `events` that prove
   its path ran (optimized_stack/events.py: a counter named there, counted where the path
   runs, or `op:<slot>` for a swapped op slot's calls; a new path needs a new counter). An
   engine toggle's `requires` is derived from REQUIRES (engine/toggle_defs.py `_opt`).
3. Register its mutant beside it: a plausible bug of that very change, `kind="mutant"`,
   `mutant_of=NAME`, the same contract and `touches`, `caught_by` (the check that must fail:
   "drift_budget" for an approx contract), the `events` of the path it corrupts (on a
   scenario where they never fire it must read `not exercised`, never pass; every event a
   toggle declares needs a mutant that declares it: tests/test_events.py) and `lives_in`:
   the component localisation names first ("kda/mixer", "moe/ffn", ..., k3verify/localize.py), i.e. the first sublayer the
   fault reaches in execution order, which for a shared op (a GEMM) is its first caller, not
   the op; `k3verify selftest` prints where it localised it.
4. Nothing lists toggles: the suites select by contract (checks/*.toml: all, all-exact,
   all-approx, and each quality gate the toggles whose contract names it), the selftest
   judges every registry entry on the cheapest scenario that exercises it, the GPU run judges
   every CUDA kernel toggle with its mutants and times the `phases` sets
   (k3verify/perf/gpu_suite.py). Name it in a suite only for a scenario or gate of its own.
5. Prove it: `k3verify diff --toggle NAME` (the contract holds), `k3verify selftest` (the
   mutant is caught by `caught_by` and localised to `lives_in`), `k3verify all` (premerge);
   tests/test_events.py fails until every declared event fires in the toggle's default scenario
   set and in the selftest's pick (add or resize a scenario when none fires it).
6. Record it: the measured drift against its budget in NOTES.md (dated), a row in
   README.md's toggle table, and, for an approx toggle, the count of approx toggles in
   checks/README.md's premerge/release cost estimates (each runs every quality gate).
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import pkgutil
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterator, Mapping

from .errors import K3Error
from .events import OP_PREFIX, Events, check_name
from .model import ops as op_table

TENSORS = ("logits", "kda_state", "kda_conv", "mla_rows")
CHECKS = ("logits", "kda_state", "tokens", "mla_rows", "drift_budget")
PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class Contract:
    kind: str                                  # "exact" or "approx"
    max_kl: float | None = None                # max over steps of KL(ref || cand), nats
    min_top1: float | None = None              # min fraction of steps with equal argmax
    max_ulp: int | None = None                 # max ULP distance on logits
    # max over layers of max|state_cand - state_ref| / max|state_ref| for the final KDA
    # recurrent state: a wrong-state bug can hide behind a confident model's logits
    max_state_rel: float | None = None
    quality: tuple[str, ...] = ()              # quality gates that must pass (gsm8k, needle, kvv)
    mean_kl: float | None = None               # mean over steps of KL(ref || cand), nats
    # The budget where the numerics differ from the CPU fp32 reference the base budget was
    # calibrated on: ("cuda:bfloat16", Contract(...)) pairs, looked up by `for_run`. A run
    # with no entry for its device and dtype is held to the base budget.
    on_device: tuple[tuple[str, "Contract"], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("exact", "approx"):
            raise K3Error(f"contract kind: expected 'exact' or 'approx', got {self.kind!r}")
        budget = (self.max_kl, self.min_top1, self.max_ulp, self.max_state_rel, self.mean_kl)
        if self.kind == "exact" and (any(v is not None for v in budget) or self.on_device):
            raise K3Error("contract: an exact contract takes no drift budget")
        if self.kind == "approx" and all(v is None for v in (self.max_kl, self.min_top1, self.max_ulp, self.mean_kl)):
            raise K3Error("contract: an approx contract needs a drift budget (max_kl, mean_kl, min_top1 or max_ulp)")
        for key, c in self.on_device:
            if ":" not in key or c.kind != "approx" or c.on_device:
                raise K3Error(f"contract: on_device entry {key!r} must be 'device:dtype' with a plain approx budget")

    def for_run(self, device: str, dtype: Any = None) -> "Contract":
        """The budget that holds for a run on `device` in `dtype` (a torch dtype or its name)."""
        name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
        return dict(self.on_device).get(f"{device}:{name}", self)

    def describe(self) -> str:
        if self.kind == "exact":
            return "exact"
        parts = [f"max_kl={self.max_kl:g}" if self.max_kl is not None else "",
                 f"mean_kl={self.mean_kl:g}" if self.mean_kl is not None else "",
                 f"min_top1={self.min_top1:g}" if self.min_top1 is not None else "",
                 f"max_ulp={self.max_ulp}" if self.max_ulp is not None else "",
                 f"max_state_rel={self.max_state_rel:g}" if self.max_state_rel is not None else ""]
        text = "approx(" + ", ".join(p for p in parts if p) + ")"
        return text + "".join(f"; on {key}: {c.describe()}" for key, c in self.on_device)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "max_kl": self.max_kl, "mean_kl": self.mean_kl, "min_top1": self.min_top1,
                "max_ulp": self.max_ulp, "max_state_rel": self.max_state_rel, "quality": list(self.quality),
                "on_device": {key: c.to_dict() for key, c in self.on_device}, "text": self.describe()}


EXACT = Contract("exact")

# bf16 on CUDA. A candidate and the GPU reference both round every activation to bf16, in
# different orders, so an approximation whose own error is far below bf16's (a reassociated
# sum, another kernel) measures as the bf16 rounding noise itself, and a budget calibrated on
# fp32 (KL 1e-6) cannot hold. The budget is declared from that noise floor, measured on the
# CPU where it is reproducible: the embedded k3-mini in bf16 against itself in fp32,
# teacher-forced, scenarios single / multi_length / boundaries / long_prompt at scale 0.5
# (NOTES.md 2026-12-01): mean KL 0.0049-0.0255, top-1 0.9746-0.9825, final KDA state
# 0.099-0.213 of max|state|. The budget is twice the worst floor (top-1: the worst floor less
# 0.025); the max KL is not budgeted, as a few near-tie rows of a trained model reach KL 3-4
# from rounding alone. Every approx mutant measured on the CPU lands above it (mean KL
# 0.08-1.55, top-1 <= 0.947); the GPU run checks the mutants again under this budget.
BF16_NOISE = Contract("approx", mean_kl=0.05, min_top1=0.95, max_state_rel=0.45)


def on_bf16_cuda(contract: Contract) -> Contract:
    """`contract` with the bf16-noise budget on cuda:bfloat16 (the GPU reference profile)."""
    return replace(contract, on_device=(("cuda:bfloat16", replace(BF16_NOISE, quality=contract.quality)),))


@dataclass(frozen=True)
class Toggle:
    name: str
    description: str
    contract: Contract
    touches: tuple[str, ...]
    kind: str = "optimization"                 # or "mutant"
    devices: tuple[str, ...] = ("cpu", "cuda")
    world_sizes: tuple[int, ...] = (1,)
    # engine options this toggle sets (EngineOptions field -> value)
    engine: dict[str, Any] = field(default_factory=dict)
    # engine options that replace `engine`'s where the engine cuts KDA on a grid (the GPU profile,
    # kernels/kda/grid.py): a toggle whose path needs checkpoints off the block boundaries sets a
    # block wider than the grid there (see engine_at)
    engine_on_grid: dict[str, Any] = field(default_factory=dict)
    # options for the verifier's plain sequential runner (prefill split, state round trip)
    runner: dict[str, Any] = field(default_factory=dict)
    # op-table slots it swaps (OpTable field -> implementation with the slot's signature)
    ops: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    # devices where an exact contract cannot hold, and why: judged there it is a skip stating
    # the reason ("not exact on cuda: ..."), never a pass or a failure
    not_exact_on: Mapping[str, str] = field(default_factory=dict)
    # other toggles that must be on for this one to mean anything
    requires: tuple[str, ...] = ()
    # scenarios (by tag) it applies to; empty = every scenario
    scenario_tags: tuple[str, ...] = ()
    # scenario tags that exercise it (added to the default scenarios when it is judged)
    exercised_by: tuple[str, ...] = ()
    # mutants: the check that must catch it and where it lives ("layer_kind/sublayer")
    caught_by: tuple[str, ...] = ()
    lives_in: str | None = None
    mutant_of: str | None = None
    # the phases this form is the fast path for ("prefill", "decode"): the GPU run times each
    # phase with the toggles that name it and passed (k3verify/perf/gpu_suite.py phase_set)
    phases: tuple[str, ...] = ()
    # the counters that prove its path ran (optimized_stack/events.py; "op:<slot>" = calls of a
    # swapped slot): an exact verdict on a scenario where one never fired is `not exercised`
    events: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("optimization", "mutant"):
            raise K3Error(f"toggle {self.name!r}: kind must be 'optimization' or 'mutant', got {self.kind!r}")
        bad = [t for t in self.touches if t not in TENSORS]
        if bad:
            raise K3Error(f"toggle {self.name!r}: touches {bad[0]!r}, expected some of {TENSORS}")
        bad = [c for c in self.caught_by if c not in CHECKS]
        if bad:
            raise K3Error(f"toggle {self.name!r}: caught_by {bad[0]!r}, expected some of {CHECKS}")
        if self.kind == "mutant" and not self.caught_by:
            raise K3Error(f"mutant {self.name!r}: must name the check that catches it (caught_by)")
        if self.not_exact_on and self.contract.kind != "exact":
            raise K3Error(f"toggle {self.name!r}: not_exact_on only qualifies an exact contract")
        bad = [p for p in self.phases if p not in PHASES]
        if bad:
            raise K3Error(f"toggle {self.name!r}: phases {bad[0]!r}, expected some of {PHASES}")
        slots = [f.name for f in fields(op_table.OpTable)]
        bad = [k for k in self.ops if k not in slots]
        if bad:
            close = difflib.get_close_matches(bad[0], slots, n=1)
            raise K3Error(f"toggle {self.name!r}: unknown op slot {bad[0]!r}"
                          f"{f'; did you mean {close[0]!r}?' if close else ''} (slots: {', '.join(slots)})")
        if self.engine_on_grid and not self.engine:
            raise K3Error(f"toggle {self.name!r}: engine_on_grid qualifies engine options, and it sets none")
        object.__setattr__(self, "events", tuple(self.events))
        for e in self.events:
            check_name(e, slots, f"toggle {self.name!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "contract": self.contract.to_dict(),
                "touches": list(self.touches), "description": self.description,
                "devices": list(self.devices), "world_sizes": list(self.world_sizes),
                "engine": dict(self.engine), "engine_on_grid": dict(self.engine_on_grid),
                "runner": dict(self.runner), "ops": sorted(self.ops),
                "not_exact_on": dict(self.not_exact_on),
                "requires": list(self.requires),
                "scenario_tags": list(self.scenario_tags), "exercised_by": list(self.exercised_by),
                "caught_by": list(self.caught_by),
                "lives_in": self.lives_in, "mutant_of": self.mutant_of, "phases": list(self.phases),
                "events": list(self.events)}


_REGISTRY: dict[str, Toggle] = {}


def register(toggle: Toggle) -> Toggle:
    """Add a toggle; duplicates are refused."""
    if toggle.name in _REGISTRY:
        raise K3Error(f"toggle {toggle.name!r} is registered twice")
    _REGISTRY[toggle.name] = toggle
    return toggle


def get(name: str) -> Toggle:
    _load_all()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise K3Error(f"unknown toggle {name!r}{hint}")
    return _REGISTRY[name]


def all_toggles(kind: str | None = None) -> list[Toggle]:
    _load_all()
    return [t for t in _REGISTRY.values() if kind is None or t.kind == kind]


def resolve(names: list[str] | tuple[str, ...]) -> list[Toggle]:
    """Toggles by name plus everything they require, in a stable order."""
    out: dict[str, Toggle] = {}

    def add(n: str) -> None:
        t = get(n)
        for r in t.requires:
            add(r)
        out.setdefault(t.name, t)
    for n in names:
        add(n)
    return list(out.values())


@dataclass
class Applied:
    """What a set of applied toggles asks of the runner: engine and runner options, op slots."""

    toggles: list[Toggle]
    engine: dict[str, Any]
    runner: dict[str, Any]
    ops: dict[str, Callable[..., Any]]
    # calls of each swapped slot's implementation ("op:<slot>"), counted while applied
    events: Events = field(default_factory=Events)
    engine_on_grid: dict[str, Any] = field(default_factory=dict)

    def engine_at(self, grid: int | None) -> dict[str, Any]:
        """The engine options in force on KDA grid `grid` (None: off any grid)."""
        return _on_grid(self.engine, self.engine_on_grid, grid)

    def engine_for(self, device: Any) -> dict[str, Any]:
        """The engine options for an engine on `device`, on the KDA grid it will cut on there."""
        from .kernels.kda.grid import grid_in_force
        return self.engine_at(grid_in_force(device, self.engine.get("kda_grid")))


def engine_options(names: list[str] | tuple[str, ...], grid: int | None) -> dict[str, Any]:
    """The merged engine options of `names` (and what they require) on KDA grid `grid`."""
    toggles = resolve(names)
    return _on_grid(_merge(toggles, "engine"), _merge(toggles, "engine_on_grid"), grid)


def _on_grid(engine: dict[str, Any], engine_on_grid: dict[str, Any], grid: int | None) -> dict[str, Any]:
    # a toggle sets engine_on_grid only beside engine options (Toggle.__post_init__)
    return {**engine, **(engine_on_grid if grid else {})}


def _merge(toggles: list[Toggle], attr: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for t in toggles:
        for k, v in getattr(t, attr).items():
            if k == "faults":                      # mutants' faults accumulate
                options[k] = frozenset(options.get(k, frozenset())) | frozenset(v)
                continue
            if k in options and options[k] != v:
                what = "op slot" if attr == "ops" else f"{attr} option"
                raise K3Error(f"toggles disagree on {what} {k!r}: {options[k]!r} vs {v!r} ({t.name})")
            options[k] = v
    return options


@contextlib.contextmanager
def applied(names: list[str] | tuple[str, ...]) -> Iterator[Applied]:
    """Apply toggles: their op slots swapped for the block (always restored), and the merged
    engine / runner options they ask for. Two toggles that want one slot differently, or one
    engine option differently, are refused."""
    toggles = resolve(names)
    result = Applied(toggles, _merge(toggles, "engine"), _merge(toggles, "runner"), _merge(toggles, "ops"),
                     engine_on_grid=_merge(toggles, "engine_on_grid"))
    counted = {slot: _counted(fn, OP_PREFIX + slot, result.events) for slot, fn in result.ops.items()}
    with op_table.override(**counted):
        yield result


def _counted(fn: Callable[..., Any], event: str, events: Events) -> Callable[..., Any]:
    """fn, counting its calls as `event`; its attributes (a kda_grid mark ...) are kept."""
    def call(*args: Any, **kw: Any) -> Any:
        events.fire(event)
        return fn(*args, **kw)
    functools.update_wrapper(call, fn)
    # a caller that runs another form of this op in its place (the fast step's paged form of a
    # decode op, found through base_form) counts the call with this
    call.count_call = functools.partial(events.fire, event)  # type: ignore[attr-defined]
    return call


def base_form(fn: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """The implementation behind an op-table slot's counting wrapper (`_counted`), or fn itself."""
    return inspect.unwrap(fn) if fn is not None else None


def count_call(fn: Callable[..., Any] | None) -> None:
    """Count one call of the slot's implementation when another form of it ran in its place."""
    counter = getattr(fn, "count_call", None)
    if counter is not None:
        counter()


_LOADED = False
TOGGLE_MODULE_SUFFIX = "toggle_defs"


def toggle_modules() -> list[str]:
    """Every module under optimized_stack whose name ends with `toggle_defs`, sorted."""
    import optimized_stack
    return sorted(m.name for m in pkgutil.walk_packages(optimized_stack.__path__, "optimized_stack.")
                  if m.name.rsplit(".", 1)[-1].endswith(TOGGLE_MODULE_SUFFIX))


def _load_all() -> None:
    """Import the modules that define toggles (discovered, kept next to the code they switch)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import importlib
    for mod in toggle_modules():
        importlib.import_module(mod)
