"""One result of one check: the row every check kind returns and every report holds.

A Result says what was checked (toggle, kind, contract, check, scenario), how it came out
(status, reason) and the evidence (findings, first divergence, localization, speedup ...).
Every producer builds one through a constructor named by its status, so a status, and the
rule that anything but a pass states its reason, are checked where the row is made:

    Result.passed(subject, "logits", "bit-identical (12 compared)", scenario="single")
    Result.failed(subject, "drift_budget", "max KL 3e-2 > budget 1e-6", findings=[...])
    Result.skipped(subject, "needle", "toggle runs on cuda, not cpu")
    Result.errored(subject, "gsm8k", "ValueError: ...")
    Result.inconclusive(subject, "gsm8k/strict-match", "n=2 cannot resolve a margin of 1 point")
    Result.not_exercised(subject, "tokens", "no prefix hit fired on multi_turn")

Statuses (STATUSES; report/schema.py reads them and the field list from here):
- pass:          the check ran and held;
- fail:          it ran and did not hold (the reason says where);
- skip:          it did not run here (device, world size, nothing to compare), with the reason;
- error:         it could not be run to the end (a crash, a gate that could not start);
- inconclusive:  it ran and could not decide (too few questions for the margin); a run with one
                 (outside a smoke test) is inconclusive, never a pass;
- not_exercised: it ran, but the toggle's own code path never did (no prefix hit, no
                 rejection, no restore): shown as "not exercised", never counted as a pass;
                 like a skip it neither fails the run nor proves the toggle (JUnit: skipped).

`extra` holds a kind's own evidence keys (filter, accuracy, questions, role, gate, unit ...);
in the report row they sit beside the fixed fields (the schema allows extra keys).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from optimized_stack.errors import K3Error


@dataclass(frozen=True)
class Status:
    name: str          # the value of a result's "status"
    summary_key: str   # its count in a report's summary
    label: str         # how a person reads it
    junit: str         # the JUnit element it becomes ("" for a plain passing testcase)
    constructor: str   # Result.<constructor>(subject, check, reason, **fields)


STATUS_TABLE = (
    Status("pass", "passed", "pass", "", "passed"),
    Status("fail", "failed", "fail", "failure", "failed"),
    Status("skip", "skipped", "skip", "skipped", "skipped"),
    Status("error", "errors", "error", "error", "errored"),
    Status("inconclusive", "inconclusive", "inconclusive", "skipped", "inconclusive"),
    Status("not_exercised", "not_exercised", "not exercised", "skipped", "not_exercised"),
)
STATUSES = tuple(s.name for s in STATUS_TABLE)
STATUS = {s.name: s for s in STATUS_TABLE}
KINDS = ("optimization", "mutant")
ROLES = ("gate", "smoke")          # "smoke": its pass or inconclusive counts toward no verdict


@dataclass(frozen=True)
class Subject:
    """What a result is about: a registry toggle, or a named thing that is not one."""

    toggle: str
    kind: str = "optimization"
    contract: str = "exact"

    @classmethod
    def of(cls, name: str) -> "Subject":
        """A registry toggle's labels; unknown names are a K3Error with a did-you-mean."""
        from optimized_stack import toggles as registry
        t = registry.get(name)
        return cls(t.name, t.kind, t.contract.describe())

    @classmethod
    def of_optional(cls, name: str | None) -> "Subject":
        """`of(name)`, or the reference path measured alone when name is None."""
        return MEASUREMENT if name is None else cls.of(name)


REFERENCE = Subject("(reference)")                       # checks of the reference path itself (golden)
MEASUREMENT = Subject("reference", contract="measurement (reference path)")   # a gate run without a toggle


def _schema(*types: type, nullable: bool = False, required: bool = True) -> dict[str, Any]:
    return {"json": types, "nullable": nullable, "required": required}


_NUMBER = (int, float)


@dataclass
class Result:
    toggle: str = field(metadata=_schema(str))
    kind: str = field(metadata=_schema(str))
    contract: str = field(metadata=_schema(str))
    check: str = field(metadata=_schema(str))
    scenario: str | None = field(metadata=_schema(str, nullable=True))
    status: str = field(metadata=_schema(str))
    reason: str = field(metadata=_schema(str))
    findings: list[dict] = field(default_factory=list, metadata=_schema(list))
    first_divergence: dict | None = field(default=None, metadata=_schema(dict, nullable=True))
    localization: dict | None = field(default=None, metadata=_schema(dict, nullable=True))
    caught: bool | None = field(default=None, metadata=_schema(bool, nullable=True))
    duration_s: float = field(default=0.0, metadata=_schema(*_NUMBER))
    speedup: dict | None = field(default=None, metadata=_schema(dict, nullable=True))
    # optional in a report (rows written before it existed lack it)
    evidence: dict = field(default_factory=dict, metadata=_schema(dict, required=False))
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUS:
            raise K3Error(f"result status: expected one of {', '.join(STATUSES)}, got {self.status!r}")
        if self.kind not in KINDS:
            raise K3Error(f"result kind: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.status != "pass" and not str(self.reason).strip():
            raise K3Error(f"a {STATUS[self.status].label} result must state its reason "
                          f"({self.toggle} / {self.check})")
        self.duration_s = max(0.0, float(self.duration_s))
        role = self.extra.get("role")
        if role is not None and role not in ROLES:
            raise K3Error(f"result role: expected one of {', '.join(ROLES)}, got {role!r}")

    # ---- constructors, one per status ------------------------------------------------------
    @classmethod
    def make(cls, status: str, subject: Subject, check: str, reason: str, *, scenario: str | None = None,
             **more: Any) -> "Result":
        """A result with a computed status (a paired test's verdict). The constructors named by
        status (Result.passed, .failed, .skipped, .errored, .inconclusive, .not_exercised: one
        per STATUS_TABLE row, made below the class) are this with the status fixed. Keys that
        are not fields go to `extra`."""
        own = {f.name for f in fields(cls)} - {"extra"}
        extra = {**more.pop("extra", {}), **{k: more.pop(k) for k in list(more) if k not in own}}
        return cls(toggle=subject.toggle, kind=subject.kind, contract=subject.contract, check=check,
                   scenario=scenario, status=status, reason=reason, extra=extra, **more)

    # ---- the report row ----------------------------------------------------------------------
    @property
    def subject(self) -> Subject:
        return Subject(self.toggle, self.kind, self.contract)

    def tag(self, **extra: Any) -> "Result":
        """Add evidence keys to the row (the suite runner's unit and check, a gate's name); returns self."""
        self.extra.update(extra)
        return self

    def to_dict(self) -> dict[str, Any]:
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**row, **self.extra}

    def __getitem__(self, key: str) -> Any:
        """A result reads like its report row: r["status"], r["accuracy"] (an extra key)."""
        return self.extra[key] if key in self.extra else getattr(self, key) if key in _OWN else self.extra[key]

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> "Result":
        own = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in row.items() if k in own},
                   extra={k: v for k, v in row.items() if k not in own})


def _constructor(status: Status):
    def build(cls, subject: Subject, check: str, reason: str, **kw: Any) -> Result:
        return cls.make(status.name, subject, check, reason, **kw)
    build.__name__ = build.__qualname__ = status.constructor
    build.__doc__ = f"A {status.label!r} result: Result.make({status.name!r}, subject, check, reason, **fields)."
    return classmethod(build)


for _status in STATUS_TABLE:
    setattr(Result, _status.constructor, _constructor(_status))
_OWN = frozenset(f.name for f in fields(Result)) - {"extra"}


def schema_fields() -> dict[str, tuple[tuple[type, ...], bool]]:
    """Report key -> (accepted JSON types, nullable) for every required field of a result row."""
    return {f.name: (f.metadata["json"], f.metadata["nullable"]) for f in fields(Result)
            if f.metadata.get("required")}
