"""The GSM8K gate: lm-eval's gsm8k task on the reference and the candidate, joined per
question (doc_id + lm-eval's prompt_hash, so a changed prompt cannot be paired by accident);
one result per lm-eval filter with the three-way verdict of stats.paired_test (pass / fail /
inconclusive: Tango's score bound, the exact McNemar test, the n the margin needs), never a raw
score compare. Every result carries the MDE and the n the margin needs.
"""
from __future__ import annotations

from typing import Any

from k3verify.quality.gate_run import GateRun, GenerateFn, Progress, ci
from k3verify.quality.stats import n_min_for_margin, paired_mde, paired_test
from k3verify.verdict.result import Result, Subject
from optimized_stack.errors import K3Error

FILTERS = ("strict-match", "flexible-extract")
FILTER_KEYS = {"strict-match": "strict", "flexible-extract": "flexible"}


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
    verdict at `margin` (quality/stats.py: pass, fail or inconclusive); without it the run is a
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
        subject = Subject.of_optional(None)
    elif toggle is None:  # a candidate that is not a registered toggle (a test double, an endpoint)
        subject = Subject("candidate", contract="approx (quality gates)")
    else:
        subject = Subject.of(toggle)  # unknown names: K3Error with a did-you-mean
    say = progress or (lambda msg: None)
    # The candidate answers first: under `k3verify all` another process may be computing the
    # reference's answers for the run (quality/shared_answers.py), and they have this process's
    # candidate time to land. Each side's `seconds` is timed inside run_gsm8k, so either order
    # reports them the same way.
    cand = None
    if cand_fn is not None:
        say(f"gsm8k: candidate ({subject.toggle})")
        cand = run_gsm8k(cand_fn, **run_kwargs)
    say("gsm8k: reference")
    ref = run_gsm8k(ref_fn, **run_kwargs)
    results, paired = [], {}
    seconds = ref["seconds"] + (cand["seconds"] if cand else 0.0)
    for flt in FILTERS:
        scenario = f"{ref['task']} n={ref['n']} {ref['num_fewshot']}-shot seed={ref['seed']}"
        extra = {"filter": flt, "questions": _question_rows(ref, cand, flt),
                 "gsm8k": {"reference": _run_meta(ref), "candidate": None if cand is None else _run_meta(cand)}}
        if cand is None:
            acc, n = ref["accuracy"][flt], ref["n"]
            k = sum(_outcomes(ref, flt).values())
            extra["accuracy"] = [{"label": "reference", "value": acc, "ci": ci(k, n, alpha)}]
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
        results.append(Result.make(status, subject, f"gsm8k/{flt}", reason, scenario=scenario,
                                   duration_s=seconds / len(FILTERS), **extra))
    details = {"reference": _run_meta(ref), "candidate": None if cand is None else _run_meta(cand),
               "accuracy": {"reference": ref["accuracy"], "candidate": None if cand is None else cand["accuracy"]},
               "paired": {f: p.to_dict() for f, p in paired.items()}, "margin": margin, "alpha": alpha,
               "beta": beta, "min_accuracy": min_accuracy, "toggle": toggle, "smoke": smoke}
    return GateRun("gsm8k", results, details)
