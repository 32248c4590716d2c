"""The gate: contract -> checks -> findings -> verdict, for one toggle on one scenario.

Checks for an `exact` toggle (each a result of its own):
- tokens:    the generated token streams are identical;
- logits:    every logit row the candidate computed for a position on the common token
             prefix is bit-identical to the reference row (rows that produced a generated
             token must all be there);
- kda_state: every KDA state point (recurrent + conv windows, every layer) the candidate
             emitted equals the reference at the same token count;
- mla_rows:  the MLA cache rows at the end are bit-identical.
For an `approx` toggle, one `drift_budget` check: teacher-forced on the reference tokens,
max KL, top-1 agreement and max ULP of every logit row against the declared budget; the
KDA state drift is reported as evidence.

Every numeric finding comes from k3verify.compare.tensors; hashes decide equality, and a
mismatch is re-run with tensors kept to produce the ULP / KL figures. Hashes cannot see
NaN / inf (a NaN row hashes alike on both sides, and KL of NaN compares as nothing), so
first of all, in every check kind, a non-finite item recorded by either capture fails the
check that owns it with its location (k3verify.capture.nonfinite), and a run the sampler stopped
fails `tokens`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from optimized_stack import toggles as toggle_registry

from k3verify.capture.capture import Capture, RequestCapture
from k3verify.compare.tensors import compare_logits, compare_tensors, first_divergence
from k3verify.capture.nonfinite import SIDES, first_per_check, stopped_request
from k3verify.run.sequential import run_scenario

EXACT_CHECKS = ("tokens", "logits", "kda_state", "mla_rows")


@dataclass
class CheckResult:
    toggle: str
    kind: str
    contract: str
    check: str
    scenario: str
    status: str                       # pass / fail / skip / error
    reason: str
    findings: list[dict] = field(default_factory=list)
    first_divergence: dict | None = None
    localization: dict | None = None
    caught: bool | None = None
    duration_s: float = 0.0
    speedup: dict | None = None
    evidence: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _agree_len(ref: RequestCapture, cand: RequestCapture) -> int:
    """Tokens both runs consumed identically: the prompt plus the common generated prefix."""
    d = first_divergence(ref.tokens, cand.tokens)
    n = len(ref.tokens) if d is None else d
    return ref.prompt_len + n


def _logit_positions(ref: RequestCapture, cand: RequestCapture) -> tuple[list[int], list[int]]:
    """(positions to compare, required positions missing from the candidate)."""
    agree = _agree_len(ref, cand)
    common = sorted(p for p in ref.logits if p in cand.logits and p < agree)
    required = range(ref.prompt_len - 1, min(agree, ref.prompt_len + len(ref.tokens) - 1))
    missing = [p for p in required if p not in cand.logits]
    return common, missing


def _stopped(ref: Capture, cand: Capture, scenario: str) -> dict | None:
    """{"reason", "sides", "first"} when the sampler stopped either run (a NaN / +inf row)."""
    stopped = [(side, cap) for side, cap in zip(SIDES, (ref, cand)) if cap.stopped]
    if not stopped:
        return None
    side, cap = stopped[0]
    rid = stopped_request(cap)
    sides = [s for s, c in stopped if stopped_request(c) == rid and c.stopped == cap.stopped]
    reason = f"{' and '.join(sides)} run{'s' * (len(sides) > 1)} stopped in request {rid}: {cap.stopped}"
    return {"reason": reason, "sides": sides,
            "first": {"scenario": scenario, "request": rid, "tensor": "tokens", "side": "+".join(sides)}}


def compare_captures(ref: Capture, cand: Capture, scenario: str) -> dict[str, dict]:
    """Per check: {'equal': bool, 'reason': str, 'first': {...} | None, 'compared': int,
    'nonfinite': {'reason', 'sides', 'first'} | None}; non-finite items and stopped runs first."""
    out: dict[str, dict] = {c: {"equal": True, "reason": "", "first": None, "compared": 0, "nonfinite": None}
                            for c in EXACT_CHECKS}

    def fail(check: str, reason: str, first: dict) -> None:
        if out[check]["equal"]:
            out[check].update(equal=False, reason=reason, first={"scenario": scenario, **first})

    for check, nf in first_per_check(ref, cand, scenario).items():
        fail(check, nf["reason"], nf["first"])
        out[check]["nonfinite"] = nf
    stop = _stopped(ref, cand, scenario)
    if stop is not None:
        fail("tokens", stop["reason"], stop["first"])
        out["tokens"]["nonfinite"] = stop
    missing_reqs = sorted(set(ref.requests) - set(cand.requests))
    for rid in missing_reqs:
        fail("tokens", f"request {rid} missing from the candidate run", {"request": rid})
    for rid, r in ref.requests.items():
        c = cand.requests.get(rid)
        if c is None:
            continue
        d = first_divergence(r.tokens, c.tokens)
        out["tokens"]["compared"] += 1
        if d is not None:
            fail("tokens", f"token streams part at generated step {d} of request {rid}",
                 {"request": rid, "step": d, "tensor": "tokens",
                  "ref": r.tokens[d] if d < len(r.tokens) else None,
                  "cand": c.tokens[d] if d < len(c.tokens) else None})
        common, missing = _logit_positions(r, c)
        if missing:
            fail("logits", f"candidate computed no logits row for position {missing[0]} of {rid}",
                 {"request": rid, "position": missing[0], "tensor": "logits"})
        for p in common:
            out["logits"]["compared"] += 1
            if r.logits[p].digest != c.logits[p].digest:
                fail("logits", f"logits row differs at position {p} of {rid}",
                     {"request": rid, "position": p, "step": p - r.prompt_len + 1, "tensor": "logits"})
                break
        agree = _agree_len(r, c)
        cand_points = sorted(n for n in c.kda if n <= agree and n >= r.prompt_len)
        if r.kda and not cand_points:
            fail("kda_state", f"candidate emitted no KDA state point comparable with the reference for {rid}",
                 {"request": rid, "tensor": "kda_state"})
        for n in cand_points:
            if n not in r.kda:
                continue
            for key in sorted(r.kda[n]):
                out["kda_state"]["compared"] += 1
                ci = c.kda[n].get(key)
                if ci is None or ci.digest != r.kda[n][key].digest:
                    layer, name = key
                    fail("kda_state", f"KDA layer {layer} {name} differs after {n} tokens of {rid}",
                         {"request": rid, "num_tokens": n, "step": n - r.prompt_len, "layer": layer,
                          "tensor": name})
                    break
        if d is None:                       # rows only comparable when both saw the same tokens
            for layer, item in r.mla.items():
                out["mla_rows"]["compared"] += 1
                ci = c.mla.get(layer)
                if ci is None or ci.digest != item.digest:
                    fail("mla_rows", f"MLA layer {layer} cache rows differ at the end of {rid}",
                         {"request": rid, "layer": layer, "tensor": "mla_rows"})
    return out


def _findings_for(check: str, first: dict, ref: Capture, cand: Capture) -> list[dict]:
    """Turn a hash mismatch into numeric findings (needs captures with tensors kept)."""
    rid = first.get("request")
    if rid is None or rid not in cand.requests:
        return []
    r, c = ref.requests[rid], cand.requests[rid]
    if check == "logits":
        common, _ = _logit_positions(r, c)
        if not common:
            return []
        a = torch.stack([r.logits[p].tensor for p in common])
        b = torch.stack([c.logits[p].tensor for p in common])
        f = compare_logits(a, b, label=f"logits[{rid}] positions {common[0]}..{common[-1]}")
        return [{**f.to_dict(), "message": f.message(), "positions": [common[0], common[-1]]}]
    if check == "kda_state":
        n, key = first["num_tokens"], (first["layer"], first["tensor"])
        if key not in c.kda.get(n, {}):
            return []
        f = compare_tensors(r.kda[n][key].tensor, c.kda[n][key].tensor,
                            label=f"kda[{rid}] layer {key[0]} {key[1]} @ {n} tokens")
        return [{**f.to_dict(), "message": f.message()}]
    if check == "mla_rows":
        layer = first["layer"]
        if layer not in c.mla:
            return []
        a, b = r.mla[layer].tensor, c.mla[layer].tensor
        f = compare_tensors(a, b, label=f"mla[{rid}] layer {layer} rows")
        return [{**f.to_dict(), "message": f.message()}]
    return []


def _nonfinite_finding(nf: dict) -> dict:
    return {"what": "nonfinite", "message": nf["reason"], "sides": nf["sides"], **nf["first"]}


def _drift_refused(ref: Capture, cand: Capture, scenario: str) -> tuple[str, list[dict], dict] | None:
    """A drift budget cannot judge NaN / inf (KL of NaN compares as nothing) or a stopped run:
    (reason, findings, first location) over every such item (logits, kda, mla order), or None."""
    bad = list(first_per_check(ref, cand, scenario).values())
    stop = _stopped(ref, cand, scenario)
    bad += [stop] if stop else []
    if not bad:
        return None
    return "; ".join(nf["reason"] for nf in bad), [_nonfinite_finding(nf) for nf in bad], bad[0]["first"]


def _drift(ref: Capture, cand: Capture, contract) -> tuple[bool, str, list[dict], dict]:
    """Approx contract: every teacher-forced logits row against the drift budget."""
    rows_r, rows_c, state_findings = [], [], []
    for rid, r in ref.requests.items():
        c = cand.requests[rid]
        common = sorted(p for p in r.logits if p in c.logits)
        rows_r += [r.logits[p].tensor for p in common]
        rows_c += [c.logits[p].tensor for p in common]
        for n in sorted(set(r.kda) & set(c.kda))[-1:]:           # final common state point
            for key in sorted(r.kda[n]):
                if key[1] == "recurrent":
                    f = compare_tensors(r.kda[n][key].tensor, c.kda[n][key].tensor,
                                        label=f"kda[{rid}] layer {key[0]} recurrent @ {n}")
                    scale = float(r.kda[n][key].tensor.abs().max())
                    state_findings.append({"request": rid, "layer": key[0], "max_abs": f.max_abs,
                                           "max_ulp": f.max_ulp, "max_rel": f.max_rel,
                                           "rel_to_max": f.max_abs / scale if scale > 0 else f.max_abs})
    if not rows_r:
        return False, "no logits rows in common between reference and candidate", [], {}
    f = compare_logits(torch.stack(rows_r), torch.stack(rows_c), label="teacher-forced logits")
    fd = {**f.to_dict(), "message": f.message()}
    problems = []
    if contract.max_kl is not None and f.kl_max > contract.max_kl:
        problems.append(f"max KL {f.kl_max:.3g} > budget {contract.max_kl:g}")
    if contract.min_top1 is not None and f.top1_agreement < contract.min_top1:
        problems.append(f"top-1 agreement {f.top1_agreement:.4f} < budget {contract.min_top1:g}")
    if contract.max_ulp is not None and (f.max_ulp or 0) > contract.max_ulp:
        problems.append(f"max ULP {f.max_ulp} > budget {contract.max_ulp}")
    state_rel = max((sf["rel_to_max"] for sf in state_findings), default=0.0)
    if contract.max_state_rel is not None and state_rel > contract.max_state_rel:
        worst = max(state_findings, key=lambda sf: sf["rel_to_max"])
        problems.append(f"KDA state drift {state_rel:.3g} of max|state| > budget {contract.max_state_rel:g} "
                        f"(layer {worst['layer']}, request {worst['request']})")
    evidence = {"kl_max": f.kl_max, "kl_mean": f.kl_mean, "top1_agreement": f.top1_agreement,
                "max_ulp": f.max_ulp, "max_abs": f.max_abs, "rows": f.n_rows,
                "argmax_flips": f.argmax_flips, "kda_state_drift": state_findings,
                "kda_state_rel_max": state_rel}
    if problems:
        return False, "; ".join(problems), [fd], evidence
    return True, (f"within budget: max KL {f.kl_max:.3g}, top-1 {f.top1_agreement:.4f}, "
                  f"max ULP {f.max_ulp} over {f.n_rows} rows, KDA state drift {state_rel:.3g}"), [fd], evidence


def model_device(model) -> str:
    """'cpu' or 'cuda': where the model's weights live (CUDA-only toggles skip elsewhere)."""
    return next(model.parameters()).device.type


def applies(toggle, scenario, device: str = "cpu", world_size: int = 1) -> str | None:
    """None if the toggle applies to the scenario here; else the reason it does not."""
    if device not in toggle.devices:
        return f"toggle runs on {', '.join(toggle.devices)}, not {device}"
    if world_size not in toggle.world_sizes:
        return f"toggle runs at world size {', '.join(map(str, toggle.world_sizes))}, not {world_size}"
    if toggle.scenario_tags and not set(toggle.scenario_tags) & set(scenario.tags):
        return f"toggle applies to scenarios tagged {', '.join(toggle.scenario_tags)}"
    return None


class ReferenceRuns:
    """Reference captures (tensors kept) per scenario, computed once and shared by every
    toggle judged in the same process. At world size W > 1 every run (reference: the same
    W without the toggle) goes through the tensor-parallel runner's W ranks, started once."""

    def __init__(self, model, world_size: int = 1, backend: str = "gloo"):
        self.model = model
        self.world_size = world_size
        self.backend = backend              # torch.distributed backend of the W > 1 ranks
        self._runs: dict[str, Capture] = {}
        self._tp = None

    def run(self, scenario, toggle_names=(), *, keep: bool = False, force=None) -> Capture:
        if self.world_size == 1:
            return run_scenario(self.model, scenario, toggle_names, keep=keep, force=force)
        if self._tp is None:
            from k3verify.run.tp import TPRunner
            self._tp = TPRunner(self.model, self.world_size, backend=self.backend)
        return self._tp.run(scenario, toggle_names, keep=keep, force=force)

    def get(self, scenario) -> Capture:
        if scenario.name not in self._runs:
            self._runs[scenario.name] = self.run(scenario, (), keep=True)
        return self._runs[scenario.name]

    def close(self) -> None:
        if self._tp is not None:
            self._tp.close()
            self._tp = None


def check_toggle(model, toggle_name: str, scenario, *, localize_failures: bool = True,
                 references: ReferenceRuns | None = None) -> list[CheckResult]:
    """Run reference and candidate on one scenario and judge the toggle's contract."""
    references = references or ReferenceRuns(model)
    toggle = toggle_registry.get(toggle_name)
    contract = toggle.contract
    base = dict(toggle=toggle.name, kind=toggle.kind, contract=contract.describe(), scenario=scenario.name)
    skip = applies(toggle, scenario, device=model_device(model), world_size=references.world_size)
    if skip:
        checks = EXACT_CHECKS if contract.kind == "exact" else ("drift_budget",)
        return [CheckResult(check=c, status="skip", reason=skip, **base) for c in checks]
    t0 = time.perf_counter()
    ref = references.get(scenario)
    # localisation replays on the single-process model, where a TP toggle changes nothing
    localize_failures = localize_failures and references.world_size == 1
    if contract.kind == "approx":
        force = {rid: rc.tokens for rid, rc in ref.requests.items()}
        cand = references.run(scenario, (toggle.name,), keep=True, force=force)
        refused = _drift_refused(ref, cand, scenario.name)
        if refused:
            reason, findings = refused[0], refused[1]
            ok, first, evidence = False, refused[2], {"nonfinite": refused[2]}
        else:
            ok, reason, findings, evidence = _drift(ref, cand, contract)
            first = None
        res = CheckResult(check="drift_budget", status="pass" if ok else "fail", reason=reason,
                          findings=findings, evidence=evidence, first_divergence=first,
                          duration_s=time.perf_counter() - t0, **base)
        if not ok and localize_failures:
            res.localization = _localize(model, toggle.name, scenario, ref, first=first)
        return [res]
    cand = references.run(scenario, (toggle.name,))
    verdicts = compare_captures(ref, cand, scenario.name)
    if not all(v["equal"] for v in verdicts.values()):
        # deterministic: the same run again, now with tensors kept for the findings
        cand = references.run(scenario, (toggle.name,), keep=True)
        verdicts = compare_captures(ref, cand, scenario.name)
    duration = time.perf_counter() - t0
    results = []
    loc = None
    failing = [c for c in EXACT_CHECKS if not verdicts[c]["equal"]]
    # the state check knows which state tensor went wrong first: localise from it if it failed
    state_first = next((verdicts[c]["first"] for c in ("kda_state", "mla_rows") if c in failing),
                       verdicts[failing[0]]["first"] if failing else None)
    for check in EXACT_CHECKS:
        v = verdicts[check]
        if v["equal"]:
            results.append(CheckResult(check=check, status="pass", duration_s=duration,
                                       reason=f"bit-identical ({v['compared']} compared)", **base))
            continue
        findings = ([_nonfinite_finding(v["nonfinite"])] if v["nonfinite"]
                    else _findings_for(check, v["first"], ref, cand))
        if loc is None and localize_failures:
            loc = _localize(model, toggle.name, scenario, ref, first=state_first)
        results.append(CheckResult(check=check, status="fail", reason=v["reason"], findings=findings,
                                   first_divergence=v["first"], localization=loc, duration_s=duration,
                                   evidence={"nonfinite": v["first"]} if v["nonfinite"] else {}, **base))
    return results


def _localize(model, toggle_name: str, scenario, ref: Capture, first: dict | None = None) -> dict | None:
    from k3verify.localize import localize_request
    rid = (first or {}).get("request") or next(iter(ref.requests))
    r = ref.requests[rid]
    spec = next(x for x in scenario.requests if x.request_id == rid)
    ids = list(spec.prompt_ids) + r.tokens[:-1]
    return localize_request(model, toggle_name, ids, request_id=rid, state_first=first)
