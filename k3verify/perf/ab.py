"""The one statistic behind every A/B speed ratio in k3verify (bench, the GPU run, the TP
section, the engine benchmark).

Runs are interleaved in one process (reference, candidate, then the other order next repeat,
to cancel drift), after a warm-up pair that is not timed. The speedup is the geometric mean of
the per-pair ratios time_ref / time_cand, with a 95% t-interval on the log ratios.

Why the geometric mean of pair ratios, not the median (engine/bench.py used the median, the
other three the geometric mean): a ratio lives on a log scale (2x faster and 2x slower must
average to 1), pairing cancels the machine's drift between the two runs of a pair, and the
log-ratio mean comes with an interval, which is what lets a report say whether a speedup is
distinguishable from 1 at all. With the 3-5 pairs a CPU run affords, a median has no usable
interval; an outlier pair widens the interval instead of hiding in the middle, which is the
honest signal on a shared machine. Medians are still reported for the tokens/s columns.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

# two-sided 95% t quantiles by degrees of freedom (1..30); normal beyond
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042]


@dataclass
class ABResult:
    label_a: str
    label_b: str
    times_a: list[float]
    times_b: list[float]
    tokens: int
    ratio: float = field(init=False)          # time_a / time_b: > 1 means b is faster
    ci_low: float = field(init=False)
    ci_high: float = field(init=False)

    def __post_init__(self) -> None:
        logs = [math.log(a / b) for a, b in zip(self.times_a, self.times_b)]
        mean = statistics.fmean(logs)
        n = len(logs)
        half = 0.0 if n < 2 else (_T95[min(n - 2, 29)] if n - 1 <= 30 else 1.96) * statistics.stdev(logs) / math.sqrt(n)
        self.ratio, self.ci_low, self.ci_high = math.exp(mean), math.exp(mean - half), math.exp(mean + half)

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.label_a, "b": self.label_b, "ratio": self.ratio, "ci95": [self.ci_low, self.ci_high],
                "median_s_a": statistics.median(self.times_a), "median_s_b": statistics.median(self.times_b),
                "tokens_per_s_a": self.tokens / statistics.median(self.times_a),
                "tokens_per_s_b": self.tokens / statistics.median(self.times_b),
                "repeats": len(self.times_a), "tokens": self.tokens}


def interleaved(run_a: Callable[[], Any], run_b: Callable[[], Any], *, repeats: int, tokens: int,
                labels: tuple[str, str] = ("reference", "candidate"), self_timed: bool = False) -> ABResult:
    """self_timed: each run returns the seconds of the part it times itself (e.g. the decode steps
    after an engine's set-up), in place of the whole call's."""
    run_a(), run_b()                                        # warm-up, not timed
    ta, tb = [], []
    for i in range(repeats):
        order = (("a", run_a), ("b", run_b)) if i % 2 == 0 else (("b", run_b), ("a", run_a))
        for which, fn in order:
            t0 = time.perf_counter()
            got = fn()
            (ta if which == "a" else tb).append(float(got) if self_timed else time.perf_counter() - t0)
    return ABResult(labels[0], labels[1], ta, tb, tokens)


def median_ci(samples: list[float], alpha: float = 0.05) -> dict[str, Any]:
    """Distribution-free interval for the median of `samples`: [x_(j), x_(n+1-j)] of the sorted
    samples, with j the largest rank whose coverage 1 - 2 P(Bin(n, 1/2) < j) is still >= 1 - alpha.

    Order statistics, not a bootstrap: at the 5-8 repeats a speed run affords, a bootstrap of the
    median resamples the same few values and claims coverage it does not have, while this
    interval's coverage is exact for any continuous distribution. Below n = 6 no pair of order
    statistics reaches 95% (n = 5: [min, max] covers 93.75%); the widest one is returned and its
    true coverage is stated, never rounded up to the nominal level.
    """
    from k3verify.quality.stats import binom_cdf
    n = len(samples)
    if n < 2:
        raise ValueError(f"median_ci needs at least 2 samples, got {n}")
    xs = sorted(samples)
    j, coverage = 1, 1.0 - 2.0 * binom_cdf(0, n, 0.5)        # j = 1: [min, max]
    for rank in range(2, n // 2 + 1):
        cov = 1.0 - 2.0 * binom_cdf(rank - 1, n, 0.5)
        if cov < 1.0 - alpha:
            break
        j, coverage = rank, cov
    return {"median": statistics.median(xs), "low": xs[j - 1], "high": xs[n - j], "coverage": coverage,
            "n": n, "method": "order-statistic"}
