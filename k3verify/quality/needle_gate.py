"""The needle gate: one result per (length, depth) cell, paired per case: the candidate must
recall every needle the reference recalled; a cell where the reference recalled none is
inconclusive (no candidate could lose recall there).
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable, Sequence

from k3verify.quality.gate_run import GateRun, Progress, ci
from k3verify.verdict.result import Result, Subject
from optimized_stack.errors import K3Error

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
# On CUDA the reference MLA is the blocked Triton kernel (kernels/mla/attention.py), which holds no
# scores, so the chunk only bounds the SDPA candidates' math fallback ([H, 4096, T] at 108K: a few
# GB on a 141 GB H200). Why larger: a prefill forward is host-bound there (~2,600 launches on
# k3-mini whatever its length), and the 108K cells took 211 forwards of 512 tokens, ~40 s a side of
# a needle unit's ~270 s in the H200 release run of 2026-12-02 (golden/reports/gpu-2026-12-02-h200-release-4/).
# 4096 is a multiple of the 64-token KDA grid, so every cut stays on it.
PREFILL_CHUNK_TOKENS_CUDA = 4096


def prefill_chunk_for(device: str) -> int:
    """The default prefill chunk on `device` (module constants: memory on the CPU, launches on CUDA)."""
    return PREFILL_CHUNK_TOKENS_CUDA if device == "cuda" else PREFILL_CHUNK_TOKENS


def choose_fast(max_length_tokens: int, fast: bool, device: str = "cpu") -> tuple[bool, str | None]:
    """(use the fast pair, the reason when it was chosen automatically).

    Only on the CPU: on CUDA the reference already runs KDA through fla's chunked kernel on the
    64-token grid and MLA through its fixed-split kernel (design.md, "One reference per device"),
    so swapping in kda_chunked (a Python loop over 64-token chunks) would make both sides slower
    and take kda_chunked and mla_sdpa out of their own needle verdicts."""
    if fast:
        return True, None
    if device == "cpu" and max_length_tokens > AUTO_FAST_ABOVE_TOKENS:
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
                     progress: Progress | None = None, prefill_chunk: int = PREFILL_CHUNK_TOKENS,
                     generate: Callable[[str], dict] | None = None) -> list[dict]:
    """Every case on the model with the named toggles applied; one outcome dict per case.
    `generate` (prompt -> needle_generate's dict) answers in its place: the reference side shared
    across a run's processes (kinds/needle.py); it applies its own toggles."""
    from k3verify.quality.evals import needle
    from optimized_stack import toggles as registry

    out = []
    with registry.applied([] if generate is not None else list(toggle_names)):
        for case in cases:
            gen = (generate(case.prompt) if generate is not None
                   else needle_generate(model, tokenizer, case.prompt, prefill_chunk=prefill_chunk))
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
                progress: Progress | None = None, prefill_chunk: int | None = None,
                reference: Callable[[list[str], int], Callable[[str], dict]] | None = None) -> GateRun:
    """Recall per (length, depth) cell for the reference and, with a toggle, the candidate.

    fast (or any case above AUTO_FAST_ABOVE_TOKENS) runs both sides with FAST_TOGGLES on;
    the candidate is then FAST_TOGGLES + toggle. With a toggle, cases are paired by name: a
    cell fails when the candidate misses a needle the reference recalled, is inconclusive
    when the reference recalled none (nothing there could be lost), is skipped when the
    toggle is itself in the fast base (both sides ran it), and passes otherwise.
    Both sides prefill in chunks of `prefill_chunk` tokens (None: prefill_chunk_for the device).
    `reference(base, chunk)` gives the reference side's prompt -> answer function (kinds/needle.py
    shares it across a run's processes); None answers here. The candidate always answers here.
    """
    if not cases:
        raise K3Error("needle_gate needs at least one case, got none")
    if min_recall is not None and not 0.0 <= min_recall <= 1.0:
        raise K3Error(f"min_recall is a fraction in [0, 1], got {min_recall}")
    subject = Subject.of_optional(toggle)
    device = next(model.parameters()).device.type if hasattr(model, "parameters") else "cpu"
    fast, auto_reason = choose_fast(max(c.length_tokens for c in cases), fast, device)
    chunk = prefill_chunk if prefill_chunk is not None else prefill_chunk_for(device)
    base = list(FAST_TOGGLES) if fast else []
    choices = [{"choice": f"toggles {'+'.join(FAST_TOGGLES)} on both sides", "reason": auto_reason}] \
        if auto_reason else []
    ref = run_needle_cases(model, tokenizer, cases, base, progress, prefill_chunk=chunk,
                           generate=reference(base, chunk) if reference is not None else None)
    cand = None
    if toggle is not None:
        cand = run_needle_cases(model, tokenizer, cases, list(dict.fromkeys(base + [toggle])), progress,
                                prefill_chunk=chunk)
    ref_cells = _cells(ref)
    cand_cells = _cells(cand) if cand is not None else {}
    results = []
    for (length, depth), rows in ref_cells.items():
        n, k = len(rows), sum(o["found"] for o in rows)
        seconds = sum(o["prefill_s"] + o["decode_s"] for o in rows)
        accuracy = [{"label": "reference", "value": k / n, "ci": ci(k, n, alpha)}]
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
            accuracy.append({"label": "candidate", "value": kc / n, "ci": ci(kc, n, alpha)})
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
        results.append(Result.make(status, subject, "needle", reason,
                                   scenario=f"L{length}-d{round(depth * 100)}", duration_s=seconds, **extra))
    details = {"fast": fast, "base_toggles": base, "automatic_choices": choices, "toggle": toggle, "prefill_chunk": chunk,
               "min_recall": min_recall, "cells": len(results), "cases": len(cases)}
    return GateRun("needle", results, details)
