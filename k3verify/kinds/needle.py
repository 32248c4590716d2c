"""Check kind `needle`: RULER-style needle recall per (length, depth) cell on the embedded
model (quality/needle_gate.py); with a toggle the candidate must not recall less than the
reference on any cell.

Each cell's prompt (quality/evals/needle.py, lengths in byte-tokenizer tokens) is prefilled,
then up to 12 tokens are greedy-decoded and the 7-digit value is matched exactly. `fast` runs
both sides with kda_chunked + mla_sdpa; above 16K tokens that choice is made automatically and
recorded with its reason. `prefill_chunk` (tokens per prefill forward, both sides) defaults to the
device's (quality/needle_gate.py prefill_chunk_for: 512 on the CPU, 4096 on CUDA). One unit per
toggle, or one reference unit when the check names none.
"""
from __future__ import annotations

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
    gate = needle_gate(ctx.model, load_tokenizer(ctx.model_arg), cases(o), toggle=unit.toggle, fast=o["fast"],
                       min_recall=o["min_recall"], progress=ctx.progress.done, prefill_chunk=o["prefill_chunk"])
    return [r.tag(gate=NAME) for r in gate.results]
