"""Capture-level comparison of two vLLM runs: full-vocabulary logprobs, every step, per request.

A capture (serving/backends/vllm_worker.py) is {"requests": [{"prompt_ids", "tokens",
"logprobs": float32 [steps, V]}], "settings", "vllm_version", ...}. Rows after the token
streams part are conditioned on different histories, so only steps up to and including the
first token difference are compared, each through the one comparator (compare/tensors.py
compare_logits).

Non-finite logprobs fail the comparison with their location, on either side, even where
both sides hold the same bits. NaN always fails: vLLM passes a NaN logit through
log_softmax, and the worker marks an id vLLM returned no logprob for with NaN (we asked
for the full vocabulary). +inf always fails: a log-probability is <= 0. -inf is a real
value only after logits processors: vLLM 0.32's sampler computes `raw_logprobs` (the
reference default) as log_softmax of the model's logits before the allowed-token,
bad-words and min-tokens masks, so finite logits give finite logprobs and an -inf there is
the model's own; in the `processed_logprobs` / `processed_logits` modes masked tokens are
-inf by design, so there -inf is accepted (the bitwise comparison still requires the same
mask on both sides), as long as every row keeps a finite entry.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3verify.capture.nonfinite import SIDES, NonFinite, first_nonfinite, side_text
from k3verify.compare.tensors import compare_logits, first_divergence


@dataclass
class PairSummary:
    """One (reference, candidate) comparison over all requests."""

    label: str
    n_requests: int
    n_steps_compared: int
    bitwise_equal: bool  # every compared logprob bit-identical and every token stream identical
    n_mismatched: int
    max_ulp: int | None
    max_abs: float | None
    first_divergent: tuple[int, int] | None  # (request, step) of the first differing logprob row
    tokens_part: tuple[int, int] | None  # (request, step) where the first token streams part
    argmax_flips: int
    kl_max: float | None
    nonfinite: dict | None = None  # first non-finite logprob: {"reason", "sides", "request", "step", ...}
    passed: bool = False  # bitwise_equal and nothing non-finite: the exact contract held


# logprobs modes whose values come after vLLM's logits processors (masked tokens are -inf)
MASKED_MODES = ("processed_logprobs", "processed_logits")


def first_nonfinite_logprob(capture: dict) -> tuple[int, int, object] | None:
    """(request, step, NonFinite) of the first logprob no check can accept: NaN, +inf, -inf
    unless the capture's logprobs mode applies masks, or a row with nothing finite in it."""
    mode = capture.get("settings", {}).get("logprobs_mode", "raw_logprobs")
    for i, r in enumerate(capture["requests"]):
        rows = r["logprobs"]                                             # [steps, V]
        nf = first_nonfinite(rows, allow_neg_inf=mode in MASKED_MODES)
        if nf is None and mode in MASKED_MODES and rows.numel():
            empty = (~torch.isfinite(rows).any(dim=-1)).nonzero()       # rows with every entry masked
            if empty.numel():
                step = int(empty[0, 0])
                nf = NonFinite("-inf", step * rows.shape[1], (step, 0), rows.shape[1])
        if nf is not None:
            return i, nf.index_tuple[0], nf
    return None


def _nonfinite(ref: dict, cand: dict) -> dict | None:
    hits = [(loc[0], loc[1], side, loc[2]) for side, cap in zip(SIDES, (ref, cand))
            if (loc := first_nonfinite_logprob(cap)) is not None]
    if not hits:
        return None
    first = min(h[:2] for h in hits)
    sides = tuple(h[2] for h in hits if h[:2] == first)
    nf = next(h[3] for h in hits if h[:2] == first)
    reason = (f"non-finite ({nf.kind}) in logprobs of request {first[0]} at step {first[1]}, vocab index "
              f"{nf.index_tuple[1]} {side_text(sides)}")
    return {"reason": reason, "sides": list(sides), "request": first[0], "step": first[1],
            "vocab_index": nf.index_tuple[1], "nonfinite": nf.kind, "count": nf.count}


def compare_logprobs(ref: dict, cand: dict, label: str = "vllm") -> tuple[PairSummary, list]:
    """Per request, compare the logprob rows both runs computed from the same token prefix.

    Rows after the token streams part are conditioned on different histories, so only
    steps up to and including the first token difference are compared. Non-finite
    logprobs (see the module docstring) fail the pair wherever they are, on either side.
    """
    if len(ref["requests"]) != len(cand["requests"]):
        raise ValueError(f"captures hold {len(ref['requests'])} and {len(cand['requests'])} requests")
    findings, first_row, first_part = [], None, None
    for i, (r, c) in enumerate(zip(ref["requests"], cand["requests"])):
        if r["prompt_ids"] != c["prompt_ids"]:
            raise ValueError(f"request {i}: the captures ran different prompts")
        part = first_divergence(r["tokens"], c["tokens"])
        n = min(len(r["tokens"]), len(c["tokens"])) if part is None else part + 1
        n = min(n, r["logprobs"].shape[0], c["logprobs"].shape[0])
        f = compare_logits(r["logprobs"][:n], c["logprobs"][:n], label=f"{label}/req{i}")
        findings.append((i, part, f))
        if part is not None and first_part is None:
            first_part = (i, part)
        if not f.equal and first_row is None:
            first_row = (i, f.first_index_tuple[0] if f.first_index_tuple else 0)
    ulps = [f.max_ulp for _, _, f in findings if f.max_ulp is not None]
    abss = [f.max_abs for _, _, f in findings if f.max_abs is not None]
    kls = [f.kl_max for _, _, f in findings if f.kl_max is not None]
    summary = PairSummary(
        label=label,
        n_requests=len(findings),
        n_steps_compared=sum(f.n_rows for _, _, f in findings),
        bitwise_equal=all(f.equal for _, _, f in findings) and first_part is None,
        n_mismatched=sum(f.n_bit_different for _, _, f in findings),
        max_ulp=max(ulps) if ulps else None,
        max_abs=max(abss) if abss else None,
        first_divergent=first_row,
        tokens_part=first_part,
        argmax_flips=sum(f.argmax_flips for _, _, f in findings),
        kl_max=max(kls) if kls else None,
        nonfinite=_nonfinite(ref, cand),
    )
    summary.passed = summary.bitwise_equal and summary.nonfinite is None
    return summary, findings
