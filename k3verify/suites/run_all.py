"""`k3verify all`: run every unit of a suite through its check kind, one file per finished
unit, then one report (suites/verdicts.py).

Run directory (reports/<run-id>/ or --report-dir):
    plan.json             the suite text, model and the expanded units, written first
    checks/NNN-<id>.json  one per finished unit, written atomically: a unit is done
                          exactly when its file exists, so --resume after kill -9
                          skips finished units and runs each unit at most once more;
                          each records its provenance (model sha256, suite name and
                          content hash, plan hash) and a resume refuses a file whose
                          provenance is not the run's (one copied from another run)
    gates/<unit>/         each quality-gate unit's results as a report of their own
    toggles/<name>/       a diff report per toggle (what a verdict links to)
    report.*              the combined report (json, md, html, junit), written last

Every unit runs through kinds.run(unit, ctx), exactly as the kind's own command runs it;
all units share one Context (the model, the scenario runners with their cached reference
captures, one per world size). A unit that crashes is an error result and the run goes on;
a quality gate that could not start (an endpoint that does not answer) is one too.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from k3verify import kinds
from k3verify.compare import golden
from k3verify.errors import UsageError
from k3verify.io import ReadError, atomic_write_json, make_dir, read_json
from k3verify.kinds.base import QUALITY_KINDS, Context, Unit, hint
from k3verify.report import build_report, write_report
from k3verify.suites.suite import Suite, expand, split_model_spec
from k3verify.verdict.result import Result, Subject
from optimized_stack.errors import K3Error

PLAN_FORMAT = "k3verify.all-plan"
PLAN_VERSION = 2           # v2: units are the check kinds' (kinds/base.py Unit), options as suite v2 keys


def unit_path(run_dir: Path, unit: Unit) -> Path:
    return run_dir / "checks" / f"{unit.id}.json"


def provenance(plan: dict) -> dict[str, Any]:
    """What a checks file must share with the run that reuses it: the model's sha256, the suite
    (name and content hash) and the plan (hash of its expanded units). Written into every checks
    file; a resume accepts only files whose provenance equals the current run's."""
    units = json.dumps(plan["units"], sort_keys=True, separators=(",", ":"), default=str)
    return {"model_id": plan.get("model_id"),
            "suite": {"name": (plan.get("suite") or {}).get("name"),
                      "sha256": hashlib.sha256(str(plan.get("suite_text", "")).encode("utf-8")).hexdigest()},
            "plan_sha256": hashlib.sha256(units.encode("utf-8")).hexdigest()}


def _provenance_problem(got: Any, want: dict[str, Any]) -> str | None:
    """What differs between a checks file's provenance and the current run's, or None."""
    if not isinstance(got, dict):
        return "it records no model, suite or plan (written by an older k3verify or another tool)"
    diffs = []
    if got.get("model_id") != want["model_id"]:
        diffs.append(f"model {str(got.get('model_id'))[:30]} (this run: {str(want['model_id'])[:30]})")
    g_suite = got.get("suite") if isinstance(got.get("suite"), dict) else {}
    if g_suite.get("name") != want["suite"]["name"]:
        diffs.append(f"suite {g_suite.get('name')!r} (this run: {want['suite']['name']!r})")
    elif g_suite.get("sha256") != want["suite"]["sha256"]:
        diffs.append(f"suite content sha256 {str(g_suite.get('sha256'))[:12]} (this run: "
                     f"{want['suite']['sha256'][:12]})")
    if got.get("plan_sha256") != want["plan_sha256"]:
        diffs.append(f"plan sha256 {str(got.get('plan_sha256'))[:12]} (this run: {want['plan_sha256'][:12]})")
    return "; ".join(diffs) or None


def finished(run_dir: Path, unit: Unit, expect: dict[str, Any] | None = None) -> list[dict] | None:
    """The unit's results if its file is complete and belongs to this unit, else None. With
    `expect` (provenance(plan)), a complete file of this unit whose model, suite or plan differ is
    refused (UsageError naming what differs): its results would mix two runs in one report."""
    p = unit_path(run_dir, unit)
    try:
        data = read_json(p)
    except (OSError, ValueError, ReadError):      # also a file cut short, not UTF-8 or too deep: not finished
        return None
    mine = isinstance(data, dict) and isinstance(data.get("unit"), dict) and data["unit"].get("id") == unit.id
    if not mine:
        return None
    if expect is not None:
        problem = _provenance_problem(data.get("provenance"), expect)
        if problem:
            raise UsageError(f"cannot resume: {p} is not this run's: {problem}")
    return data["results"]


def check_finished(plan: dict, run_dir: Path) -> None:
    """Refuse, before any unit runs, a checks file that belongs to another model, suite or plan."""
    expect = provenance(plan)
    for unit in plan_units(plan):
        finished(run_dir, unit, expect)


def only_toggles(names: tuple[str, ...]) -> tuple[str, ...]:
    """`--only` names with the mutants of each (a toggle is judged beside its negative controls, so a
    restricted run still proves its gates can fail). A name that is not a toggle is a UsageError."""
    from optimized_stack import toggles as registry
    known = [t.name for t in registry.all_toggles()]
    for name in names:
        if name not in known:
            raise UsageError(f"--only {name!r}: not a registered toggle{hint(name, known)}")
    mutants = [t.name for t in registry.all_toggles("mutant") if t.mutant_of in names]
    return tuple(dict.fromkeys([*names, *mutants]))


def only_units(suite: Suite, units: list[Unit], names: tuple[str, ...]) -> list[Unit]:
    """The suite's units of the toggles `names` name (with their mutants), under the ids they have in
    the whole suite (so the suite's priors still size them and a unit's file name says where it sits
    in the full run). A name the suite never judges is a UsageError: a restricted run that ran
    nothing of it would read as that toggle judged."""
    keep = only_toggles(names)
    for name in names:
        if not any(u.toggle == name for u in units):
            raise UsageError(f"--only {name!r}: suite {suite.name!r} has no unit of it (its checks never judge it "
                             f"on --device/--dtype as given)")
    return [u for u in units if u.toggle in keep]


def new_plan(suite: Suite, model_arg: str | None, model, run_id: str, command: str, *,
             device: str = "cpu", dtype: str = "float32", only: tuple[str, ...] = ()) -> dict[str, Any]:
    units = expand(suite)
    if only:
        units = only_units(suite, units, only)          # with their mutants; `only` records the names given
    return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "run_id": run_id, "command": command,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": model_arg,
            "device": device, "dtype": dtype,
            "model_id": golden.model_id(model),
            # `only` in the suite's record: the report and its sign-off see that this run judged part of it
            "suite": {**suite.to_dict(), **({"only": list(only)} if only else {})}, "suite_text": suite.text,
            "units": [u.to_dict() for u in units],
            # measured seconds per unit for the shards' assignment (suites/shards.py), in the plan so
            # every worker of this run, and a resumed one, assigns from the same figures
            **({"priors": dict(suite.priors)} if suite.priors else {})}


def load_check_models(plan: dict, load_options: dict | None = None,
                      only: Callable[[Unit], bool] | None = None) -> dict[str, Any]:
    """The models a suite's checks name for themselves (`model = "k3-dims"`), loaded before any
    unit runs (a bad name is exit 2 up front), on the run's device and dtype; with `only`, those
    of the units it keeps."""
    import torch

    from optimized_stack import load_model
    names = sorted({u.model for u in plan_units(plan)
                    if u.model and u.model != plan["model"] and (only is None or only(u))})
    models = {}
    for n in names:
        name, own = split_model_spec(n)             # a check's own dtype, else the run's
        models[n] = load_model(name, device=plan.get("device", "cpu"),
                               dtype=getattr(torch, own or plan.get("dtype", "float32")), **(load_options or {}))
    return models


def plan_units(plan: dict) -> list[Unit]:
    return [Unit.from_dict(u) for u in plan["units"]]


def load_plan(run_dir: Path) -> dict[str, Any]:
    p = run_dir / "plan.json"
    try:
        plan = read_json(p)
    except ReadError as exc:                      # too deep, a huge integer, not UTF-8: says which, where
        raise UsageError(f"cannot resume: no readable plan at {exc}") from None
    except (OSError, ValueError):                 # ValueError: not JSON
        raise UsageError(f"cannot resume: no readable plan at {p} (expected a run directory of `k3verify all`)") from None
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT or plan.get("version") != PLAN_VERSION:
        got = f"{plan.get('format')!r} v{plan.get('version')}" if isinstance(plan, dict) else type(plan).__name__
        raise UsageError(f"cannot resume {p}: expected {PLAN_FORMAT} v{PLAN_VERSION}, got {got} (a plan written "
                         f"by another k3verify: run the suite again)")
    return plan


def check_model(plan: dict, model) -> None:
    mid = golden.model_id(model)
    if mid != plan["model_id"]:
        raise UsageError(f"cannot resume {plan['run_id']}: it ran on model {plan['model_id'][:30]}, "
                         f"this is {mid[:30]} (weights changed?)")


def _subject(toggle: str | None) -> Subject:
    try:
        return Subject.of_optional(toggle) if toggle else Subject("(reference)")
    except K3Error:
        return Subject(toggle)


class DeferredUnit(Exception):
    """A shard's unit that ran out of GPU memory beside the other shards: left unfinished (no checks
    file), so the parent's final pass runs it again once the workers have exited, alone on the GPU."""


# The driver's own out-of-memory, which bypasses torch's allocator and so its OutOfMemoryError: Triton
# loading a kernel's module ("Triton Error [CUDA]: out of memory": the 11th H100 release run lost 17
# k3-dims units to it while a needle shard held 46 GiB) and a raw CUDA call ("CUDA error: out of memory").
_DRIVER_OOM = ("Triton Error [CUDA]: out of memory", "CUDA error: out of memory")


def _out_of_device_memory(exc: BaseException) -> bool:
    import torch
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _DRIVER_OOM)


def run_unit(unit: Unit, ctx: Context, *, defer_oom: bool = False) -> list[Result]:
    """kinds.run, with a crash turned into an error result (the run goes on). With `defer_oom` (a
    shard of `all --jobs`, which shares the GPU with N-1 others), running out of device memory
    raises DeferredUnit instead: on the first H100 release run, 14 processes on 80 GB left one
    needle unit (a 2.5 GiB allocation at 108K tokens) an OOM error, which blocked the sign-off for
    want of memory the unit alone never needs."""
    try:
        return kinds.run(unit, ctx)
    except (UsageError, K3Error) as exc:
        if unit.kind not in QUALITY_KINDS:       # bad input to a contract check: the run cannot be made
            raise
        return [Result.errored(_subject(unit.toggle), unit.kind, f"{unit.kind} could not run: {exc}"[:400],
                               scenario=unit.scenario, gate=unit.kind)]
    except Exception as exc:  # noqa: BLE001 - a crashing check is an error result, the run goes on
        if defer_oom and _out_of_device_memory(exc):
            raise DeferredUnit(f"{unit.id} ran out of device memory ({exc})"[:300]) from None
        return [Result.errored(_subject(unit.toggle), unit.kind, f"{type(exc).__name__}: {exc}"[:400],
                               scenario=unit.scenario, traceback=traceback.format_exc()[-4000:])]


def write_plan(plan: dict, run_dir: Path) -> None:
    make_dir(run_dir)
    if not (run_dir / "plan.json").is_file():
        atomic_write_json(run_dir / "plan.json", plan)


def out_of_time(unit: Unit, time_limit_s: float | None, *, expected_s: float | None = None,
                finish_by_s: float | None = None, pace: float = 1.0) -> list[dict]:
    """The row of a unit that was not started because the run's time limit had passed (or, with
    `expected_s`, because it would have ended past --finish-by): inconclusive (never a pass, never a
    fail of the change), not written to a checks file so --resume runs it."""
    if expected_s is not None:
        by = f"--finish-by of {finish_by_s:g} s" if finish_by_s else "--finish-by"
        paced = f" (its prior x {pace:.2f}, this attempt's pace)" if pace != 1.0 else ""
        reason = f"not run: its expected {expected_s:.0f} s{paced} would have ended past the run's {by}"
    else:
        limit = f"the run's --time-limit of {time_limit_s:g} s" if time_limit_s else "the run's time limit"
        reason = f"not run: {limit} passed before this unit started"
    row = Result.inconclusive(_subject(unit.toggle), unit.kind, reason,
                              scenario=unit.scenario, not_run="time_limit")
    if unit.kind in QUALITY_KINDS:
        row.tag(gate=unit.kind)
    return [row.tag(unit=unit.id, suite_check=unit.check, **({"model": unit.model} if unit.model else {})).to_dict()]


def execute(plan: dict, model, run_dir: Path, *, display=None, load_options: dict | None = None,
            after_unit: Callable[[Unit], None] | None = None,
            only: Callable[[Unit], bool] | None = None, deadline: float | None = None,
            time_limit_s: float | None = None, steal: bool = False, finish_deadline: float | None = None,
            finish_by_s: float | None = None) -> tuple[list[dict], int]:
    """Run the plan's unfinished units; returns (all results in plan order, units run now). With
    `only` (a shard of `all --jobs`), units it rejects are neither run nor reported; with `steal`
    too, a shard that has finished its own units then takes the others' unstarted ones, last
    first, each claimed once (claim_unit): the cost priors that split the plan are CPU seconds,
    and a shard that drew the short units should not idle while another has an hour left. Past
    `deadline` (time.time() seconds) no unit starts: each left is an out_of_time row; before
    `finish_deadline`, a unit starts only if its expected seconds (suites/shards.unit_costs: the
    plan's measured priors, else its kind's; rescaled by this attempt's pace, shards.Pace) end
    before it."""
    write_plan(plan, run_dir)
    expect = provenance(plan)
    check_finished(plan, run_dir)            # a foreign checks file: exit 2 before any unit runs
    per_unit: list[list[dict]] = []
    ran = 0
    # one Context per model: the run's, and each that a check names for itself
    with contextlib.ExitStack() as stack:
        def context(m, name, model_id=None):
            return stack.enter_context(Context(m, model_arg=name, run_dir=run_dir, progress=display,
                                               load_options=load_options, model_id=model_id))
        ctx = context(model, plan["model"], plan.get("model_id"))    # hashed once already: new_plan / check_model
        # model_arg: the name the kinds load a tokenizer or a served model from (no dtype suffix)
        contexts = {name: context(m, split_model_spec(name)[0])
                    for name, m in load_check_models(plan, load_options, only).items()}
        units = plan_units(plan)
        pace = None
        if finish_deadline is not None:
            from k3verify.suites.shards import Pace, unit_costs
            pace = Pace(units, unit_costs(units, plan.get("priors")), run_dir / "checks")
        if only is not None:
            mine = [u for u in units if only(u)]
            units = mine + ([u for u in reversed(units) if not only(u)] if steal else [])
        for unit in units:
            rows = finished(run_dir, unit, expect)
            if rows is None and only is not None and steal and not claim_unit(run_dir, unit):
                continue                     # another shard has it
            if rows is None and deadline is not None and time.time() >= deadline:
                rows = out_of_time(unit, time_limit_s)
            elif rows is None and pace is not None and time.time() + pace.expect(unit.id) > finish_deadline:
                rows = out_of_time(unit, time_limit_s, expected_s=pace.expect(unit.id), finish_by_s=finish_by_s,
                                   pace=pace.factor(unit.id))
            elif rows is None:
                if display:
                    display.start(unit)
                t0 = time.perf_counter()
                if unit.model and unit.model != plan["model"] and unit.model not in contexts:   # stolen
                    (m,) = load_check_models(plan, load_options, lambda u, name=unit.model: u.model == name).values()
                    contexts[unit.model] = context(m, split_model_spec(unit.model)[0])
                uctx = contexts.get(unit.model, ctx) if unit.model else ctx
                tags = {"unit": unit.id, "suite_check": unit.check, **({"model": unit.model} if unit.model else {})}
                try:
                    rows = [r.tag(**tags).to_dict() for r in run_unit(unit, uctx, defer_oom=only is not None)]
                except DeferredUnit as why:
                    release_device_memory()
                    print(f"k3verify all: {why}; left for the final pass, alone on the GPU", file=sys.stderr, flush=True)
                    continue

                if unit.kind in QUALITY_KINDS:
                    _gate_report(plan, run_dir, unit, rows)
                atomic_write_json(unit_path(run_dir, unit), {"unit": unit.to_dict(), "provenance": expect,
                                                             "results": rows,
                                                             "duration_s": time.perf_counter() - t0,
                                                             "finished": datetime.now(timezone.utc).isoformat()})
                ran += 1
                if after_unit:
                    after_unit(unit)
            if display:
                display.unit_done(unit, rows)
            per_unit.append(rows)
    return [r for rows in per_unit for r in rows], ran


def units_finished_since(run_dir: Path, started: float) -> int:
    """How many checks files were finished at or after `started` (time.time()): the units an
    attempt ran, its workers' included (the parent's own count knows only its shard and final pass:
    the first one-call release run recorded `units_run: 2` for 194 units)."""
    n = 0
    for p in sorted((Path(run_dir) / "checks").glob("*.json")):
        try:
            stamp = datetime.fromisoformat(read_json(p)["finished"]).timestamp()
        except (OSError, ValueError, ReadError, KeyError, TypeError):
            continue
        n += stamp >= started - 1e-3
    return n


def release_device_memory() -> None:
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _gate_report(plan: dict, run_dir: Path, unit: Unit, rows: list[dict]) -> None:
    """gates/<unit>/: the gate unit's results as a report of its own. Its run id is derived from
    the plan's and the unit's, so a unit interrupted after writing it and run again on resume
    writes the same run's report (a leftover of another run is refused: claim_report_dir)."""
    out = run_dir / "gates" / unit.id
    rel = str((out / "report.md").relative_to(run_dir))
    for r in rows:
        r["gate_report"] = rel
    write_report(out, build_report(f"{plan['run_id']}-{unit.id}", f"{plan['command']}  # unit {unit.id}", {}, rows))


CLAIMS_DIR = "claims"


def claim_unit(run_dir: Path, unit: Unit) -> bool:
    """True for the one process of an `all --jobs` attempt that creates claims/<unit id> (the
    file system's O_EXCL is the lock); the parent empties claims/ before it starts the workers,
    so a unit claimed by an attempt that died is claimable again."""
    folder = Path(run_dir) / CLAIMS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / unit.id, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def clear_claims(run_dir: Path) -> None:
    shutil.rmtree(Path(run_dir) / CLAIMS_DIR, ignore_errors=True)


ATTEMPTS_FILE = "attempts.json"


def record_attempt(run_dir: Path, started: float, ended: float | None, units_run: int | None = None) -> None:
    """Record one attempt of the run in attempts.json: called with ended=None when the attempt
    starts (so an attempt killed mid-unit, as a device call's hard timeout does, is still on file)
    and again with its end, which completes that entry. A run resumed on a second machine is
    timed as the sum of its attempts, not as the gap from its plan."""
    path = Path(run_dir) / ATTEMPTS_FILE
    attempts = read_attempts(run_dir)
    stamp = datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="milliseconds")
    entry = {"started": stamp, "seconds": None if ended is None else round(ended - started, 1), "units_run": units_run}
    same = [i for i, a in enumerate(attempts) if a.get("started") == stamp]
    if same:
        attempts[same[-1]] = entry
    else:
        attempts.append(entry)
    atomic_write_json(path, attempts)


def attempt_seconds(run_dir: Path) -> list[dict]:
    """Each attempt with its seconds; an attempt that never recorded its end (killed) is timed to
    the last unit it finished (`estimated`: a lower bound)."""
    attempts = read_attempts(run_dir)
    finished = []
    for f in (Path(run_dir) / "checks").glob("*.json"):
        try:
            finished.append(datetime.fromisoformat(read_json(f)["finished"]))
        except (ReadError, OSError, ValueError, KeyError, TypeError):
            continue
    out = []
    for i, a in enumerate(attempts):
        a = dict(a)
        if a.get("seconds") is None:
            start = datetime.fromisoformat(a["started"])
            end = datetime.fromisoformat(attempts[i + 1]["started"]) if i + 1 < len(attempts) else None
            mine = [t for t in finished if t >= start and (end is None or t < end)]
            a["seconds"] = round((max(mine) - start).total_seconds(), 1) if mine else 0.0
            a["estimated"] = True
        out.append(a)
    return out


def read_attempts(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / ATTEMPTS_FILE
    if not path.is_file():
        return []
    try:
        data = read_json(path)
    except (ReadError, OSError, ValueError):
        return []
    return [a for a in data if isinstance(a, dict) and isinstance(a.get("started"), str)] \
        if isinstance(data, list) else []
