"""`k3verify all`: run every unit of a suite, one file per finished unit, then one report.

Run directory (reports/<run-id>/ or --report-dir):
    plan.json             the suite text, model and the expanded units, written first
    checks/NNN-<id>.json  one per finished unit, written atomically: a unit is done
                          exactly when its file exists, so --resume after kill -9
                          skips finished units and runs each unit at most once more
    gates/<unit>/         reports of quality-gate commands run as units
    toggles/<name>/       a diff report per toggle (what a verdict links to)
    report.*              the combined report (json, md, html, junit), written last

Verdict per optimization toggle (mutants are negative controls, not verdicts):
- rejected: a contract check failed or errored (which check, first divergence, link);
- counted:  its contract held: every check that ran passed, and for an approx toggle
            every quality gate its contract names passed too (a gate passes when one of
            its results passed, none was inconclusive, and it was not only a smoke test);
            the bench speedup (if measured) is counted;
- skipped:  not counted: nothing proved the contract here, or a quality gate was
            inconclusive or ran only as a smoke test (the reasons).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import shutil
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from optimized_stack import toggles as toggle_registry
from optimized_stack.errors import K3Error

from k3verify import commands
from k3verify.compare import golden as golden_hashes
from k3verify.scenarios import workloads
from k3verify.errors import UsageError
from k3verify.verdict.gate import ReferenceRuns, check_toggle, model_device
from k3verify.io import atomic_write_json, atomic_write_text, make_dir
from k3verify.report import build_report, environment_fingerprint, load_report, validate_report, write_report
from k3verify.suites.suite import QUALITY_KINDS, Suite, bench_options, expand, parse_suite

PLAN_FORMAT = "k3verify.all-plan"
PLAN_VERSION = 1
NOT_AVAILABLE = "not available in this build"


def result(toggle: str | None, check: str, status: str, reason: str, scenario: str | None = None,
           **extra: Any) -> dict[str, Any]:
    """A schema-v1 report result for checks that are not a toggle's own (golden, gates, skips)."""
    kind, contract = "optimization", "exact"
    if toggle is not None:
        try:
            t = toggle_registry.get(toggle)
            kind, contract = t.kind, t.contract.describe()
        except K3Error:
            pass
    return {"toggle": toggle or "(reference)", "kind": kind, "contract": contract, "check": check,
            "scenario": scenario, "status": status, "reason": reason, "findings": [], "first_divergence": None,
            "localization": None, "caught": None, "duration_s": 0.0, "speedup": None, **extra}


# ---- units ---------------------------------------------------------------------------

class Context:
    """What units share in one process: the model, and reference runs per (scale, seed)."""

    def __init__(self, model, model_arg: str | None, run_dir: Path, progress: Callable[[str], None]):
        self.model, self.model_arg, self.run_dir, self.progress = model, model_arg, run_dir, progress
        self._refs: dict[tuple[float, int], ReferenceRuns] = {}

    def references(self, scale: float, seed: int) -> ReferenceRuns:
        return self._refs.setdefault((scale, seed), ReferenceRuns(self.model))


def _argv_for(parser: argparse.ArgumentParser, flags: dict[str, Any]) -> list[str]:
    """Command-line words for {flag: value}; a flag the command lacks is a UsageError naming it."""
    actions = parser._option_string_actions  # noqa: SLF001 - argparse keeps no public map of flags
    argv: list[str] = []
    for flag, value in flags.items():
        if value is None:
            continue
        if flag not in actions:
            raise UsageError(f"{parser.prog} has no {flag} option, which this suite needs")
        action = actions[flag]
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            if action.nargs in ("+", "*") or isinstance(action.nargs, int):
                argv += [flag, *map(str, value)]
            elif isinstance(action, argparse._AppendAction):  # noqa: SLF001
                for v in value:
                    argv += [flag, str(v)]
            else:
                argv += [flag, ",".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    return argv


def gate_args(unit: dict, model_arg: str | None, out_dir: Path):
    """(command module, parsed args) for a quality-gate unit, or None when the command is absent.

    A suite argument the command does not take, or a value its run would refuse (the
    command's own validate(args), the checks its run() makes first), is a UsageError,
    found before any work (`k3verify all` calls precheck first)."""
    cmd, o, toggle = unit["kind"], unit["options"], unit["toggle"]
    try:
        module = importlib.import_module(f"k3verify.commands.{cmd}")
    except ModuleNotFoundError as exc:
        if exc.name not in (f"k3verify.commands.{cmd}", "k3verify.quality.gates"):
            raise
        return None
    parser = argparse.ArgumentParser(prog=f"k3verify {cmd}")
    module.add_arguments(parser)
    flags: dict[str, Any] = {"--report-dir": str(out_dir), "--toggle": toggle}
    if cmd == "gsm8k":
        flags.update({"--dataset": o["dataset"], "--limit": o["limit"], "--model": model_arg})
    elif cmd == "needle":
        flags.update({"--lengths": o["lengths"], "--depths": o["depths"], "--model": model_arg})
    elif cmd == "kvv":                  # no endpoint given: serve the model under test in-process
        flags.update({"--base-url": o["base_url"], "--self": o["base_url"] is None or None,
                      "--model": model_arg if o["base_url"] is None else None})
    argv = _argv_for(parser, flags) + list(o["args"])
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit:
        msg = err.getvalue().strip().splitlines()[-1:] or ["see its usage"]
        raise UsageError(f"check {unit['check']!r}: k3verify {cmd} rejects {' '.join(argv)!r}: {msg[0]}") from None
    validate = getattr(module, "validate", None)
    if validate is not None:
        try:
            validate(args)
        except (UsageError, K3Error) as exc:
            raise UsageError(f"check {unit['check']!r}: k3verify {cmd} would refuse it: {exc}") from None
    return module, args


def precheck(plan: dict, run_dir: Path) -> dict[str, argparse.Namespace]:
    """Everything a unit would refuse at run time, refused before the first unit runs: gate
    arguments (parsed and validated by the gate command) and bench arguments.
    Returns each available gate unit's parsed arguments by unit id."""
    parsed = {}
    for unit in plan["units"]:
        if unit["kind"] in QUALITY_KINDS:
            found = gate_args(unit, plan["model"], run_dir / "gates" / unit["id"])
            if found is not None:
                parsed[unit["id"]] = found[1]
        elif unit["kind"] == "bench":
            bench_options(unit["options"]["args"], f"check {unit['check']!r}: bench args")
    return parsed


def run_command_gate(unit: dict, ctx: Context) -> list[dict]:
    """Run a quality-gate command (`k3verify gsm8k|needle|kvv`) through its own run(args).

    Absent command -> skip "not available in this build" (never a fake pass). Its report
    lands in gates/<unit>/; its results join this report tagged with the gate and unit."""
    cmd, toggle = unit["kind"], unit["toggle"]
    if toggle is not None:
        t, device = toggle_registry.get(toggle), model_device(ctx.model)
        if device not in t.devices:       # e.g. a CUDA kernel's gate on a CPU run: skip, say why
            return [result(toggle, cmd, "skip", f"toggle runs on {', '.join(t.devices)}, not {device}")]
    out_dir = ctx.run_dir / "gates" / unit["id"]
    found = gate_args(unit, ctx.model_arg, out_dir)
    if found is None:
        return [result(toggle, cmd, "skip", f"{NOT_AVAILABLE} (no `k3verify {cmd}` command)")]
    module, args = found
    if out_dir.exists():
        # The unit has no file, so it did not finish: what is here is this run's own leftover
        # from the attempt that was interrupted, not another run's report (claim_report_dir).
        shutil.rmtree(out_dir)
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with commands.json_output(False), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            code = module.run(args)
    except (UsageError, K3Error) as exc:          # the gate could not run: an error result, the run goes on
        code = 2
        log.write(f"\nk3verify {cmd}: error: {exc}\n")
    atomic_write_text(out_dir / "output.log", log.getvalue())
    duration = time.perf_counter() - t0
    rel = str((out_dir / "report.md").relative_to(ctx.run_dir))
    if code != 2 and (out_dir / "report.json").is_file():
        rows = load_report(out_dir)["results"]
    else:
        tail = (log.getvalue().strip().splitlines() or ["no output"])[-1]
        rows = [result(toggle, cmd, {0: "pass", 1: "fail"}.get(code, "error"),
                       f"`k3verify {cmd}` exited {code} without a report: {tail}"[:400], duration_s=duration)]
    for r in rows:
        r.update(gate=cmd, gate_report=rel)
        if toggle is not None and r["toggle"] != toggle:
            r["command_toggle"], r["toggle"] = r["toggle"], toggle
    return rows


def run_bench(unit: dict, ctx: Context) -> list[dict]:
    try:
        bench = importlib.import_module("k3verify.perf.bench")
    except ModuleNotFoundError as exc:
        if exc.name != "k3verify.perf.bench":
            raise
        return [result(unit["toggle"], "bench", "skip", f"{NOT_AVAILABLE} (no k3verify.perf.bench)")]
    t0 = time.perf_counter()
    kw = bench_options(unit["options"]["args"], f"check {unit['check']!r}: bench args")
    row = bench.bench_toggle(ctx.model, unit["toggle"], workload_name=kw["workload"], scale=kw["scale"],
                             repeats=kw["repeats"])
    return [bench_result(row, time.perf_counter() - t0)]


def bench_result(row: dict, duration_s: float) -> dict:
    """A bench row (k3verify.perf.bench.bench_toggle) as a report result: pass when its speedup counts."""
    if row["ratio"] is None:                      # not timed: the toggle does not run here
        return result(row["toggle"], "bench", "skip", row["why"], scenario=row["scenario"], duration_s=duration_s)
    speedup = {"ratio": row["ratio"], "ci": row["ci95"], "counted": row["counted"], "workload": row["workload"],
               "tokens_per_s_ref": row["tokens_per_s_a"], "tokens_per_s_cand": row["tokens_per_s_b"]}
    return result(row["toggle"], "bench", "pass" if row["counted"] else "skip",
                  f"{row['ratio']:.3f}x on {row['scenario']}: {row['why']}", scenario=row["scenario"],
                  speedup=speedup, duration_s=duration_s)


def run_unit(unit: dict, ctx: Context) -> list[dict]:
    kind, o = unit["kind"], unit["options"]
    if kind in ("diff", "drift"):
        sc = workloads.build(unit["scenario"], scale=o["scale"], seed=o["seed"])
        rows = [r.to_dict() for r in check_toggle(ctx.model, unit["toggle"], sc,
                                                  references=ctx.references(o["scale"], o["seed"]))]
        for r in rows:
            r.update(evidence={**r.get("evidence", {}), **({"note": unit["note"]} if unit["note"] else {})})
        return rows
    if kind == "selftest":
        from k3verify.kinds.selftest import run_selftest
        return run_selftest(ctx.model, scale=o["scale"], progress=ctx.progress)
    if kind == "golden":
        t0 = time.perf_counter()
        gc = golden_hashes.check(ctx.model)
        return golden_hashes.to_results(gc, time.perf_counter() - t0)
    if kind in QUALITY_KINDS:
        return run_command_gate(unit, ctx)
    if kind == "bench":
        return run_bench(unit, ctx)
    raise UsageError(f"unit {unit['id']}: no runner for check kind {kind!r}")


# ---- the run -------------------------------------------------------------------------

def unit_path(run_dir: Path, unit: dict) -> Path:
    return run_dir / "checks" / f"{unit['id']}.json"


def finished(run_dir: Path, unit: dict) -> list[dict] | None:
    """The unit's results if its file is complete and belongs to this unit, else None."""
    p = unit_path(run_dir, unit)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):                 # also a file cut short or not UTF-8: not finished
        return None
    mine = isinstance(data, dict) and isinstance(data.get("unit"), dict) and data["unit"].get("id") == unit["id"]
    return data["results"] if mine else None


def new_plan(suite: Suite, model_arg: str | None, model, run_id: str, command: str) -> dict[str, Any]:
    return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "run_id": run_id, "command": command,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": model_arg,
            "model_id": golden_hashes.model_id(model), "suite": suite.to_dict(), "suite_text": suite.text,
            "units": expand(suite)}


def load_plan(run_dir: Path) -> dict[str, Any]:
    p = run_dir / "plan.json"
    try:
        plan = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):                 # ValueError: not JSON, or not UTF-8
        raise UsageError(f"cannot resume: no readable plan at {p} (expected a run directory of `k3verify all`)") from None
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT or plan.get("version") != PLAN_VERSION:
        got = plan.get("format") if isinstance(plan, dict) else type(plan).__name__
        raise UsageError(f"cannot resume {p}: expected {PLAN_FORMAT} v{PLAN_VERSION}, got {got!r}")
    return plan


def execute(plan: dict, model, run_dir: Path, *, display=None,
            after_unit: Callable[[dict], None] | None = None) -> tuple[list[dict], int]:
    """Run the plan's unfinished units; returns (all results in plan order, units run now)."""
    make_dir(run_dir)
    if not (run_dir / "plan.json").is_file():
        atomic_write_json(run_dir / "plan.json", plan)
    progress = display.step if display else (lambda msg: None)
    ctx = Context(model, plan["model"], run_dir, progress)
    per_unit: list[list[dict]] = []
    ran = 0
    for unit in plan["units"]:
        rows = finished(run_dir, unit)
        if rows is None:
            if display:
                display.start(unit)
            t0 = time.perf_counter()
            try:
                rows = run_unit(unit, ctx)
            except (UsageError, K3Error):
                raise
            except Exception as exc:  # noqa: BLE001 - a crashing check is an error result, the run goes on
                rows = [result(unit["toggle"], unit["kind"], "error", f"{type(exc).__name__}: {exc}"[:400],
                               unit["scenario"], traceback=traceback.format_exc()[-4000:])]
            for r in rows:
                r.update(unit=unit["id"], suite_check=unit["check"])
            atomic_write_json(unit_path(run_dir, unit), {"unit": unit, "results": rows,
                                                         "duration_s": time.perf_counter() - t0,
                                                         "finished": datetime.now(timezone.utc).isoformat()})
            ran += 1
            if after_unit:
                after_unit(unit)
        if display:
            display.done(unit, rows)
        per_unit.append(rows)
    return [r for rows in per_unit for r in rows], ran


def check_model(plan: dict, model) -> None:
    mid = golden_hashes.model_id(model)
    if mid != plan["model_id"]:
        raise UsageError(f"cannot resume {plan['run_id']}: it ran on model {plan['model_id'][:30]}, "
                         f"this is {mid[:30]} (weights changed?)")


def suite_of(plan: dict) -> Suite:
    s = plan["suite"]
    return parse_suite(plan["suite_text"], name=s["name"], path=s["path"])


# ---- verdicts and report ---------------------------------------------------------------

def _status_of(rows: list[dict]) -> str:
    statuses = {r["status"] for r in rows}
    return next((s for s in ("error", "fail", "inconclusive", "pass") if s in statuses), "skip")


def _reasons(rows: list[dict], status: str = "skip") -> str:
    return "; ".join(dict.fromkeys(r["reason"] for r in rows if r["status"] == status))


def toggle_verdicts(results: list[dict]) -> list[dict]:
    """One verdict per optimization toggle that appears in the results (see module docstring)."""
    names = list(dict.fromkeys(r["toggle"] for r in results if r["kind"] == "optimization"))
    out = []
    for name in names:
        try:
            t = toggle_registry.get(name)
        except K3Error:
            continue                                    # "(reference)", "reference": gates, not toggles
        rows = [r for r in results if r["toggle"] == name]
        contract_rows = [r for r in rows if not r.get("gate") and r["check"] != "bench"]
        gate_rows = [r for r in rows if r.get("gate")]
        bench = [r for r in rows if r["check"] == "bench" and r.get("speedup")]
        v = {"toggle": name, "contract": t.contract.describe(), "verdict": "skipped", "reason": "",
             "checks": {s: sum(r["status"] == s for r in rows)
                        for s in ("pass", "fail", "skip", "error", "inconclusive")},
             "scenarios": sorted({r["scenario"] for r in contract_rows if r["scenario"] and r["status"] == "pass"}),
             "speedup": None, "failed_check": None, "first_divergence": None, "localization": None,
             "report": f"toggles/{name}/report.md"}
        bad = [r for r in contract_rows + gate_rows if r["status"] in ("fail", "error")]
        passed = [r for r in contract_rows if r["status"] == "pass"]
        if bad:
            b = bad[0]
            where = b.get("scenario") or b.get("gate") or "its check"
            v.update(verdict="rejected", failed_check=b["check"], first_divergence=b.get("first_divergence"),
                     localization=b.get("localization"),
                     reason=f"{b['check']} {'errored' if b['status'] == 'error' else 'failed'} on {where}: {b['reason']}")
        elif not passed:
            v["reason"] = _reasons(contract_rows) or "no check in this suite ran its contract"
        else:
            missing = []
            for g in t.contract.quality if t.contract.kind == "approx" else ():
                mine = [r for r in gate_rows if r["gate"] == g]
                counting = [r for r in mine if r.get("role") != "smoke"]   # a smoke test never proves a gate
                undecided = [r for r in counting if r["status"] == "inconclusive"]
                # the paired verdict's own line, not the whole evidence paragraph of a gsm8k reason
                short = "; ".join(dict.fromkeys(
                    r["accuracy"].get("verdict_reason", r["reason"]) if isinstance(r.get("accuracy"), dict)
                    else r["reason"] for r in (undecided or mine)))
                if undecided:
                    missing.append(f"{g} inconclusive ({short})")
                elif any(r["status"] == "pass" for r in counting):
                    continue
                elif mine and not counting:
                    missing.append(f"{g} ran only as a smoke test, which counts toward no verdict ({short})")
                else:
                    missing.append(f"{g} ({_reasons(mine) or 'not in this suite'})")
            on = ", ".join(v["scenarios"]) or "its scenarios"
            if missing:
                v["reason"] = (f"drift budget held on {on}, but the contract's quality gates did not pass here: "
                               + "; ".join(missing))
            else:
                v.update(verdict="counted", reason=f"contract {t.contract.describe()} held: {len(passed)} checks "
                                                   f"passed on {on}" + (", quality gates passed" if gate_rows else ""))
                if bench:
                    v["speedup"] = {**bench[0]["speedup"], "counted": True}
        out.append(v)
    return out


def check_statuses(plan: dict, results: list[dict]) -> list[dict]:
    """Per [[check]] of the suite: one status over all its units (what sign-off requires)."""
    out = []
    for c in plan["suite"]["checks"]:
        rows = [r for r in results if r.get("suite_check") == c["name"]]
        status = _status_of(rows)
        out.append({"index": c["index"], "name": c["name"], "kind": c["kind"], "status": status,
                    "counts": {s: sum(r["status"] == s for r in rows)
                               for s in ("pass", "fail", "skip", "error", "inconclusive")},
                    "reason": _reasons(rows, status)[:500] if status in ("skip", "inconclusive") else ""})
    return out


def negative_controls(results: list[dict]) -> dict[str, int]:
    mutants = [r for r in results if r["kind"] == "mutant" and r.get("caught") is not None]
    return {"caught": sum(r["caught"] is True for r in mutants), "total": len(mutants)}


def write_combined(plan: dict, model, run_dir: Path, results: list[dict]) -> tuple[dict, dict]:
    """Per-toggle reports, then the combined report with suite, verdicts and negative controls."""
    from k3verify.suites.signoff import verdict_html, verdict_markdown

    env = environment_fingerprint(model=model, seeds={"scenario_seed": 0}, extra={
        "numerics_key": golden_hashes.env_key(golden_hashes.numerics_environment(model))})
    verdicts = toggle_verdicts(results)
    for v in verdicts:
        rows = [r for r in results if r["toggle"] == v["toggle"]]
        write_report(run_dir / "toggles" / v["toggle"],
                     build_report(f"{plan['run_id']}-{v['toggle']}", f"{plan['command']}  # toggle {v['toggle']}",
                                  env, rows))
    report = build_report(plan["run_id"], plan["command"], env, results)
    report.update(suite={**plan["suite"], "checks": check_statuses(plan, results)}, verdicts=verdicts,
                  negative_controls=negative_controls(results), model_id=plan["model_id"])
    validate_report(report)
    paths = write_report(run_dir, report)
    safe = json.loads(paths["json"].read_text(encoding="utf-8"))
    md = paths["md"].read_text(encoding="utf-8")
    atomic_write_text(paths["md"], md.replace("## Results", verdict_markdown(safe) + "## Results", 1))
    page = paths["html"].read_text(encoding="utf-8")
    atomic_write_text(paths["html"], page.replace("<h2>Results</h2>", verdict_html(safe) + "<h2>Results</h2>", 1))
    atomic_write_json(paths["json"], safe, allow_nan=False)      # report.json stays the last file written
    return safe, paths
