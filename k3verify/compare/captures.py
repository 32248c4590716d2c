"""Capture-level comparison: two Captures of the same scenario, check by check.

`compare_captures` answers, per exact check (EXACT_CHECKS), whether the candidate's capture
is bit-identical to the reference's, by hash, and where it first is not:
- tokens:    the generated token streams are identical;
- logits:    every logit row the candidate computed for a position on the common token
             prefix is bit-identical to the reference row (rows that produced a generated
             token must all be there);
- kda_state: every KDA state point (recurrent + conv windows, every layer) the candidate
             emitted equals the reference at the same token count;
- mla_rows:  the MLA cache rows at the end are bit-identical.
A reference whose logits are constant over the vocabulary (`degenerate_reference`) proves
nothing by agreement: the gate fails every check on it before comparing. A check that compared
nothing (0 hashes: no MLA rows captured, rows not comparable after the streams parted) is not
a pass either: verdict/gate.py reads `compared`.
Hashes cannot see NaN / inf (a NaN row hashes alike on both sides), so a non-finite item
recorded by either capture fails the check that owns it first (capture/nonfinite.py), and a
run the sampler stopped fails `tokens`.

`findings_for` turns a hash mismatch into numeric findings (compare/tensors.py: ULP, KL ...),
given captures with tensors kept; `measure_drift` is the teacher-forced measurement an approx
contract is judged on (verdict/gate.py holds the budget).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3verify.capture.capture import Capture, RequestCapture
from k3verify.capture.nonfinite import SIDES, first_per_check, stopped_request
from k3verify.compare.tensors import LogitFinding, compare_logits, compare_tensors, first_divergence

EXACT_CHECKS = ("tokens", "logits", "kda_state", "mla_rows")


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


def degenerate_reference(ref: Capture, scenario: str) -> dict | None:
    """{"reason", "first"} when the reference itself is broken, else None.

    A logits row whose entries are all equal (max - min == 0 over the vocabulary: a zeroed
    lm_head, a collapsed norm) carries no prediction: greedy picks token 0 (NUL on the byte
    tokenizer) on every step, and a candidate broken the same way agrees with it bit for bit.
    Agreement between two broken sides is not a pass, so every check fails on such a reference.
    Needs the reference's tensors (Runner.reference keeps them); rows without one are not judged.
    Non-finite rows are failed by the non-finite record (capture/nonfinite.py), not here."""
    for rid, r in ref.requests.items():
        for p in sorted(r.logits):
            t = r.logits[p].tensor
            if t is None or t.numel() < 2:
                continue
            lo, hi = torch.aminmax(t.reshape(-1))
            if not bool(hi - lo == 0):              # NaN / inf give NaN here: not this rule's
                continue
            step = p - r.prompt_len + 1
            where = f"step {step}" if step >= 0 else f"prompt position {p}"
            stream = ""
            if r.tokens and len(set(r.tokens)) == 1:
                stream = f"; its greedy stream is token {r.tokens[0]} repeated {len(r.tokens)} times"
            reason = (f"reference is degenerate: logits constant over the vocabulary at {where} of request {rid} "
                      f"(every entry {float(lo):.6g}{stream}): agreement with it proves nothing")
            return {"reason": reason, "first": {"scenario": scenario, "request": rid, "position": p, "step": step,
                                                "tensor": "logits", "side": "reference", "degenerate": "constant"}}
    return None


def findings_for(check: str, first: dict, ref: Capture, cand: Capture) -> list[dict]:
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
        if "num_tokens" not in first:       # e.g. "no comparable state point": nothing to measure
            return []
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


def nonfinite_finding(nf: dict) -> dict:
    return {"what": "nonfinite", "message": nf["reason"], "sides": nf["sides"], **nf["first"]}


def drift_refused(ref: Capture, cand: Capture, scenario: str) -> tuple[str, list[dict], dict] | None:
    """A drift budget cannot judge NaN / inf (KL of NaN compares as nothing) or a stopped run:
    (reason, findings, first location) over every such item (logits, kda, mla order), or None."""
    bad = list(first_per_check(ref, cand, scenario).values())
    stop = _stopped(ref, cand, scenario)
    bad += [stop] if stop else []
    if not bad:
        return None
    return "; ".join(nf["reason"] for nf in bad), [nonfinite_finding(nf) for nf in bad], bad[0]["first"]



@dataclass
class Drift:
    """Teacher-forced drift of a candidate against the reference: every common logits row
    compared at once (`logits`: a LogitFinding with KL, top-1, ULP), and the final common KDA
    recurrent state per request and layer relative to the reference state's largest entry."""

    logits: LogitFinding | None            # None: no logits rows in common
    state: list[dict]

    @property
    def state_rel_max(self) -> float:
        return max((s["rel_to_max"] for s in self.state), default=0.0)

    def evidence(self) -> dict:
        f = self.logits
        return {"kl_max": f.kl_max, "kl_mean": f.kl_mean, "top1_agreement": f.top1_agreement,
                "max_ulp": f.max_ulp, "max_abs": f.max_abs, "rows": f.n_rows, "argmax_flips": f.argmax_flips,
                "kda_state_drift": self.state, "kda_state_rel_max": self.state_rel_max}


def measure_drift(ref: Capture, cand: Capture) -> Drift:
    rows_r, rows_c, state = [], [], []
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
                    state.append({"request": rid, "layer": key[0], "max_abs": f.max_abs, "max_ulp": f.max_ulp,
                                  "max_rel": f.max_rel, "rel_to_max": f.max_abs / scale if scale > 0 else f.max_abs})
    if not rows_r:
        return Drift(None, state)
    return Drift(compare_logits(torch.stack(rows_r), torch.stack(rows_c), label="teacher-forced logits"), state)
