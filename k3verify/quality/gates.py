"""Quality gates for approx toggles: GSM8K (paired), needle recall and KVV, as report results.

An approx toggle may move numerics within its drift budget, but it only counts if
quality holds (design.md). Each gate here runs the reference path and, given a
candidate, the same inputs again with the toggle applied, then turns the outcome
into report results (k3verify.report.schema) with one verdict each:

- gsm8k: lm-eval's gsm8k task on both, joined per question (doc_id + lm-eval's
  prompt_hash, so a changed prompt cannot be paired by accident); one result per
  lm-eval filter with the three-way verdict of stats.paired_test (pass / fail /
  inconclusive: Tango's score bound, the exact McNemar test, the n the margin needs),
  never a raw score compare. Every result carries the MDE and the n the margin needs.
- needle: one result per (length, depth) cell, paired per case: the candidate must
  recall every needle the reference recalled; a cell where the reference recalled
  none is inconclusive (no candidate could lose recall there).
- kvv: one result per KVV contract check or imported benchmark score, plus an
  inconclusive result when none of them passed (all skipped: no evidence either way).

Without a candidate a gate is a measurement: its results pass, say so in their
reason, and fail only below an explicit floor (min_accuracy / min_recall).
A smoke run (gsm8k smoke=True) keeps its statistical status but is marked
role "smoke": its pass or inconclusive never counts as the gate holding; its fail or
error still fails (report/schema.py).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from k3verify.quality.stats import n_min_for_margin, paired_mde, paired_test, wilson_interval
from optimized_stack.errors import K3Error

FILTERS = ("strict-match", "flexible-extract")
FILTER_KEYS = {"strict-match": "strict", "flexible-extract": "flexible"}
# Long contexts on the CPU: the reference MLA attention is a blocked python loop and the
# recurrent KDA a per-token loop; both become impractical past ~16K tokens.
FAST_TOGGLES = ("kda_chunked", "mla_sdpa")
AUTO_FAST_ABOVE_TOKENS = 16384
NEEDLE_MAX_NEW_TOKENS = 12  # a 7-digit value plus a little slack after the answer prefix
# Prompts are prefilled in chunks of this many tokens through the incremental API (exact on
# the reference path). It bounds attention memory to O(chunk x T): torch's SDPA takes its
# math fallback for MLA (qk head dim != v head dim), which holds [H, T_q, T] scores; a
# whole 108K-token prefill in one call was OOM-killed at 22.7 GB on the 24 GiB dev box.
PREFILL_CHUNK_TOKENS = 512

GenerateFn = Callable[[list[str], int, list[str]], list[str]]
Progress = Callable[[str], None]


@dataclass
class GateRun:
    """What a gate produced: schema-valid report results and the raw evidence behind them."""

    gate: str
    results: list[dict]
    details: dict

    def __post_init__(self) -> None:
        if not self.results:
            raise K3Error(f"gate {self.gate!r} produced no results; expected at least one")

    @property
    def passed(self) -> bool:
        """Every result passed or was skipped, and at least one passed (all skipped is no evidence)."""
        statuses = [r["status"] for r in self.results]
        return "pass" in statuses and all(s in ("pass", "skip") for s in statuses)


def make_result(toggle: str, kind: str, contract: str, check: str, status: str, reason: str, *,
                scenario: str | None = None, duration_s: float = 0.0, **extra: Any) -> dict:
    """One report result (schema.py fields) plus gate-specific evidence keys."""
    return {"toggle": toggle, "kind": kind, "contract": contract, "check": check, "scenario": scenario,
            "status": status, "reason": reason, "findings": [], "first_divergence": None,
            "localization": None, "caught": None, "duration_s": max(0.0, float(duration_s)),
            "speedup": None, **extra}


def toggle_labels(name: str | None) -> tuple[str, str, str]:
    """(toggle, kind, contract text) for a result; None is the reference path measured alone."""
    if name is None:
        return "reference", "optimization", "measurement (reference path)"
    from optimized_stack import toggles as registry
    t = registry.get(name)  # unknown names: K3Error with a did-you-mean
    return t.name, t.kind, t.contract.describe()


def toggled(generate_fn: GenerateFn, names: Sequence[str]) -> GenerateFn:
    """generate_fn with the named toggles applied around every call (and removed after it)."""
    if not names:
        return generate_fn
    from optimized_stack import toggles as registry
    for n in names:
        registry.get(n)

    def generate(prompts: list[str], max_new_tokens: int, stop: list[str]) -> list[str]:
        with registry.applied(list(names)):
            return generate_fn(prompts, max_new_tokens, stop)
    return generate


def _ci(k: int, n: int, alpha: float) -> list[float]:
    lo, hi = wilson_interval(k, n, 2 * alpha)  # two-sided 1 - 2*alpha, as the HTML renderer draws
    return [lo, hi]


# ---------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------

def _outcomes(run: dict, flt: str) -> dict[tuple[int, str], bool]:
    key = FILTER_KEYS[flt]
    return {(r["doc_id"], r["prompt_hash"]): bool(r[f"correct_{key}"]) for r in run["rows"]}


def _question_rows(ref: dict, cand: dict | None, flt: str) -> list[dict]:
    key = FILTER_KEYS[flt]
    cand_by = {} if cand is None else {(r["doc_id"], r["prompt_hash"]): r for r in cand["rows"]}
    rows = []
    for r in ref["rows"]:
        row = {"doc_id": r["doc_id"], "prompt_hash": r["prompt_hash"], "target": r["target"],
               "ref_correct": r[f"correct_{key}"], "ref_extracted": r[f"extracted_{key}"],
               "ref_response": r["response"]}
        c = cand_by.get((r["doc_id"], r["prompt_hash"]))
        if c is not None:
            row.update(cand_correct=c[f"correct_{key}"], cand_extracted=c[f"extracted_{key}"],
                       cand_response=c["response"])
        rows.append(row)
    return rows


def _run_meta(run: dict) -> dict:
    return {k: run.get(k) for k in ("task", "dataset", "data_dir", "n", "num_fewshot", "seed", "max_new_tokens",
                                    "seconds", "seconds_per_question", "lm_eval_version", "task_version")}


def gsm8k_gate(ref_fn: GenerateFn, cand_fn: GenerateFn | None = None, *, toggle: str | None = None,
               margin: float = 0.01, alpha: float = 0.05, beta: float = 0.2, min_accuracy: float | None = None,
               smoke: bool = False, progress: Progress | None = None, **run_kwargs: Any) -> GateRun:
    """Run lm-eval's gsm8k on ref_fn (and cand_fn, same questions and few-shot seed) and judge.

    run_kwargs go to k3verify.quality.evals.gsm8k.run_gsm8k (dataset, data_dir, limit, num_fewshot,
    seed, max_new_tokens, cache_dir, ...). With cand_fn each filter's status is the paired
    verdict at `margin` (stats.py: pass, fail or inconclusive); without it the run is a
    measurement that fails only below min_accuracy. smoke marks every result role "smoke".
    """
    from k3verify.quality.evals.gsm8k import run_gsm8k

    if cand_fn is None and toggle is not None:
        raise K3Error(f"toggle {toggle!r} given without a candidate generate_fn; wrap it with toggled()")
    if min_accuracy is not None and not 0.0 <= min_accuracy <= 1.0:
        raise K3Error(f"min_accuracy is a fraction in [0, 1], got {min_accuracy}")
    if not 0.0 <= margin < 1.0:
        raise K3Error(f"margin is a fraction (0.01 = 1 point) in [0, 1), got {margin}")
    if cand_fn is None:
        name, kind, contract = toggle_labels(None)
    elif toggle is None:  # a candidate that is not a registered toggle (a test double, an endpoint)
        name, kind, contract = "candidate", "optimization", "approx (quality gates)"
    else:
        name, kind, contract = toggle_labels(toggle)
    say = progress or (lambda msg: None)
    say("gsm8k: reference")
    ref = run_gsm8k(ref_fn, **run_kwargs)
    cand = None
    if cand_fn is not None:
        say(f"gsm8k: candidate ({name})")
        cand = run_gsm8k(cand_fn, **run_kwargs)
    results, paired = [], {}
    seconds = ref["seconds"] + (cand["seconds"] if cand else 0.0)
    for flt in FILTERS:
        scenario = f"{ref['task']} n={ref['n']} {ref['num_fewshot']}-shot seed={ref['seed']}"
        extra = {"filter": flt, "questions": _question_rows(ref, cand, flt),
                 "gsm8k": {"reference": _run_meta(ref), "candidate": None if cand is None else _run_meta(cand)}}
        if cand is None:
            acc, n = ref["accuracy"][flt], ref["n"]
            k = sum(_outcomes(ref, flt).values())
            extra["accuracy"] = [{"label": "reference", "value": acc, "ci": _ci(k, n, alpha)}]
            # What a paired gate at this n could detect: the MDE at one discordant pair.
            extra.update(mde=paired_mde(n, 1.0 / n, alpha, beta), n_min=n_min_for_margin(margin, alpha, beta))
            need = "more than any n" if extra["n_min"] is None else f"n >= {extra['n_min']}"
            if min_accuracy is None:
                status, reason = "pass", (f"measured accuracy {acc:.4f} ({k}/{n}); no gate: pass --toggle for the "
                                          f"paired test or a minimum accuracy for a floor (a paired gate at n={n} "
                                          f"detects drops of {100 * extra['mde']:.2f} points; a margin of "
                                          f"{margin:g} needs {need})")
            else:
                ok = acc >= min_accuracy
                status = "pass" if ok else "fail"
                reason = f"accuracy {acc:.4f} ({k}/{n}) {'>=' if ok else '<'} floor {min_accuracy:g}"
        else:
            p = paired_test(_outcomes(ref, flt), _outcomes(cand, flt), margin=margin, alpha=alpha, beta=beta)
            paired[flt] = p
            extra["accuracy"] = p.to_dict()
            extra.update(mde=p.mde, n_min=p.n_min)
            status = p.verdict
            reason = (f"{p.verdict_reason}. Paired non-inferiority at margin {margin:g}: d={p.d:+.4f}, one-sided "
                      f"{1 - alpha:.0%} Tango score bounds [{p.lower_bound:+.4f}, {p.upper_bound:+.4f}]; discordant "
                      f"b={p.b} (ref right, cand wrong) c={p.c}, McNemar exact p={p.mcnemar_p:.3g} (two-sided), "
                      f"{p.p_worse:.3g} (worse); accuracy ref {p.acc_ref:.4f} cand {p.acc_cand:.4f}; "
                      f"MDE {100 * p.mde:.2f} points. {p.power_note}")
        if smoke:
            extra["role"] = "smoke"
            reason = f"smoke test (does not count toward the toggle's verdict): {reason}"
        results.append(make_result(name, kind, contract, f"gsm8k/{flt}", status, reason, scenario=scenario,
                                   duration_s=seconds / len(FILTERS), **extra))
    details = {"reference": _run_meta(ref), "candidate": None if cand is None else _run_meta(cand),
               "accuracy": {"reference": ref["accuracy"], "candidate": None if cand is None else cand["accuracy"]},
               "paired": {f: p.to_dict() for f, p in paired.items()}, "margin": margin, "alpha": alpha,
               "beta": beta, "min_accuracy": min_accuracy, "toggle": toggle, "smoke": smoke}
    return GateRun("gsm8k", results, details)


# ---------------------------------------------------------------------------
# Needle
# ---------------------------------------------------------------------------

def choose_fast(max_length_tokens: int, fast: bool) -> tuple[bool, str | None]:
    """(use the fast pair, the reason when it was chosen automatically)."""
    if fast:
        return True, None
    if max_length_tokens > AUTO_FAST_ABOVE_TOKENS:
        return True, (f"lengths above {AUTO_FAST_ABOVE_TOKENS} tokens ({max_length_tokens}) run with "
                      f"{' + '.join(FAST_TOGGLES)}: the reference MLA attention (blocked python loop) and "
                      f"recurrent KDA are impractical that long on a CPU")
    return False, None


def needle_generate(model, tokenizer, prompt: str, max_new_tokens: int = NEEDLE_MAX_NEW_TOKENS,
                    prefill_chunk: int = PREFILL_CHUNK_TOKENS) -> dict:
    """Prefill the prompt in chunks, greedy-decode up to max_new_tokens; text and seconds per phase."""
    import torch

    if prefill_chunk < 1:
        raise K3Error(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise K3Error("needle prompt encodes to no tokens; expected a non-empty prompt")
    new: list[int] = []
    with torch.no_grad():
        t0 = time.perf_counter()
        state = model.new_state()
        for start in range(0, len(ids), prefill_chunk):
            chunk = torch.tensor(ids[start:start + prefill_chunk], dtype=torch.long)
            logits = model.forward(chunk, state)[-1]  # [V] of the chunk's last token
        t1 = time.perf_counter()
        for step in range(max_new_tokens):
            token = int(torch.argmax(logits))
            if token == tokenizer.eos_id:
                break
            new.append(token)
            if step + 1 < max_new_tokens:
                logits = model.forward(torch.tensor([token], dtype=torch.long), state)[-1]
        t2 = time.perf_counter()
    return {"text": tokenizer.decode(new, skip_special=True), "prompt_tokens": len(ids),
            "new_tokens": len(new), "prefill_chunk": prefill_chunk, "prefill_s": t1 - t0, "decode_s": t2 - t1}


def run_needle_cases(model, tokenizer, cases: Sequence, toggle_names: Sequence[str] = (),
                     progress: Progress | None = None) -> list[dict]:
    """Every case on the model with the named toggles applied; one outcome dict per case."""
    from k3verify.quality.evals import needle
    from optimized_stack import toggles as registry

    out = []
    with registry.applied(list(toggle_names)):
        for case in cases:
            gen = needle_generate(model, tokenizer, case.prompt)
            found = needle.score(gen["text"], case)
            out.append({"name": case.name, "length_tokens": case.length_tokens,
                        "requested_tokens": case.requested_tokens, "depth": case.depth, "seed": case.seed,
                        "key": case.key, "answer": case.answer, "found": found, **gen})
            if progress:
                progress(f"{case.name} [{'+'.join(toggle_names) or 'reference'}]: "
                         f"{'found' if found else 'missed'} {gen['text']!r}, prefill {gen['prefill_s']:.1f} s, "
                         f"decode {gen['decode_s']:.1f} s")
    return out


def _cells(outcomes: list[dict]) -> dict[tuple[int, float], list[dict]]:
    cells: dict[tuple[int, float], list[dict]] = defaultdict(list)
    for o in outcomes:
        cells[(o["requested_tokens"], o["depth"])].append(o)
    return cells


def needle_gate(model, tokenizer, cases: Sequence, *, toggle: str | None = None, fast: bool = False,
                min_recall: float | None = None, alpha: float = 0.05,
                progress: Progress | None = None) -> GateRun:
    """Recall per (length, depth) cell for the reference and, with a toggle, the candidate.

    fast (or any case above AUTO_FAST_ABOVE_TOKENS) runs both sides with FAST_TOGGLES on;
    the candidate is then FAST_TOGGLES + toggle. With a toggle, cases are paired by name: a
    cell fails when the candidate misses a needle the reference recalled, is inconclusive
    when the reference recalled none (nothing there could be lost), is skipped when the
    toggle is itself in the fast base (both sides ran it), and passes otherwise.
    """
    if not cases:
        raise K3Error("needle_gate needs at least one case, got none")
    if min_recall is not None and not 0.0 <= min_recall <= 1.0:
        raise K3Error(f"min_recall is a fraction in [0, 1], got {min_recall}")
    name, kind, contract = toggle_labels(toggle)
    fast, auto_reason = choose_fast(max(c.length_tokens for c in cases), fast)
    base = list(FAST_TOGGLES) if fast else []
    choices = [{"choice": f"toggles {'+'.join(FAST_TOGGLES)} on both sides", "reason": auto_reason}] \
        if auto_reason else []
    ref = run_needle_cases(model, tokenizer, cases, base, progress)
    cand = None
    if toggle is not None:
        cand = run_needle_cases(model, tokenizer, cases, list(dict.fromkeys(base + [toggle])), progress)
    ref_cells = _cells(ref)
    cand_cells = _cells(cand) if cand is not None else {}
    results = []
    for (length, depth), rows in ref_cells.items():
        n, k = len(rows), sum(o["found"] for o in rows)
        seconds = sum(o["prefill_s"] + o["decode_s"] for o in rows)
        accuracy = [{"label": "reference", "value": k / n, "ci": _ci(k, n, alpha)}]
        extra: dict[str, Any] = {"length_tokens": length, "depth": depth, "base_toggles": base,
                                 "automatic_choices": choices, "reference_cases": rows}
        if cand is None:
            if min_recall is None:
                status, reason = "pass", f"measured recall {k}/{n}; no gate: pass --toggle or a minimum recall"
            else:
                ok = k / n >= min_recall
                status = "pass" if ok else "fail"
                reason = f"recall {k}/{n} {'>=' if ok else '<'} floor {min_recall:g}"
        else:
            crows = cand_cells[(length, depth)]
            kc = sum(o["found"] for o in crows)
            seconds += sum(o["prefill_s"] + o["decode_s"] for o in crows)
            accuracy.append({"label": "candidate", "value": kc / n, "ci": _ci(kc, n, alpha)})
            extra["candidate_cases"] = crows
            # Per case, not per count: a candidate that recalls a different needle than the
            # reference has still lost one.
            cand_found = {o["name"]: o["found"] for o in crows}
            lost = [o["name"] for o in rows if o["found"] and not cand_found[o["name"]]]
            if lost:
                status = "fail"
                reason = (f"the candidate missed {len(lost)} needle(s) the reference recalled ({', '.join(lost[:3])}"
                          f"{', ...' if len(lost) > 3 else ''}); recall candidate {kc}/{n}, reference {k}/{n}")
            elif k == 0:
                status = "inconclusive"
                reason = (f"inconclusive: the reference recalled 0/{n} needles in this cell, so no candidate could "
                          f"lose recall here (candidate {kc}/{n}); the cell carries no evidence")
            else:
                status = "pass"
                reason = f"the candidate recalled every needle the reference did: candidate {kc}/{n}, reference {k}/{n}"
            if toggle in base and status != "fail":      # a pass here would be the path against itself
                status = "skip"
                reason = (f"{toggle} is in the fast base ({' + '.join(base)}) on both sides, so this cell compares "
                          f"the path with itself and cannot judge it ({reason})")
        extra["accuracy"] = accuracy
        results.append(make_result(name, kind, contract, "needle", status, reason,
                                   scenario=f"L{length}-d{round(depth * 100)}", duration_s=seconds, **extra))
    details = {"fast": fast, "base_toggles": base, "automatic_choices": choices, "toggle": toggle,
               "min_recall": min_recall, "cells": len(results), "cases": len(cases)}
    return GateRun("needle", results, details)


# ---------------------------------------------------------------------------
# KVV
# ---------------------------------------------------------------------------

def _nothing_passed(toggle: str, contract: str, check: str, what: str, results: list[dict],
                    scenario: str) -> list[dict]:
    """[an inconclusive result] when no result passed and none failed: all skipped is no evidence."""
    statuses = [r["status"] for r in results]
    if "pass" in statuses or "fail" in statuses or "error" in statuses:
        return []
    reasons = "; ".join(dict.fromkeys(r["reason"] for r in results))[:300]
    return [make_result(toggle, "optimization", contract, check, "inconclusive",
                        f"inconclusive: none of the {len(results)} {what} passed, every one was skipped ({reasons})",
                        scenario=scenario)]


def kvv_gate(kvv_out: dict, seconds: float = 0.0) -> GateRun:
    """run_kvv's output -> one result per contract check (pass / fail / skip with its reason)."""
    checks = kvv_out["checks"]
    if not checks:
        raise K3Error("run_kvv returned no checks; expected at least one")
    each = seconds / len(checks)
    scenario = f"{kvv_out['model']} @ {kvv_out['endpoint']}"
    results = [make_result("endpoint", "optimization", "KVV API contract", f"kvv/{c['name']}", c["status"],
                           c["reason"] or c["status"], scenario=scenario, duration_s=each) for c in checks]
    results += _nothing_passed("endpoint", "KVV API contract", "kvv/any-check", "KVV contract checks", results,
                               scenario)
    return GateRun("kvv", results, {k: kvv_out[k] for k in ("endpoint", "model", "summary", "passed")})


def kvv_import_gate(imported: dict) -> GateRun:
    """import_kvv_results's output -> one result per benchmark held against its vendor range."""
    results = [make_result("kvv-import", "optimization", f"vendor range [{b['low']:g}, {b['high']:g}]",
                           f"kvv/{b['name']}", b["status"], b["reason"], scenario=imported["source"],
                           score=b["score"], low=b["low"], high=b["high"])
               for b in imported["benchmarks"]]
    results += _nothing_passed("kvv-import", "vendor ranges", "kvv/any-benchmark", "imported benchmark scores",
                               results, imported["source"])
    return GateRun("kvv-import", results, {k: imported[k] for k in ("source", "ranges_version", "summary", "passed")})
