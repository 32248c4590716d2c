"""What every quality gate shares: the GateRun it returns, toggles applied around a
generate function, and the interval the views draw.

A gate runs the reference path and, given a candidate, the same inputs again with the toggle
applied, and turns the outcome into report results (verdict/result.py) with one verdict each.
Without a candidate a gate is a measurement: its results pass, say so in their reason, and
fail only below an explicit floor (min_accuracy / min_recall). A smoke run (gsm8k smoke=True)
keeps its statistical status but is marked role "smoke": its pass or inconclusive never counts
as the gate holding; its fail or error still fails (report/schema.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from k3verify.quality.stats import wilson_interval
from k3verify.verdict.result import Result
from optimized_stack.errors import K3Error

GenerateFn = Callable[[list[str], int, list[str]], list[str]]
Progress = Callable[[str], None]


@dataclass
class GateRun:
    """What a gate produced: schema-valid report results and the raw evidence behind them."""

    gate: str
    results: list[Result]
    details: dict

    def __post_init__(self) -> None:
        if not self.results:
            raise K3Error(f"gate {self.gate!r} produced no results; expected at least one")

    @property
    def passed(self) -> bool:
        """Every result passed or was skipped, and at least one passed (all skipped is no evidence)."""
        statuses = [r.status for r in self.results]
        return "pass" in statuses and all(s in ("pass", "skip") for s in statuses)


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


def ci(k: int, n: int, alpha: float) -> list[float]:
    lo, hi = wilson_interval(k, n, 2 * alpha)  # two-sided 1 - 2*alpha, as the HTML renderer draws
    return [lo, hi]
