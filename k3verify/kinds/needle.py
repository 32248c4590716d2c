"""Check kind `needle`: RULER-style needle recall per (length, depth) cell on the embedded
model (quality/needle_gate.py); with a toggle the candidate must not recall less than the
reference on any cell.

Each cell's prompt (quality/evals/needle.py, lengths in byte-tokenizer tokens) is prefilled,
then up to 12 tokens are greedy-decoded and the 7-digit value is matched exactly. `fast` runs
both sides with kda_chunked + mla_sdpa; above 16K tokens that choice is made automatically and
recorded with its reason. `prefill_chunk` (tokens per prefill forward, both sides) defaults to the
device's (quality/needle_gate.py prefill_chunk_for: 512 on the CPU, 4096 on CUDA). One unit per
toggle, or one reference unit when the check names none. The reference side's answers are computed
once per run and shared by its processes (quality/shared_answers.py), as gsm8k's are: on the H200
release run of 2026-12-02 every needle unit recomputed the same reference, ~125 s of its ~270 s.
"""
from __future__ import annotations

import json

from k3verify.quality.needle_gate import NEEDLE_MAX_NEW_TOKENS
from k3verify.verdict.result import Result, Subject

from .base import (CheckSpec, Context, OptionError, Unit, check_fraction, check_int, check_toggles, device_skip, is_int,
                   is_number, gate_units)

NAME = "needle"
OPTIONS = {"toggles": None, "lengths": [1024], "depths": [0.5], "seed": 0, "samples": 1, "distractors": 0,
           "fast": False, "min_recall": None, "prefill_chunk": None}
MAX_LENGTH_TOKENS = 1_048_576
SHORT_TOKENS = 4096    # below this a length's cases are built while validating: a case has a minimum
                       # (header, question, needles: ~400 tokens); above it no case is that short


def validate(o: dict) -> None:
    check_toggles(o["toggles"])
    lengths, depths = o["lengths"], o["depths"]
    if not (isinstance(depths, list) and depths and all(is_number(x) and 0 <= x <= 1 for x in depths)):
        raise OptionError("depths", f"must be a non-empty list of fractions in [0, 1], got {depths!r}")
    if not (isinstance(lengths, list) and lengths and all(is_int(x) and 0 < x <= MAX_LENGTH_TOKENS for x in lengths)):
        raise OptionError("lengths", f"must be a non-empty list of token counts in [1, {MAX_LENGTH_TOKENS}], "
                                     f"got {lengths!r}")
    check_int(o["seed"], "seed", 0)
    check_int(o["samples"], "samples", 1)
    check_int(o["distractors"], "distractors", 0)
    check_fraction(o["min_recall"], "min_recall")
    if o["prefill_chunk"] is not None:
        check_int(o["prefill_chunk"], "prefill_chunk", 1)
    if not isinstance(o["fast"], bool):
        raise OptionError("fast", f"must be true or false, got {o['fast']!r}")
    short = [x for x in lengths if x < SHORT_TOKENS]
    if short:
        cases({**o, "lengths": short})


def cases(o: dict) -> list:
    """Every case of the check, seeds seed..seed+samples-1 (a length too short for its needles is refused)."""
    from k3verify.quality.evals import needle
    from optimized_stack.errors import K3Error
    try:
        return [c for s in range(o["seed"], o["seed"] + o["samples"])
                for c in needle.grid(o["lengths"], o["depths"], seed=s, n_distractors=o["distractors"])]
    except K3Error as exc:
        raise OptionError("lengths", f"{o['lengths']} with {o['distractors']} distractors: {exc}") from None


def plan(spec: CheckSpec) -> list[Unit]:
    return gate_units(spec)


def case_s(length_tokens: int) -> float:
    """Prior seconds of one case (prefill 1.5 ms/token growing with length: NOTES.md)."""
    return 0.0015 * length_tokens * (1 + length_tokens / 65536) + 1.0


def cost_s(unit: Unit) -> float:
    o = unit.options
    sides = 2 if unit.toggle else 1
    return sides * o["samples"] * len(o["depths"]) * sum(case_s(n) for n in o["lengths"])


def run(unit: Unit, ctx: Context) -> list[Result]:
    from k3verify.quality.needle_gate import needle_gate
    from optimized_stack.tokenizer import load_tokenizer

    skip = device_skip(unit.toggle, ctx.device)
    if skip:
        return [Result.skipped(Subject.of(unit.toggle), NAME, skip).tag(gate=NAME)]
    o = unit.options
    tokenizer = load_tokenizer(ctx.model_arg)
    shared: list = []

    def reference(base: list[str], chunk: int):
        """The reference side, answered once per run: every toggle's needle unit asks the same
        prompts of the same reference (quality/shared_answers.py, as gsm8k's reference side)."""
        answers = remembered(ctx, tokenizer, base, chunk)
        shared.append(answers)
        return lambda prompt: json.loads(answers([prompt], NEEDLE_MAX_NEW_TOKENS, [])[0])
    gate = needle_gate(ctx.model, tokenizer, cases(o), toggle=unit.toggle, fast=o["fast"],
                       min_recall=o["min_recall"], progress=ctx.progress.done, prefill_chunk=o["prefill_chunk"],
                       reference=reference)
    evidence = shared[0].evidence() if shared else None
    return [r.tag(gate=NAME, reference_source=evidence and evidence["source"], reference_answers=evidence)
            for r in gate.results]


def remembered(ctx: Context, tokenizer, base: list[str], chunk: int):
    """The reference's answers (needle_generate's dict as JSON text, one per prompt) from this
    process's memory, the run directory or computed here, keyed by what decides them: the
    checkpoint, the numerics environment, the base toggles and the prefill chunk."""
    from k3verify.quality.needle_gate import needle_generate
    from k3verify.quality.shared_answers import for_context
    from optimized_stack import toggles as registry

    def generate(prompts: list[str], max_new_tokens: int, stop: list[str]) -> list[str]:
        with registry.applied(list(base)):
            return [json.dumps(needle_generate(ctx.model, tokenizer, p, max_new_tokens, prefill_chunk=chunk))
                    for p in prompts]
    return for_context(generate, ctx, NAME, base_toggles=list(base), prefill_chunk=chunk)
