"""Check kind `selftest`: every real toggle passes its contract, every mutant is caught by the
check that should catch it, and localisation names the component where the mutant lives.

A check that cannot fail is a defect; this is where the project proves none of its checks is
one. One unit per registry entry (toggles and mutants), each judged on the cheapest scenario
that exercises it (scenarios/chooser.py); a toggle that only exists at W > 1 (tensor
parallel) is judged at its smallest W. Each row says which of the entry's declared path
events fired ("events 3/3: prefix_hit_block=6 ..."): a real toggle whose events did not all
fire is `not exercised`, never a pass, and a mutant whose path never ran is not caught. `k3verify selftest`, a suite's `kind = "selftest"` and
the GPU run's verdicts all run these units.
"""
from __future__ import annotations

from k3verify.scenarios.chooser import choose
from k3verify.scenarios.workloads import build
from k3verify.verdict.gate import check_toggle
from k3verify.verdict.result import Result, Subject

from .base import CheckSpec, Context, OptionError, Unit, check_scale, check_toggles

NAME = "selftest"
# toggles: None (every registry entry) or a list of names: those entries and the mutants of the
# optimizations among them (a suite judging the fast path on a second model names just those)
OPTIONS = {"scale": 1.0, "toggles": None, "contract": "all", "entries": "all"}
# contract: "all", or only the entries (toggles and mutants) whose contract is "exact" or "approx".
# An approx contract is a drift budget, which means something only on a model with confident
# predictions at the dims being judged: the GPU release suite judges exact entries on k3-mini and
# approx ones on the trained golden/k3-dims (k3-mini's bf16 drift could not tell three approx
# mutants from a legitimate reordering in the second H200 release run).
CONTRACTS = ("all", "exact", "approx")
# entries: "all", or only the real toggles ("toggles") or only the seeded mutants ("mutants"). In bf16
# three approx mutants drift no more than legitimate reorderings on any scenario (NOTES.md, session 10),
# so the GPU release suite judges the toggles in bf16 and every approx entry again in fp32.
ENTRIES = ("all", "toggles", "mutants")
ALL_S = 120.0          # the whole selftest at scale 1 on the 2-core dev CPU (NOTES.md), for progress only


def validate(o: dict) -> None:
    check_scale(o["scale"])
    if o["toggles"] is not None:
        if isinstance(o["toggles"], str):
            raise OptionError("toggles", f"must be a list of toggle or mutant names, got {o['toggles']!r}")
        check_toggles(o["toggles"], allow_none=False)
    if o["contract"] not in CONTRACTS:
        raise OptionError("contract", f"must be one of {', '.join(CONTRACTS)}, got {o['contract']!r}")
    if o["entries"] not in ENTRIES:
        raise OptionError("entries", f"must be one of {', '.join(ENTRIES)}, got {o['entries']!r}")


def scenario_for(toggle, scale: float) -> str:
    """The cheapest scenario that exercises the toggle (or the toggle it mutates)."""
    return choose(toggle, one=True, scale=scale).names[0]


def plan(spec: CheckSpec) -> list[Unit]:
    """One unit per registry entry, on the cheapest scenario that exercises it."""
    from optimized_stack import toggles as registry
    scale = spec.options["scale"]
    wanted = spec.options["toggles"]
    entries = [t for t in registry.all_toggles()
               if wanted is None or t.name in wanted or (t.kind == "mutant" and t.mutant_of in wanted)]
    if spec.options["contract"] != "all":
        entries = [t for t in entries if t.contract.kind == spec.options["contract"]]
    if spec.options["entries"] != "all":
        keep = "mutant" if spec.options["entries"] == "mutants" else "optimization"
        entries = [t for t in entries if t.kind == keep]
    return [Unit(spec.kind, spec.name, spec.options, t.name, scenario_for(t, scale), check_index=spec.index)
            for t in entries]


def cost_s(unit: Unit) -> float:
    from optimized_stack import toggles as registry
    return ALL_S * unit.options["scale"] / max(1, len(registry.all_toggles()))


def run(unit: Unit, ctx: Context) -> list[Result]:
    from optimized_stack import toggles as registry

    toggle = registry.get(unit.toggle)
    subject = Subject.of(toggle.name)
    if ctx.device not in toggle.devices:
        return [Result.skipped(subject, NAME, f"runs on {', '.join(toggle.devices)}, not {ctx.device}")]
    world = 1 if 1 in toggle.world_sizes else min(toggle.world_sizes)
    if world > 1 and ctx.device == "cuda":
        # CUDA ranks are one GPU each over nccl; gloo's ranks are CPU processes, which the bf16
        # CUDA model is not (the H200 release run errored there instead of saying so)
        import torch
        if torch.cuda.device_count() < world:
            return [Result.skipped(subject, NAME, f"tensor parallel at world size {world} on CUDA needs {world} "
                                                  f"GPUs for nccl, found {torch.cuda.device_count()}; the CPU "
                                                  f"suite judges it over gloo")]
        runner = ctx.runner(world, "nccl")
    else:
        runner = ctx.runner(world)
    sc = build(unit.scenario, scale=unit.options["scale"])
    results = check_toggle(ctx.model, toggle.name, sc, runner=runner)
    if results and all(r.status == "skip" for r in results):     # e.g. not exact on this device: say so
        return [Result.skipped(subject, NAME, results[0].reason, scenario=sc.name)]
    failed = {r.check for r in results if r.status == "fail"}
    errors = [r for r in results if r.status == "error"]
    evidence = next((r.evidence for r in results if "events" in r.evidence), {})
    common = dict(scenario=sc.name, duration_s=sum(r.duration_s for r in results) / max(1, len(results)),
                  findings=[f for r in results for f in r.findings][:2], evidence=evidence,
                  first_divergence=next((r.first_divergence for r in results if r.first_divergence), None))
    events = events_line(toggle, evidence)
    if toggle.kind == "optimization":
        if not failed and not errors and any(r.status == "not_exercised" for r in results):
            return [Result.not_exercised(subject, "selftest", f"{events}; the path did not run on {sc.name}",
                                         **common)]
        if not failed and not errors:
            return [Result.passed(subject, "selftest", f"contract holds ({events}): " + "; ".join(
                f"{r.check} {r.reason}" for r in results), **common)]
        return [Result.failed(subject, "selftest", "a real toggle failed its contract: " + "; ".join(
            f"{r.check}: {r.reason}" for r in results if r.status == "fail"), **common)]
    return [_mutant(toggle, subject, results, failed, multi_request=bool(toggle.engine) or world > 1,
                    events=events, **common)]


def events_line(toggle, evidence: dict) -> str:
    """'events 2/3 fired: prefix_hit_block=6, checkpoint_saved=4; missing prefix_hit_on_generated'."""
    counts = evidence.get("events", {})
    fired = [f"{e}={n}" for e, n in counts.items() if n]
    miss = evidence.get("events_missing", [])
    text = f"events {len(fired)}/{len(toggle.events)} fired" + (f": {', '.join(fired)}" if fired else "")
    return text + (f"; missing {', '.join(miss)}" if miss else "")


def _mutant(toggle, subject: Subject, results: list[Result], failed: set[str], *, multi_request: bool,
            events: str, **common) -> Result:
    caught_by = sorted(failed & set(toggle.caught_by))
    loc = next((r.localization for r in results if r.localization), None)
    where = (loc or {}).get("component")
    # Every fault must be localised to the component it lives in: model faults by the sublayer
    # replay, engine faults by the engine trace (k3verify/localize_engine.py), which names where
    # the fault entered (a cache row, a restored state, an op slot, the sampler), not the first
    # KDA state it reached. Only a fault across tensor-parallel ranks cannot be replayed in one
    # process (its `lives_in` is None: reported, not judged).
    unavailable = where is None and multi_request and toggle.lives_in is None
    localised = toggle.lives_in is None or where == toggle.lives_in
    caught = bool(caught_by)
    evidence_loc = {"lives_in": toggle.lives_in, "found": where, "exact": localised and toggle.lives_in is not None}
    if caught and localised:
        where_text = ("not localisable by single-process replay (multi-rank fault; see first divergence)"
                      if unavailable else f"localised to {where}")
        res = Result.passed(subject, "selftest", f"caught by {', '.join(caught_by)}; {where_text}; {events}",
                            localization=loc, caught=True, **common)
        res.evidence["localisation"] = evidence_loc
        return res
    problems = []
    if not caught:
        problems.append(f"not caught by {', '.join(toggle.caught_by)} (failed checks: {sorted(failed) or 'none'})")
    else:
        problems.append(f"localised to {where!r}, expected {toggle.lives_in!r}")
    problems.append(events)
    res = Result.failed(subject, "selftest", "; ".join(problems), localization=loc, caught=caught, **common)
    if caught:
        res.evidence["localisation"] = evidence_loc
    return res
