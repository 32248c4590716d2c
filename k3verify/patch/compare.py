"""What a patch changes, bit for bit, and whether the gate allows it (`k3verify diff --base`).

Input: the same units (reference | toggle, scenario) captured on REV and on the working
tree, plus the working tree's contract results. Output: report results (schema v1) and
the line a reviewer reads first.

Per (label, scenario, tensor kind) the change comes from the project's one comparator:
gate.compare_captures for hash-level equality and the first divergence, then
compare_logits / compare_tensors on the kept tensors for the ULP histogram, max |Δ|, KL and
argmax flips. Rules (a changed row passes only when the rule for its label allows it):
- reference: changed bits need the golden hashes of this numerics environment updated in
  the patch, with a new reason, and those hashes must match the working tree's reference;
- exact toggle: changed bits are fine while the toggle still equals the working tree's
  reference (its exact contract, gate.check_toggle, run on the working tree);
- approx toggle: changed bits are fine while its drift budget holds on the working tree;
  the row shows how far it moved against REV.
The exact contracts are also run whenever the reference changed, moved toggle or not.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..capture.capture import Capture
from ..compare.tensors import compare_logits, compare_tensors, first_divergence
from ..compare.captures import compare_captures
from ..compare.golden import location

KINDS = ("tokens", "logits", "kda_state", "mla_rows")
REFERENCE = "(reference)"


@dataclass
class KindDiff:
    kind: str
    changed: bool
    compared: int
    reason: str
    first: dict | None = None
    findings: list[dict] = field(default_factory=list)
    evidence: dict = field(default_factory=dict)


@dataclass
class UnitDiff:
    """One (label, scenario): the per-kind diffs, or why there is nothing to compare."""
    label: str
    scenario: str
    kinds: dict[str, KindDiff] = field(default_factory=dict)
    not_compared: str | None = None     # scenario changed / REV could not run it
    error: str | None = None            # the working tree's run crashed
    traceback: str | None = None
    prompts_sha256: str | None = None   # the same on both sides: they ran the same requests

    @property
    def changed(self) -> bool:
        return any(k.changed for k in self.kinds.values())


def _finding(f) -> dict:
    return {**f.to_dict(), "message": f.message()}


def _agree(r, c) -> int:
    d = first_divergence(r.tokens, c.tokens)
    return r.prompt_len + (len(r.tokens) if d is None else d)


def _flat_compare(pairs: list[tuple[torch.Tensor, torch.Tensor]], label: str) -> dict | None:
    """One finding over many same-dtype tensors, flattened and concatenated."""
    pairs = [(a, b) for a, b in pairs if a.shape == b.shape]
    if not pairs or len({a.dtype for a, _ in pairs} | {b.dtype for _, b in pairs}) != 1:
        return None
    a = torch.cat([x.reshape(-1) for x, _ in pairs])
    b = torch.cat([y.reshape(-1) for _, y in pairs])
    return _finding(compare_tensors(a, b, label=label))


def _first_tensor(a: torch.Tensor, b: torch.Tensor, label: str) -> dict:
    f = compare_tensors(a, b, label=label)
    keep = ("what", "shape", "n_bit_different", "n_total", "max_ulp", "max_ulp_index", "max_abs",
            "first_index_tuple", "first_ref", "first_cand")
    return {k: v for k, v in f.to_dict().items() if k in keep}


def diff_captures(base: Capture, head: Capture, scenario: str) -> dict[str, KindDiff]:
    """REV's capture against the working tree's, per tensor kind (captures with tensors kept)."""
    cmp = compare_captures(base, head, scenario)
    both = [(rid, r, head.requests[rid]) for rid, r in base.requests.items() if rid in head.requests]
    parted = {rid: first_divergence(r.tokens, c.tokens) for rid, r, c in both}
    parted = {rid: d for rid, d in parted.items() if d is not None}
    out: dict[str, KindDiff] = {}
    for kind in KINDS:
        v = cmp[kind]
        kd = KindDiff(kind, not v["equal"], v["compared"], "", v["first"])
        out[kind] = kd
        if kind == "mla_rows" and v["equal"] and parted:
            # rows are compared only for requests whose token streams agree
            kd.changed = True
            kd.reason = f"not comparable for {len(parted)} request(s) whose token streams part (see tokens)"
            continue
        if not kd.changed:
            suffix = " (up to where the token streams part)" if parted and kind in ("logits", "kda_state") else ""
            kd.reason = f"bit-identical to REV ({v['compared']} compared){suffix}"
            continue
        kd.reason = f"{v['reason']} ({location(v['first'])})" if v["first"] else v["reason"]
        try:
            _numbers(kd, kind, both, scenario, parted)
        except Exception as exc:  # noqa: BLE001 - the verdict stands on the hashes; say why numbers are missing
            kd.evidence["numbers_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def _numbers(kd: KindDiff, kind: str, both, scenario: str, parted: dict) -> None:
    first = kd.first or {}
    if kind == "tokens":
        kd.evidence.update(requests_parted=len(parted), requests=len(both))
        rid = first.get("request")
        pair = next(((r, c) for i, r, c in both if i == rid), None)
        if pair and len(pair[0].tokens) == len(pair[1].tokens) and pair[0].tokens:
            kd.findings.append(_finding(compare_tensors(torch.tensor(pair[0].tokens), torch.tensor(pair[1].tokens),
                                                        label=f"tokens[{rid}] ({scenario})")))
        return
    if kind == "logits":
        rows_b, rows_h, n_req = [], [], 0
        for rid, r, c in both:
            agree = _agree(r, c)
            common = sorted(p for p in r.logits if p in c.logits and p < agree)
            rows_b += [r.logits[p].tensor for p in common]
            rows_h += [c.logits[p].tensor for p in common]
            n_req += bool(common)
        if rows_b:
            f = compare_logits(torch.stack(rows_b), torch.stack(rows_h),
                               label=f"logits ({scenario}): {len(rows_b)} rows of {n_req} requests, "
                                     f"REV vs working tree")
            kd.findings.append(_finding(f))
        return
    if kind == "kda_state":
        pairs = []
        for rid, r, c in both:
            agree = _agree(r, c)
            for n in sorted(set(r.kda) & set(c.kda)):
                if n <= agree:
                    pairs += [(r.kda[n][k].tensor, c.kda[n][k].tensor) for k in sorted(r.kda[n]) if k in c.kda[n]]
        f = _flat_compare(pairs, f"kda_state ({scenario}): {len(pairs)} state tensors, flattened")
        if f:
            kd.findings.append(f)
        rid, n, key = first.get("request"), first.get("num_tokens"), (first.get("layer"), first.get("tensor"))
        r, c = next(((r, c) for i, r, c in both if i == rid), (None, None))
        if r is not None and key in r.kda.get(n, {}) and key in c.kda.get(n, {}):
            kd.evidence["first_tensor"] = _first_tensor(r.kda[n][key].tensor, c.kda[n][key].tensor,
                                                        f"kda[{rid}] layer {key[0]} {key[1]} @ {n} tokens")
        return
    if kind == "mla_rows":
        pairs = [(r.mla[layer].tensor, c.mla[layer].tensor) for rid, r, c in both if rid not in parted
                 for layer in sorted(r.mla) if layer in c.mla]
        f = _flat_compare(pairs, f"mla_rows ({scenario}): {len(pairs)} layer caches, flattened")
        if f:
            kd.findings.append(f)
        rid, layer = first.get("request"), first.get("layer")
        r, c = next(((r, c) for i, r, c in both if i == rid), (None, None))
        if r is not None and layer in r.mla and layer in c.mla:
            kd.evidence["first_tensor"] = _first_tensor(r.mla[layer].tensor, c.mla[layer].tensor,
                                                        f"mla[{rid}] layer {layer} rows")


# ---- rules -> report results ------------------------------------------------------------

def _row(label: str, contract: str, check: str, scenario: str | None, status: str, reason: str,
         **extra: Any) -> dict[str, Any]:
    return {"toggle": label, "kind": "optimization", "contract": contract, "check": check, "scenario": scenario,
            "status": status, "reason": reason, "findings": [], "first_divergence": None, "localization": None,
            "caught": None, "duration_s": 0.0, "speedup": None, **extra}


def _moved(kd: KindDiff) -> str:
    """'max ULP 3, max |Δ| 1.2e-07, KL 4e-15, 0 argmax flips' from a changed kind's finding."""
    f = kd.findings[0] if kd.findings else {}
    bits = []
    if f.get("max_ulp") is not None:
        bits.append(f"max ULP {f['max_ulp']}")
    if isinstance(f.get("max_abs"), (int, float)):
        bits.append(f"max |Δ| {f['max_abs']:.2g}")
    if isinstance(f.get("kl_max"), (int, float)):
        bits.append(f"KL {f['kl_max']:.2g}")
    if "argmax_flips" in f:
        bits.append(f"{f['argmax_flips']} argmax flips")
    if f.get("n_total"):
        bits.append(f"{f['n_bit_different']}/{f['n_total']} elements differ")
    return ", ".join(bits)


def contract_ok(rows: list[dict]) -> tuple[bool, str]:
    """(holds, why) over one (toggle, scenario)'s contract results from the working tree."""
    bad = [r for r in rows if r.get("status") in ("fail", "error")]
    if bad:
        return False, f"{bad[0].get('check')} {bad[0]['status']}: {bad[0].get('reason', '')}"
    if not rows:
        return False, "its contract was not run on the working tree"
    passed = [r for r in rows if r.get("status") == "pass"]
    why = passed[0].get("reason", "") if len(passed) == 1 else f"{len(passed)} checks pass"
    return True, why


def contracts_needed(plan: dict, diffs: dict[tuple[str, str], UnitDiff]) -> list[tuple[str, str]]:
    """(toggle, scenario) pairs whose contract must run on the working tree: a toggle whose bits
    moved there, every toggle when the reference moved anywhere, and every new toggle."""
    ref_changed = any(d.changed for (label, _), d in diffs.items() if label == REFERENCE)
    out = []
    for lp in plan["labels"]:
        if lp["status"] == "added":
            out += [(lp["label"], s) for s in lp["scenarios"]]
        elif lp["status"] == "compare" and lp["label"] != REFERENCE:
            for s in lp["scenarios"]:
                d = diffs[(lp["label"], s)]
                if not d.error and not d.not_compared and (d.changed or ref_changed):
                    out.append((lp["label"], s))
    return out


def golden_verdict(base_text: str | None, head_text: str | None, model_id: str, env_key: str | None,
                   check: dict | None) -> dict:
    """May the reference's bits change? Only when this environment's golden file changed between
    REV and the working tree, its entry for this model carries a new reason, and the working
    tree's reference matches it (`golden check`, unless that check cannot judge this machine)."""
    import json

    name = f"golden/hashes/{env_key}.json"
    ev = {"golden_file": name, "model_id": model_id}

    def entry(text):
        try:
            return (json.loads(text).get("models") or {}).get(model_id)
        except (ValueError, AttributeError):
            return None

    if env_key is None:
        return {"allowed": False, "why": "the working tree has no numerics environment key (golden_hashes)",
                "evidence": ev}
    if head_text is None:
        return {"allowed": False, "why": f"the working tree has no {name}: record it with "
                                         f"`k3verify golden record --reason ...`", "evidence": ev}
    if head_text == base_text:
        return {"allowed": False, "why": f"{name} is the same as in REV: re-record it with "
                                         f"`k3verify golden record --reason ...` and commit it with the patch",
                "evidence": ev}
    new, old = entry(head_text), entry(base_text) if base_text is not None else None
    if not isinstance(new, dict):
        return {"allowed": False, "why": f"{name} changed but has no entry for model {model_id[:23]}", "evidence": ev}
    reason = str(new.get("reason") or "").strip()
    ev.update(reason=reason, recorded=new.get("recorded"))
    if not reason:
        return {"allowed": False, "why": f"{name}: the entry for this model has no reason", "evidence": ev}
    if isinstance(old, dict) and str(old.get("reason") or "").strip() == reason:
        return {"allowed": False, "why": f"{name} changed but its reason is REV's ({reason!r}): "
                                         f"say why this patch changes the reference", "evidence": ev}
    if check is not None:
        ev["golden_check"] = {"status": check.get("status"), "reason": check.get("reason")}
        if check.get("status") == "fail":
            return {"allowed": False, "why": f"{name} was updated ({reason!r}) but the working tree's reference "
                                             f"does not match it: {check.get('reason')}", "evidence": ev}
    return {"allowed": True, "why": f"{name} re-recorded with reason {reason!r}", "evidence": ev}


def judge(plan: dict, diffs: dict[tuple[str, str], UnitDiff], contracts: dict[tuple[str, str], list[dict]],
          golden: dict) -> tuple[list[dict], dict]:
    """(report results, summary) from the plan, the per-unit diffs, the working tree's contract
    results per (toggle, scenario) and the golden-update verdict."""
    rows: list[dict] = []
    ref_changed = any(d.changed for (label, _), d in diffs.items() if label == REFERENCE)
    toggle_words: list[tuple[str, str]] = []
    broken_exact: list[str] = []
    for lp in plan["labels"]:
        label, contract, ckind = lp["label"], lp["contract"], lp["contract_kind"]
        if lp["status"] != "compare":
            rows.append(_row(label, contract, "base_diff", None, "skip", lp["reason"]))
            if lp["status"] == "added":
                ok = _append_contracts(rows, label, lp["scenarios"], contracts)
                toggle_words.append((label, "new, " + ("contract holds" if ok else "CONTRACT FAILS")))
                if not ok and ckind == "exact":
                    broken_exact.append(label)
            continue
        label_changed = False
        label_ok = True
        for scenario in lp["scenarios"]:
            d = diffs[(label, scenario)]
            if d.error:
                rows.append(_row(label, contract, "base_diff", scenario, "error",
                                 f"the working tree's run failed: {d.error}", traceback=d.traceback))
                label_ok = False
                continue
            if d.not_compared:
                rows.append(_row(label, contract, "base_diff", scenario, "skip", d.not_compared))
                continue
            label_changed |= d.changed
            if label == REFERENCE:
                allowed, why = golden["allowed"], golden["why"]
            elif d.changed or ref_changed:
                allowed, why = contract_ok(contracts.get((label, scenario), []))
            else:
                allowed, why = True, ""
            for kind in KINDS:
                kd = d.kinds[kind]
                ev = {"change": "changed" if kd.changed else "unchanged", "compared": kd.compared,
                      "prompts_sha256": d.prompts_sha256, **kd.evidence}
                if not kd.changed:
                    rows.append(_row(label, contract, f"base_diff.{kind}", scenario, "pass", kd.reason, evidence=ev))
                    continue
                moved = _moved(kd)
                head = f"changed vs REV: {kd.reason}" + (f"; {moved}" if moved else "")
                if label == REFERENCE:
                    tail = (f"allowed: {why}" if allowed else
                            f"the patch changes the reference without updating the golden hashes: {why}")
                elif ckind == "exact":
                    tail = (f"still bit-identical to the working tree's reference ({why})" if allowed else
                            f"no longer equals the working tree's reference: {why} (localise it with "
                            f"`k3verify diff --toggle {label}`)")
                else:
                    tail = (f"within budget on the working tree: {why.removeprefix('within budget: ')}" if allowed else
                            f"over budget on the working tree: {why}")
                rows.append(_row(label, contract, f"base_diff.{kind}", scenario, "pass" if allowed else "fail",
                                 f"{head}; {tail}", findings=kd.findings,
                                 first_divergence=kd.first, evidence=ev))
            if label != REFERENCE and (d.changed or ref_changed):
                label_ok &= _append_contracts(rows, label, [scenario], contracts)
        if label == REFERENCE:
            if ref_changed:
                rows.append(_row(label, contract, "base_diff.golden", None, "pass" if golden["allowed"] else "fail",
                                 golden["why"], evidence=golden.get("evidence", {})))
            continue
        if label_changed:
            word = (("still exact" if label_ok else "NO LONGER EXACT") if ckind == "exact" else
                    ("within budget" if label_ok else "OVER BUDGET"))
            toggle_words.append((label, word))
        if not label_ok and ckind == "exact":
            broken_exact.append(label)
    kinds = {lp["label"]: lp.get("kind", "optimization") for lp in plan["labels"]}
    for r in rows:                           # a mutant named with --toggle is reported as one
        r["kind"] = kinds.get(r["toggle"], r["kind"])
    summary = _summary(plan, diffs, rows, ref_changed, golden, toggle_words, broken_exact)
    return rows, summary


def _append_contracts(rows: list[dict], label: str, scenarios: list[str],
                      contracts: dict[tuple[str, str], list[dict]]) -> bool:
    ok = True
    for scenario in scenarios:
        got = contracts.get((label, scenario), [])
        holds, _ = contract_ok(got)
        ok &= holds
        for r in got:
            rows.append({**_row(label, r.get("contract", ""), "", scenario, "error", ""), **r,
                         "check": f"contract.{r.get('check', '?')}", "toggle": label})
    return ok


def _summary(plan, diffs, rows, ref_changed, golden, toggle_words, broken_exact) -> dict:
    base = plan["base"]["short"]
    scenarios = sorted({s for lp in plan["labels"] if lp["status"] == "compare" for s in lp["scenarios"]})
    n_toggles = sum(lp["label"] != REFERENCE and lp["status"] == "compare" for lp in plan["labels"])
    not_compared = sorted({f"{d.scenario} ({d.not_compared})" for d in diffs.values() if d.not_compared})
    errors = [r for r in rows if r["status"] == "error"]
    added = [lp["label"] for lp in plan["labels"] if lp["status"] == "added"]
    removed = [lp["label"] for lp in plan["labels"] if lp["status"] == "removed"]
    if ref_changed:
        ref_first = next((d.kinds["logits"].first or next((k.first for k in d.kinds.values() if k.first), None)
                          for (label, _), d in diffs.items() if label == REFERENCE and d.changed), None)
        where = f"first at {location(ref_first)}" if ref_first else "see report"
        ref_text = (f"yes ({where}), with the golden hashes re-recorded: {golden['why']}" if golden["allowed"] else
                    f"yes ({where}), WITHOUT a golden update: {golden['why']}")
    else:
        ref_text = "no"
    nothing = not ref_changed and not toggle_words and not not_compared and not errors and not added and not removed
    if nothing:
        toggles = "1 toggle is" if n_toggles == 1 else f"{n_toggles} toggles are"
        on = "1 scenario" if len(scenarios) == 1 else f"{len(scenarios)} scenarios"
        line = (f"this patch changes no bits: the reference and {toggles} bit-identical to "
                f"{base} on {on} ({', '.join(scenarios)})")
    else:
        parts = [f"this patch changes the reference: {ref_text}"]
        changed = [(t, w) for t, w in toggle_words if not w.startswith("new")]
        whose = "1 toggle's" if len(changed) == 1 else f"{len(changed)} toggles'"
        parts.append(f"changes {whose} bits: " + ", ".join(f"{t} ({w})" for t, w in changed)
                     if changed else "changes no toggle's bits")
        parts.append("every exact contract still holds: " + ("yes" if not broken_exact else
                                                             f"NO ({', '.join(broken_exact)})"))
        if added:
            parts.append("new toggles: " + ", ".join(f"{t} ({w.removeprefix('new, ')})" for t, w in toggle_words
                                                      if w.startswith("new")))
        if removed:
            parts.append(f"removed toggles: {', '.join(removed)}")
        if not_compared:
            parts.append(f"not compared: {'; '.join(not_compared)}")
        if errors:
            parts.append(f"{len(errors)} run(s) failed on the working tree")
        line = "; ".join(parts)
    return {"line": line, "reference_changed": ref_changed, "golden": golden, "nothing_changed": nothing,
            "toggles_changed": [{"toggle": t, "verdict": w} for t, w in toggle_words],
            "exact_contracts_hold": not broken_exact, "broken_exact": broken_exact,
            "scenarios": scenarios, "toggles_compared": n_toggles, "not_compared": not_compared}
