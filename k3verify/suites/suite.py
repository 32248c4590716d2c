"""Check suites as data: checks/<name>.toml, loaded, validated and expanded into work units.

A suite file:

    version = 2                      # SUITE_VERSION; anything else is refused
    description = "..."
    [[check]]
    kind = "diff"                    # a check kind (kinds/__init__.py)
    toggles = "all-exact"            # a selector (all, all-exact, all-approx) or a list of toggle names
    scenarios = ["single"]
    scale = 0.25
    ships = ["batched_decode", ...]  # optional: the configuration a sign-off of this suite signs

Every key of a check other than kind / name / description is one of its kind's OPTIONS
(kinds/<kind>.py), and validation is the kind's own: an unknown kind, key, toggle or
scenario is a one-line UsageError (exit 2) with a "did you mean", and so is every value the
run itself would refuse (a needle length too short for its needles, limit = 0, repeats = 1,
a base_url without a host), all before any work. Version 2 names every option as a key
(version 1 passed some as command-line words in `args`). Selectors resolve against the
toggle registry at expansion time, so a toggle that lands with its contract is in every
suite that says "all-exact" without editing the file.

Expansion is each kind's plan(): the check's units, the smallest piece `k3verify all` runs
and records on its own (one file per unit, so a resumed run skips finished units):
diff/drift -> one unit per (toggle, scenario); selftest -> one per registry entry;
gsm8k/needle/bench -> one per toggle (or one reference run when the check names no
toggles); golden/kvv -> one.

`priors` names a units.tsv of an earlier run on the suite's device (perf/unit_times.py): measured
seconds per unit for `all --jobs N`'s assignment (suites/shards.py); scheduling only.

`ships` names the toggles the release turns on (suites/signoff.py): a sign-off then signs that
configuration, and a toggle the gate rejected or could not decide blocks it only if it ships; without
`ships` every judged toggle must hold. Declared in the suite, before any run, so the configuration is
never chosen after reading the verdicts.
"""
from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3verify import REPO_ROOT, kinds
from k3verify.errors import UsageError
from k3verify.io import loads_toml
from k3verify.kinds.base import COMMON_KEYS, CheckSpec, Unit, hint

SUITE_VERSION = 2
CHECKS_DIR = REPO_ROOT / "checks"
_TOP_KEYS = ["version", "description", "check", "name", "ships", "priors"]
V1_MOVED = ("version 1 passed options as command-line words in `args`; version 2 names each as a key "
            "(gsm8k: num_fewshot, max_new_tokens, smoke, ...; needle: samples, distractors, ...; "
            "bench: workload, scale, repeats): see checks/README.md")


@dataclass(frozen=True)
class Suite:
    name: str
    version: int
    description: str
    checks: tuple[CheckSpec, ...]
    path: str
    sha256: str
    text: str
    ships: tuple[str, ...] | None = None      # the release configuration a sign-off signs (None: all)
    priors: dict[str, float] | None = None    # measured seconds per unit (prior_key), for the shards
    priors_source: dict[str, Any] | None = None   # the priors file: path, sha256, units

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "description": self.description,
                "path": self.path, "sha256": self.sha256,
                **({"ships": list(self.ships)} if self.ships is not None else {}),
                **({"priors": dict(self.priors_source)} if self.priors_source else {}),
                "checks": [{"index": c.index, "kind": c.kind, "name": c.name, "options": dict(c.options),
                            **({"model": c.model} if c.model else {})} for c in self.checks]}


CHECK_DTYPES = ("float32", "bfloat16")


def model_spec(model: str, dtype: str | None) -> str:
    """A check's model as one key: 'golden/k3-dims' or, with its own dtype, 'golden/k3-dims:float32'
    (the key of its context, its units and its verdicts: `toggle@golden/k3-dims:float32`)."""
    return f"{model}:{dtype}" if dtype else model


def split_model_spec(spec: str) -> tuple[str, str | None]:
    """model_spec's inverse: ('golden/k3-dims', 'float32') or ('k3-small', None)."""
    name, sep, dtype = spec.rpartition(":")
    return (name, dtype) if sep and dtype in CHECK_DTYPES and name else (spec, None)


def builtin_suites() -> list[str]:
    return sorted(p.stem for p in CHECKS_DIR.glob("*.toml"))


def suite_path(name_or_path: str, device: str = "cpu") -> Path:
    """'premerge' -> checks/premerge.toml; anything that names an existing file -> that file. A
    built-in name on another device takes that device's form when one ships (`release` with
    --device cuda -> checks/release.cuda.toml: the same gate sized and modelled for the GPU)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    on_device = CHECKS_DIR / f"{name_or_path}.{device}.toml"
    if device != "cpu" and on_device.is_file():
        return on_device
    builtin = CHECKS_DIR / f"{name_or_path}.toml"
    if builtin.is_file():
        return builtin
    raise UsageError(f"unknown suite {name_or_path!r}{hint(name_or_path, builtin_suites())}; "
                     f"pass a built-in name or a path to a .toml suite file")


def parse_suite(text: str, name: str = "<suite>", path: str = "<string>") -> Suite:
    """Validate suite TOML text; every problem is one UsageError line naming the file and check."""
    try:
        data = loads_toml(text, path)            # bounded: depth, int size
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML ({exc})") from None
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise UsageError(f"{path}: unknown top-level key {unknown[0]!r}{hint(unknown[0], _TOP_KEYS)}")
    if "version" not in data:
        raise UsageError(f"{path}: missing 'version' (expected version = {SUITE_VERSION})")
    if data["version"] != SUITE_VERSION:
        moved = f"; {V1_MOVED}" if data["version"] == 1 else ""
        raise UsageError(f"{path}: version must be {SUITE_VERSION}, got {data['version']!r}{moved}")
    raw = data.get("check")
    if not isinstance(raw, list) or not raw:
        raise UsageError(f"{path}: expected at least one [[check]] table, got {type(raw).__name__ if raw else 'none'}")
    checks, names = [], set()
    for i, c in enumerate(raw, 1):
        where = f"{path}: check {i}"
        if not isinstance(c, dict) or "kind" not in c:
            raise UsageError(f"{where}: every [[check]] needs kind = one of {', '.join(kinds.names())}")
        if not isinstance(c["kind"], str):
            raise UsageError(f"{where}: expected kind to be a string, one of {', '.join(kinds.names())}; "
                             f"got a {type(c['kind']).__name__}")
        options = {k: v for k, v in c.items() if k not in COMMON_KEYS}
        model = c.get("model")
        if model is not None and not (isinstance(model, str) and model.strip()):
            raise UsageError(f"{where}: model must be a preset name or a checkpoint directory, got {model!r}")
        dtype = c.get("dtype")
        if dtype is not None:
            # a check's own dtype (the GPU release suite judges approx mutants in fp32, where their
            # budget resolves them): its model is loaded in that dtype, as a model of its own
            if dtype not in CHECK_DTYPES:
                raise UsageError(f"{where}: dtype must be one of {', '.join(CHECK_DTYPES)}, got {dtype!r}")
            if model is None:
                raise UsageError(f"{where}: dtype = {dtype!r} needs the check's own model = \"...\" "
                                 f"(the run's model is loaded in the run's --dtype)")
            model = model_spec(model, dtype)
        cname = str(c.get("name") or c["kind"])
        if cname in names:
            cname = f"{cname}-{i}"
        names.add(cname)
        checks.append(CheckSpec(c["kind"], cname, options, index=i, description=str(c.get("description", "")),
                                where=where, model=model))
    return Suite(name=str(data.get("name", name)), version=data["version"],
                 description=str(data.get("description", "")), checks=tuple(checks), path=path,
                 sha256=hashlib.sha256(text.encode()).hexdigest(), text=text,
                 ships=parse_ships(data["ships"], f"{path}: ships") if "ships" in data else None,
                 **(load_priors(data["priors"], path) if "priors" in data else {}))


def load_priors(value: Any, suite_path: str) -> dict[str, Any]:
    """`priors = "FILE"` (relative to the suite file): a units.tsv of an earlier run on the device the
    suite is sized for (perf/unit_times.py); only the shards' assignment reads it, never a verdict."""
    from k3verify.suites.shards import prior_key
    where = f"{suite_path}: priors"
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{where}: expected a path to a units.tsv (perf/unit_times.py), got {value!r}")
    file = Path(value) if Path(value).is_absolute() else Path(suite_path).parent / value
    try:
        raw = file.read_bytes()
        lines = raw.decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where}: cannot read {file} ({exc})") from None
    header = lines[0].split("\t") if lines else []
    if "unit" not in header or "seconds" not in header:
        raise UsageError(f"{where}: {file} is not a units.tsv (its first line needs the columns unit and seconds)")
    iu, isec = header.index("unit"), header.index("seconds")
    priors: dict[str, float] = {}
    for n, line in enumerate(lines[1:], 2):
        cells = line.split("\t")
        try:
            seconds = float(cells[isec])
        except (IndexError, ValueError):
            raise UsageError(f"{where}: {file} line {n}: expected seconds, got {line[:80]!r}") from None
        if not seconds >= 0:
            raise UsageError(f"{where}: {file} line {n}: seconds must be >= 0, got {seconds}")
        priors[prior_key(cells[iu])] = seconds
    return {"priors": priors, "priors_source": {"file": value, "sha256": hashlib.sha256(raw).hexdigest(),
                                                "units": len(priors)}}


def parse_ships(value: Any, where: str) -> tuple[str, ...]:
    """A release configuration: a non-empty list of distinct registered optimization toggles."""
    from optimized_stack import toggles as registry
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
        raise UsageError(f"{where}: expected a non-empty list of toggle names, got {value!r}")
    known = [t.name for t in registry.all_toggles("optimization")]
    for name in value:
        if name not in known:
            mutant = name in {t.name for t in registry.all_toggles("mutant")}
            raise UsageError(f"{where}: {name!r} is " + ("a mutant, which never ships" if mutant else
                             f"not a registered optimization toggle{hint(name, known)}"))
    dup = next((v for i, v in enumerate(value) if v in value[:i]), None)
    if dup:
        raise UsageError(f"{where}: {dup!r} is listed twice")
    return tuple(value)


def load_suite(name_or_path: str, device: str = "cpu") -> Suite:
    p = suite_path(name_or_path, device)
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{p}: a suite is UTF-8 TOML text; byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                         f"is not UTF-8") from None
    return parse_suite(text, name=p.stem, path=str(p))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:60]


def expand(suite: Suite) -> list[Unit]:
    """The suite as an ordered list of units, each with its id `NNN-<check>-<toggle>-<scenario>`
    (the name of the file a finished unit leaves)."""
    units: list[Unit] = []
    for check in suite.checks:
        for u in kinds.plan(check):
            label = "-".join(_slug(x) for x in (u.check, u.toggle, u.scenario, check.model) if x)
            units.append(Unit(u.kind, u.check, u.options, u.toggle, u.scenario, u.note, u.check_index,
                              id=f"{len(units) + 1:03d}-{label}", model=check.model))
    return units
