"""The gate: contract -> checks -> results, for one toggle on one scenario.

For an `exact` toggle, one result per check of compare/captures.py EXACT_CHECKS (tokens,
logits, kda_state, mla_rows): pass when the candidate's capture is bit-identical to the
reference's and at least one item was compared (0 compared is `not exercised`, or a fail when
the token streams parted before the check could compare), fail with the first divergence, the comparator's findings and the localised
sublayer when not. For an `approx` toggle, one `drift_budget` result: teacher-forced on the
reference tokens, max KL, top-1 agreement and max ULP of every logit row, and the final KDA
state drift, against the declared budget for the model's device and dtype
(Contract.for_run: bf16 on CUDA has its own, declared from bf16's noise floor).

Path evidence: every toggle declares the events that prove its code ran (Toggle.events,
optimized_stack/events.py) and the candidate's capture counts them. A check that held on a
scenario where a declared event never fired is `not exercised`, naming the missing events,
never a pass: the toggle's path did not run there, so holding proves nothing. A failure stays
a failure (a divergence is evidence whatever fired). Every row carries the counters
(evidence["events"]: declared -> count, "events_missing", "counters": everything that fired,
and for an engine run "reuse": theoretical reusable prefix vs prefix hits).

A degenerate reference (logits constant over the vocabulary: compare/captures.py
degenerate_reference) fails every check before the candidate runs: two broken sides agree.

Hashes decide equality; a mismatch is re-run with tensors kept to produce the ULP / KL figures
(deterministic, so the second run is the first). A non-finite item recorded by either capture
fails the check that owns it with its location, and a drift budget refuses to judge NaN / inf
(KL of NaN compares as nothing) or a run the sampler stopped.
"""
from __future__ import annotations

import time

from k3verify.capture.capture import Capture
from k3verify.compare.captures import (EXACT_CHECKS, compare_captures, degenerate_reference, drift_refused,
                                       findings_for, measure_drift, nonfinite_finding)
from k3verify.run.runner import Runner
from k3verify.verdict.result import Result, Subject
from optimized_stack import toggles as toggle_registry
from optimized_stack.events import OFF_GRID_IMPOSSIBLE
from optimized_stack.events import impossible as impossible_events
from optimized_stack.events import missing as missing_events
from optimized_stack.kernels.kda.grid import grid_in_force


def model_device(model) -> str:
    """'cpu' or 'cuda': where the model's weights live (CUDA-only toggles skip elsewhere)."""
    return next(model.parameters()).device.type


def _impossible(toggle, grid: int | None, config) -> dict[str, str]:
    """The toggle's declared events that cannot fire on `grid` with the engine options it runs
    with there (toggles.engine_options: its engine_on_grid where a grid is in force)."""
    engine = toggle_registry.engine_options([toggle.name], grid) if toggle.engine else None
    return impossible_events(toggle.events, grid, config, engine)


def applies(toggle, scenario, device: str = "cpu", world_size: int = 1, config=None) -> str | None:
    """None if the toggle applies to the scenario here; else the reason it does not."""
    if device not in toggle.devices:
        return f"toggle runs on {', '.join(toggle.devices)}, not {device}"
    if device in toggle.not_exact_on:
        return f"not exact on {device}: {toggle.not_exact_on[device]}"
    if world_size not in toggle.world_sizes:
        return f"toggle runs at world size {', '.join(map(str, toggle.world_sizes))}, not {world_size}"
    cannot = _impossible(toggle, grid_in_force(device), config)
    if toggle.kind == "mutant" and toggle.events and len(cannot) == len(toggle.events):
        # a seeded fault whose path cannot run here cannot be caught here; an optimization
        # like it is still run (switched on it must change no bit) and reads `not exercised`
        event, why = next(iter(cannot.items()))
        return f"not applicable {'on the 64-token KDA grid: ' if event in OFF_GRID_IMPOSSIBLE else ''}{why}"
    if toggle.scenario_tags and not set(toggle.scenario_tags) & set(scenario.tags):
        return f"toggle applies to scenarios tagged {', '.join(toggle.scenario_tags)}"
    return None


def drift_verdict(ref: Capture, cand: Capture, contract) -> tuple[bool, str, list[dict], dict]:
    """(within budget, reason, findings, evidence) of the teacher-forced drift against `contract`."""
    drift = measure_drift(ref, cand)
    f = drift.logits
    if f is None:
        return False, "no logits rows in common between reference and candidate", [], {}
    problems = []
    if contract.max_kl is not None and f.kl_max > contract.max_kl:
        problems.append(f"max KL {f.kl_max:.3g} > budget {contract.max_kl:g}")
    if contract.mean_kl is not None and f.kl_mean > contract.mean_kl:
        problems.append(f"mean KL {f.kl_mean:.3g} > budget {contract.mean_kl:g}")
    if contract.min_top1 is not None and f.top1_agreement < contract.min_top1:
        problems.append(f"top-1 agreement {f.top1_agreement:.4f} < budget {contract.min_top1:g}")
    if contract.max_ulp is not None and (f.max_ulp or 0) > contract.max_ulp:
        problems.append(f"max ULP {f.max_ulp} > budget {contract.max_ulp}")
    state_rel = drift.state_rel_max
    if contract.max_state_rel is not None and state_rel > contract.max_state_rel:
        worst = max(drift.state, key=lambda sf: sf["rel_to_max"])
        problems.append(f"KDA state drift {state_rel:.3g} of max|state| > budget {contract.max_state_rel:g} "
                        f"(layer {worst['layer']}, request {worst['request']})")
    findings = [{**f.to_dict(), "message": f.message()}]
    if problems:
        return False, "; ".join(problems), findings, drift.evidence()
    return True, (f"within budget: max KL {f.kl_max:.3g}, mean {f.kl_mean:.3g}, top-1 {f.top1_agreement:.4f}, "
                  f"max ULP {f.max_ulp} over {f.n_rows} rows, KDA state drift {state_rel:.3g}"), findings, \
        drift.evidence()


REUSE_KEYS = ("prompt_tokens", "reusable_tokens", "prefix_hit_tokens", "hit_rate")


def event_evidence(toggle, cand: Capture, grid: int | None = None, config=None) -> dict:
    """The counters a verdict shows: declared events with their counts, the missing ones (of those
    that can fire on this KDA grid), every counter that fired, and the engine's reuse statistics
    (theoretical vs achieved)."""
    cannot = _impossible(toggle, grid, config)
    ev = {"events": {e: int(cand.events.get(e, 0)) for e in toggle.events},
          "events_missing": missing_events([e for e in toggle.events if e not in cannot], cand.events),
          "counters": dict(sorted(cand.events.items()))}
    if cannot:
        ev["events_impossible"] = cannot
    if cand.metrics:
        ev["reuse"] = {k: cand.metrics[k] for k in REUSE_KEYS if k in cand.metrics}
    return ev


def unexercised(result: Result, toggle, scenario_name: str, evidence: dict) -> Result:
    """A held check on a scenario where a declared event never fired -> `not exercised`."""
    result.evidence.update(evidence)
    miss = evidence["events_missing"]
    cannot = evidence.get("events_impossible") or {}
    if result.status == "pass" and toggle.events and len(cannot) == len(toggle.events):
        # none of its own paths can run on this grid (a sub-block hit restarts from the aligned
        # checkpoint instead): the run shows that switching it on changes nothing, not that it works
        return Result.not_exercised(
            result.subject, result.check, f"{result.reason or 'held'} with it switched on, but none of its "
            f"declared events can fire on the 64-token KDA grid ({next(iter(cannot.values()))}): it is inert "
            "here", scenario=result.scenario, findings=result.findings, duration_s=result.duration_s,
            evidence=result.evidence)
    if result.status != "pass" or not miss:
        return result
    return Result.not_exercised(
        result.subject, result.check, f"{result.reason or 'held'}, but {', '.join(miss)} never fired on "
        f"{scenario_name} ({len(toggle.events) - len(miss)}/{len(toggle.events)} declared events"
        + (f"; {', '.join(evidence['events_impossible'])} cannot fire here" if evidence.get("events_impossible")
           else "") + "): the toggle's path did not run", scenario=result.scenario, findings=result.findings,
        duration_s=result.duration_s, evidence=result.evidence)


def check_toggle(model, toggle_name: str, scenario, *, localize_failures: bool = True,
                 runner: Runner | None = None) -> list[Result]:
    """Run reference and candidate on one scenario and judge the toggle's contract."""
    runner = runner or Runner(model)
    toggle = toggle_registry.get(toggle_name)
    # the budget for this device and dtype (bf16 on CUDA is held to bf16's noise, not fp32's)
    contract = toggle.contract.for_run(model_device(model), next(model.parameters()).dtype)
    subject = Subject.of(toggle.name)
    skip = applies(toggle, scenario, device=model_device(model), world_size=runner.world_size,
                   config=model.config)
    if skip:
        checks = EXACT_CHECKS if contract.kind == "exact" else ("drift_budget",)
        return [Result.skipped(subject, c, skip, scenario=scenario.name) for c in checks]
    t0 = time.perf_counter()
    from k3verify.scenarios.answers import realized
    scenario = realized(model, scenario)        # multi-turn histories carry the model's real answers
    ref = runner.reference(scenario)
    broken = degenerate_reference(ref, scenario.name)
    if broken is not None:
        # both sides of a broken model agree (max KL 0, the same NUL stream): no check may pass on it
        checks = EXACT_CHECKS if contract.kind == "exact" else ("drift_budget",)
        finding = {"what": "degenerate_reference", "message": broken["reason"], **broken["first"]}
        return [Result.failed(subject, c, broken["reason"], scenario=scenario.name, findings=[finding],
                              first_divergence=broken["first"], duration_s=time.perf_counter() - t0,
                              evidence={"degenerate_reference": broken["first"]}) for c in checks]
    # localisation replays on the single-process model, where a TP toggle changes nothing
    localize_failures = localize_failures and runner.world_size == 1
    if contract.kind == "approx":
        force = {rid: rc.tokens for rid, rc in ref.requests.items()}
        cand = runner.run(scenario, (toggle.name,), keep=True, force=force)
        refused = drift_refused(ref, cand, scenario.name)
        if refused:
            (reason, findings, first), ok, evidence = refused, False, {"nonfinite": refused[2]}
        else:
            ok, reason, findings, evidence = drift_verdict(ref, cand, contract)
            first = None
        res = Result.make("pass" if ok else "fail", subject, "drift_budget", reason, scenario=scenario.name,
                          findings=findings, evidence=evidence, first_divergence=first,
                          duration_s=time.perf_counter() - t0)
        if not ok and localize_failures:
            res.localization = _localize(model, toggle.name, scenario, ref, first=first)
            over = _state_over(evidence, contract)
            if over and (res.localization or {}).get("component") is None:
                # no sublayer output differs on either replay: the state alone shows the fault
                from k3verify.localize import state_only
                res.localization = {**state_only(model, over, "only the KDA state is over its budget"),
                                    "request": over["request"]}
        return [unexercised(res, toggle, scenario.name, event_evidence(toggle, cand, grid_in_force(model_device(model)), model.config))]
    # a mutant is run to fail: keep its tensors at once instead of re-running it for the findings
    kept = toggle.kind == "mutant"
    cand = runner.run(scenario, (toggle.name,), keep=kept)
    verdicts = compare_captures(ref, cand, scenario.name)
    if not kept and not all(v["equal"] for v in verdicts.values()):
        # deterministic: the same run again, now with tensors kept for the findings
        cand = runner.run(scenario, (toggle.name,), keep=True)
        verdicts = compare_captures(ref, cand, scenario.name)
    duration = time.perf_counter() - t0
    failing = [c for c in EXACT_CHECKS if not verdicts[c]["equal"]]
    # the state check knows which state tensor went wrong first: localise from it if it failed
    state_first = next((verdicts[c]["first"] for c in ("kda_state", "mla_rows") if c in failing),
                       verdicts[failing[0]]["first"] if failing else None)
    loc = _localize(model, toggle.name, scenario, ref, first=state_first) if failing and localize_failures else None
    evidence = event_evidence(toggle, cand, grid_in_force(model_device(model)), model.config)
    results = []
    for check in EXACT_CHECKS:
        v = verdicts[check]
        if v["equal"] and not v["compared"]:
            results.append(_nothing_compared(subject, check, scenario.name, verdicts["tokens"], duration, evidence))
            continue
        if v["equal"]:
            results.append(unexercised(Result.passed(subject, check, f"bit-identical ({v['compared']} compared)",
                                                     scenario=scenario.name, duration_s=duration),
                                       toggle, scenario.name, evidence))
            continue
        findings = ([nonfinite_finding(v["nonfinite"])] if v["nonfinite"]
                    else findings_for(check, v["first"], ref, cand))
        results.append(Result.failed(subject, check, v["reason"], scenario=scenario.name, findings=findings,
                                     first_divergence=v["first"], localization=loc, duration_s=duration,
                                     evidence={**evidence, **({"nonfinite": v["first"]} if v["nonfinite"] else {})}))
    return results


_COMPARED = {"tokens": "token streams", "logits": "logits rows", "kda_state": "KDA state points",
             "mla_rows": "MLA cache layers"}


def _nothing_compared(subject: Subject, check: str, scenario_name: str, tokens: dict, duration: float,
                      evidence: dict) -> Result:
    """A check with 0 hashes compared is never a pass: a fail when the token streams parted
    before it could compare (MLA rows are comparable only on identical streams), else `not
    exercised` (nothing of its kind was captured here)."""
    if not tokens["equal"]:
        return Result.failed(subject, check, f"0 {_COMPARED[check]} compared: not comparable after "
                             f"{tokens['reason']}", scenario=scenario_name, first_divergence=tokens["first"],
                             duration_s=duration, evidence=evidence)
    return Result.not_exercised(subject, check, f"nothing compared: 0 {_COMPARED[check]} captured on "
                                f"{scenario_name}", scenario=scenario_name, duration_s=duration,
                                evidence=evidence)


def _state_over(evidence: dict, contract) -> dict | None:
    """The first layer (execution order) whose final KDA state is over the state budget, as a
    state divergence for localisation: a fault the logits never show (a state stored in the
    wrong layout and read back the same way) is found only there."""
    if contract.max_state_rel is None:
        return None
    over = [s for s in evidence.get("kda_state_drift", []) if s["rel_to_max"] > contract.max_state_rel]
    if not over:
        return None
    first = min(over, key=lambda s: s["layer"])
    return {"tensor": "recurrent", "layer": first["layer"], "request": first["request"]}


def _localize(model, toggle_name: str, scenario, ref: Capture, first: dict | None = None) -> dict | None:
    from k3verify.localize import localize_request
    if toggle_registry.get(toggle_name).engine:
        # an engine fault lives outside the model: trace the engine's own computations
        from k3verify.localize_engine import localize_engine
        found = localize_engine(model, toggle_name, scenario, ref)
        if found is not None:
            return found
    rid = (first or {}).get("request") or next(iter(ref.requests))
    r = ref.requests[rid]
    spec = next(x for x in scenario.requests if x.request_id == rid)
    ids = list(spec.prompt_ids) + r.tokens[:-1]
    return localize_request(model, toggle_name, ids, request_id=rid, state_first=first,
                            prompt_len=len(spec.prompt_ids))
