"""Check suites as data: checks/<name>.toml, loaded, validated and expanded into work units.

A suite file:

    version = 1                      # SUITE_VERSION; anything else is refused
    description = "..."
    [[check]]
    kind = "diff"                    # one of CHECK_KINDS
    toggles = "all-exact"            # a selector (TOGGLE_SELECTORS) or a list of toggle names
    scenarios = ["single"]
    scale = 0.25

Validation is strict and happens before any work: an unknown kind, key, toggle or
scenario is a one-line UsageError (exit 2) with a "did you mean", and so is every value
the run itself would refuse (a needle length too short for its needle, limit = 0, a
bench argument bench cannot take, a base_url without a host); `args` are parsed and
validated by the gate command itself before the first unit runs (run_all.precheck).
Selectors resolve
against the toggle registry at expansion time, so a toggle that lands with its contract
is in every suite that says "all-exact" without editing the file.

Expansion turns each check into units, the smallest piece `k3verify all` runs and
records on its own (one file per unit, so a resumed run skips finished units):
diff/drift -> one unit per (toggle, scenario); gsm8k/needle/bench -> one per toggle
(or one reference run when the check names no toggles); selftest/golden/kvv -> one.
"""
from __future__ import annotations

from k3verify import REPO_ROOT

import difflib
import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from optimized_stack import toggles as toggle_registry
from optimized_stack.errors import K3Error

from k3verify.scenarios import workloads
from k3verify.errors import UsageError

SUITE_VERSION = 1
CHECKS_DIR = REPO_ROOT / "checks"
TOGGLE_SELECTORS = ("all", "all-exact", "all-approx")
QUALITY_KINDS = ("gsm8k", "needle", "kvv")

# kind -> keys it accepts (besides kind / name / description) and their defaults
CHECK_KINDS: dict[str, dict[str, Any]] = {
    "selftest": {"scale": 1.0},
    "diff": {"toggles": "all-exact", "scenarios": None, "scale": 1.0, "seed": 0},
    "drift": {"toggles": "all-approx", "scenarios": None, "scale": 1.0, "seed": 0},
    "golden": {},
    "gsm8k": {"toggles": None, "dataset": "synth", "limit": 20, "args": []},
    "needle": {"toggles": None, "lengths": [1024], "depths": [0.5], "args": []},
    "kvv": {"base_url": None, "args": []},
    "bench": {"toggles": "all", "args": []},
}
_COMMON_KEYS = ("kind", "name", "description")
# `args` words that `k3verify all` sets itself, or that a suite key sets: refused there, so a
# unit cannot write its report elsewhere, print JSON into the log, or run another toggle or model
RESERVED_ARGS = ("--report-dir", "--json", "--toggle", "--model")
KEY_FLAGS = {"gsm8k": {"--dataset": "dataset", "--limit": "limit"},
             "needle": {"--lengths": "lengths", "--depths": "depths"},
             "kvv": {"--base-url": "base_url", "--self": "base_url"}}
# bench `args` are key=value (no command parser): key -> (type, check, what the value must be)
BENCH_ARGS: dict[str, tuple[type, Any, str]] = {
    "workload": (str, lambda v: v in ("agentic", "decode", "prefill"), "one of agentic, decode, prefill"),
    "scale": (float, lambda v: 0 < v <= 64, "a number in (0, 64]"),
    "repeats": (int, lambda v: v >= 2, "an integer >= 2 (an interval needs two pairs)"),
}
BENCH_DEFAULTS = {"workload": "decode", "scale": 1.0, "repeats": 3}
NEEDLE_SHORT_TOKENS = 4096   # below this a length is built once here: a case has a minimum (header,
                             # question, needles: ~400 tokens); above it no case is that short


def bench_options(words: list[str], where: str = "bench args") -> dict[str, Any]:
    """["workload=agentic", "repeats=3"] -> {"workload": "agentic", "scale": 1.0, "repeats": 3}; bad words
    are a UsageError (run_all.run_bench uses the same parse, so the pre-check is the run's)."""
    out = dict(BENCH_DEFAULTS)
    for word in words:
        key, sep, text = word.partition("=")
        if not sep or key not in BENCH_ARGS:
            raise UsageError(f"{where}: expected key=value with key one of {', '.join(BENCH_ARGS)}, got {word!r}"
                             + (_hint(key, list(BENCH_ARGS)) if sep else ""))
        kind, ok, what = BENCH_ARGS[key]
        try:
            value = kind(text)
        except ValueError:
            raise UsageError(f"{where}: {key} must be {what}, got {text!r}") from None
        if not ok(value):
            raise UsageError(f"{where}: {key} must be {what}, got {text!r}")
        out[key] = value
    return out


def _hint(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(str(word), known, n=1)
    return f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(known)})"


@dataclass(frozen=True)
class CheckSpec:
    """One [[check]] of a suite, validated; `options` holds every kind-specific key with defaults filled."""

    index: int
    kind: str
    name: str
    description: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    where: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CHECK_KINDS:
            raise UsageError(f"{self.where}: unknown check kind {self.kind!r}{_hint(self.kind, list(CHECK_KINDS))}")
        allowed = CHECK_KINDS[self.kind]
        for key in self.options:
            if key not in allowed:
                raise UsageError(f"{self.where} ({self.kind}): unknown key {key!r}"
                                 f"{_hint(key, list(allowed) + list(_COMMON_KEYS))}")
        filled = {**allowed, **self.options}
        object.__setattr__(self, "options", filled)
        self._validate_values(filled)

    def _validate_values(self, o: dict[str, Any]) -> None:
        w = f"{self.where} ({self.kind})"
        if "toggles" in o and o["toggles"] is not None:
            t = o["toggles"]
            if isinstance(t, str):
                if t not in TOGGLE_SELECTORS:
                    raise UsageError(f"{w}: toggles must be one of {', '.join(TOGGLE_SELECTORS)} or a list of "
                                     f"toggle names, got {t!r}{_hint(t, list(TOGGLE_SELECTORS))}")
            elif isinstance(t, list) and t and all(isinstance(x, str) for x in t):
                for name in t:
                    try:
                        toggle = toggle_registry.get(name)
                    except K3Error as exc:
                        raise UsageError(f"{w}: {exc}") from None
                    if self.kind == "drift" and toggle.contract.kind != "approx":
                        raise UsageError(f"{w}: drift checks approx toggles; {name!r} has an exact contract "
                                         f"(use kind = \"diff\")")
            else:
                raise UsageError(f"{w}: toggles must be a selector string or a non-empty list of names, got {t!r}")
        if o.get("scenarios") is not None:
            s = o["scenarios"]
            if not isinstance(s, list) or not s or not all(isinstance(x, str) for x in s):
                raise UsageError(f"{w}: scenarios must be a non-empty list of names, got {s!r}")
            for name in s:
                if name not in workloads.SCENARIOS:
                    raise UsageError(f"{w}: unknown scenario {name!r}{_hint(name, list(workloads.SCENARIOS))}")
        if "scale" in o:
            v = o["scale"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 64:
                raise UsageError(f"{w}: scale must be a number in (0, 64], got {v!r}")
        if "seed" in o and (isinstance(o["seed"], bool) or not isinstance(o["seed"], int) or o["seed"] < 0):
            raise UsageError(f"{w}: seed must be an integer >= 0, got {o['seed']!r}")
        if "limit" in o and (isinstance(o["limit"], bool) or not isinstance(o["limit"], int) or o["limit"] < 1):
            raise UsageError(f"{w}: limit must be an integer >= 1 (questions), got {o['limit']!r}")
        if "depths" in o and not (isinstance(o["depths"], list) and o["depths"]
                                  and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1
                                          for x in o["depths"])):
            raise UsageError(f"{w}: depths must be a non-empty list of fractions in [0, 1], got {o['depths']!r}")
        if "lengths" in o:
            self._validate_lengths(w, o["lengths"], o["depths"])
        if "args" in o:
            self._validate_args(w, o["args"])
        if self.kind == "gsm8k" and o["dataset"] not in ("synth", "gsm8k"):
            raise UsageError(f"{w}: dataset must be 'synth' or 'gsm8k', got {o['dataset']!r}")
        if self.kind == "kvv" and o["base_url"] is not None:
            url = urlparse(str(o["base_url"]))
            if url.scheme not in ("http", "https") or not url.netloc:
                raise UsageError(f"{w}: base_url must be an http(s) URL with a host, like "
                                 f"http://127.0.0.1:8000/v1, got {o['base_url']!r}")

    def _validate_lengths(self, w: str, lengths: Any, depths: list[float]) -> None:
        from k3verify.commands.needle import MAX_LENGTH_TOKENS
        from k3verify.quality.evals import needle

        if not (isinstance(lengths, list) and lengths
                and all(isinstance(x, int) and not isinstance(x, bool) and 0 < x <= MAX_LENGTH_TOKENS for x in lengths)):
            raise UsageError(f"{w}: lengths must be a non-empty list of token counts in [1, {MAX_LENGTH_TOKENS}], "
                             f"got {lengths!r}")
        short = [x for x in lengths if x < NEEDLE_SHORT_TOKENS]
        if short:                                     # the needle command builds these cases first too
            try:
                needle.grid(short, depths)
            except K3Error as exc:
                raise UsageError(f"{w}: lengths {short}: {exc}") from None

    def _validate_args(self, w: str, args: Any) -> None:
        if not (isinstance(args, list) and all(isinstance(x, str) for x in args)):
            raise UsageError(f"{w}: args must be a list of strings (extra command-line arguments), got {args!r}")
        if self.kind == "bench":
            bench_options(args, f"{w}: args")
            return
        for word in args:
            flag = word.split("=", 1)[0]
            if flag in RESERVED_ARGS:
                raise UsageError(f"{w}: args may not set {flag}: `k3verify all` sets it for every unit")
            key = KEY_FLAGS.get(self.kind, {}).get(flag)
            if key:
                raise UsageError(f"{w}: args may not set {flag}: use the suite key {key!r}")


@dataclass(frozen=True)
class Suite:
    name: str
    version: int
    description: str
    checks: tuple[CheckSpec, ...]
    path: str
    sha256: str
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "description": self.description,
                "path": self.path, "sha256": self.sha256,
                "checks": [{"index": c.index, "kind": c.kind, "name": c.name, "options": c.options}
                           for c in self.checks]}


def builtin_suites() -> list[str]:
    return sorted(p.stem for p in CHECKS_DIR.glob("*.toml"))


def suite_path(name_or_path: str) -> Path:
    """'premerge' -> checks/premerge.toml; anything that names an existing file -> that file."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    builtin = CHECKS_DIR / f"{name_or_path}.toml"
    if builtin.is_file():
        return builtin
    raise UsageError(f"unknown suite {name_or_path!r}{_hint(name_or_path, builtin_suites())}; "
                     f"pass a built-in name or a path to a .toml suite file")


def parse_suite(text: str, name: str = "<suite>", path: str = "<string>") -> Suite:
    """Validate suite TOML text; every problem is one UsageError line naming the file and check."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML ({exc})") from None
    unknown = sorted(set(data) - {"version", "description", "check", "name"})
    if unknown:
        raise UsageError(f"{path}: unknown top-level key {unknown[0]!r}"
                         f"{_hint(unknown[0], ['version', 'description', 'check', 'name'])}")
    if "version" not in data:
        raise UsageError(f"{path}: missing 'version' (expected version = {SUITE_VERSION})")
    if data["version"] != SUITE_VERSION:
        raise UsageError(f"{path}: version must be {SUITE_VERSION}, got {data['version']!r}")
    raw = data.get("check")
    if not isinstance(raw, list) or not raw:
        raise UsageError(f"{path}: expected at least one [[check]] table, got {type(raw).__name__ if raw else 'none'}")
    checks, names = [], set()
    for i, c in enumerate(raw, 1):
        where = f"{path}: check {i}"
        if not isinstance(c, dict) or "kind" not in c:
            raise UsageError(f"{where}: every [[check]] needs kind = one of {', '.join(CHECK_KINDS)}")
        options = {k: v for k, v in c.items() if k not in _COMMON_KEYS}
        cname = str(c.get("name") or c["kind"])
        if cname in names:
            cname = f"{cname}-{i}"
        names.add(cname)
        checks.append(CheckSpec(i, c["kind"], cname, str(c.get("description", "")), options, where))
    return Suite(name=str(data.get("name", name)), version=data["version"],
                 description=str(data.get("description", "")), checks=tuple(checks), path=path,
                 sha256=hashlib.sha256(text.encode()).hexdigest(), text=text)


def load_suite(name_or_path: str) -> Suite:
    p = suite_path(name_or_path)
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{p}: a suite is UTF-8 TOML text; byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                         f"is not UTF-8") from None
    return parse_suite(text, name=p.stem, path=str(p))


# ---- expansion into units -------------------------------------------------------------

def select_toggles(selector: str | list[str] | None, kind: str) -> list[str]:
    """Toggle names a check applies to; mutants only when named explicitly."""
    if selector is None:
        return []
    if isinstance(selector, list):
        return list(selector)
    opts = toggle_registry.all_toggles("optimization")
    if kind in QUALITY_KINDS:
        # a quality gate runs for the approx toggles whose contract names it
        opts = [t for t in opts if t.contract.kind == "approx" and kind in t.contract.quality]
    if selector == "all-exact":
        opts = [t for t in opts if t.contract.kind == "exact"]
    elif selector == "all-approx":
        opts = [t for t in opts if t.contract.kind == "approx"]
    return [t.name for t in opts]


def scenarios_for(toggle_name: str, names: list[str] | None, scale: float, seed: int) -> tuple[list[str], str]:
    """(scenario names, the reason when chosen automatically).

    No list: verify's default set plus every scenario that exercises the toggle (what
    `k3verify diff` runs). A list is used as written (the selftest already runs each
    toggle on the scenario that exercises it); listed scenarios a toggle does not apply
    to stay, so the skip is in the report, and if none applies the first tagged
    scenario is added and the report says why (an automatic choice is always stated).
    """
    from k3verify.kinds import diff as verify

    toggle = toggle_registry.get(toggle_name)
    if not names:
        return [sc.name for sc in verify.scenarios_for(toggle, None, scale, seed)], ""
    tags = set(toggle.scenario_tags)
    if not tags or any(tags & set(workloads.build(n, scale=scale, seed=seed).tags) for n in names):
        return list(names), ""
    for n in workloads.SCENARIOS:
        if tags & set(workloads.build(n, scale=0.25, seed=seed).tags):
            return list(names) + [n], f"added {n!r}: none of {names} carries the toggle's tags {sorted(tags)}"
    return list(names), ""


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:60]


def expand(suite: Suite) -> list[dict[str, Any]]:
    """The suite as an ordered list of units: {"id", "check_index", "check", "kind", "toggle", "scenario", "options", "note"}."""
    units: list[dict[str, Any]] = []

    def add(check: CheckSpec, toggle: str | None = None, scenario: str | None = None, note: str = "") -> None:
        label = "-".join(_slug(x) for x in (check.name, toggle, scenario) if x)
        units.append({"id": f"{len(units) + 1:03d}-{label}", "check_index": check.index, "check": check.name,
                      "kind": check.kind, "toggle": toggle, "scenario": scenario, "options": check.options,
                      "note": note})

    for check in suite.checks:
        o = check.options
        if check.kind in ("diff", "drift"):
            for t in select_toggles(o["toggles"], check.kind):
                names, note = scenarios_for(t, o["scenarios"], o["scale"], o["seed"])
                for s in names:
                    add(check, t, s, note)
        elif check.kind in ("gsm8k", "needle", "bench"):
            toggles = select_toggles(o["toggles"], check.kind)
            if o["toggles"] is None or (check.kind != "bench" and not toggles):
                add(check, None, None, "" if o["toggles"] is None else
                    f"no toggle selected by {o['toggles']!r} names {check.kind} in its contract: reference only")
            for t in toggles:
                add(check, t)
        else:
            add(check)
    return units
