"""Paired statistics for accuracy gates: the same questions, answered by reference and candidate.

Accuracies are fractions in [0, 1]; `margin` is on the same scale (0.01 = one
point); `alpha` is one-sided. With n questions, b = questions the reference got
right and the candidate wrong, c = the reverse:

    d = (c - b) / n                                paired accuracy difference (cand - ref)

Bounds: Tango's asymptotic score interval for a paired difference of proportions
(T. Tango, "Equivalence test and confidence interval for the difference in
proportions for the paired-sample design", Stat Med 1998;17:891-908). With p_b, p_c
the probabilities of the two discordant cells and delta = p_c - p_b, the score
statistic for H0: delta = delta0 is

    Z(delta0) = (c - b - n delta0) / sqrt(n (2 q + delta0 (1 - delta0)))

where q is the maximum-likelihood p_b under H0, the root in [0, 1] of
2n q^2 + B q + C = 0 with B = -b - c + (2n + b - c) delta0, C = -b delta0 (1 - delta0).
lower_bound / upper_bound solve Z = +z / -z with z = z_{1-alpha}: each is a one-sided
1 - alpha bound, together the two-sided 1 - 2 alpha interval. Z(0) is McNemar's
(c - b) / sqrt(b + c); at b = c = 0 the lower bound is -z^2 / (n + z^2), minus the
Wilson upper bound for "0 of n pairs discordant": every discordance that n questions
may have missed could be a loss. The Wald bound d - z*se this replaces is 0 there
for every n, which passed two questions as proof of non-inferiority.

Verdict, the first rule that applies:
1. fail: the candidate is shown worse: the exact one-sided McNemar test
   p_worse = BinomCDF(c; b + c, 1/2) <= alpha, or the whole interval lies beyond the
   margin (upper_bound < -margin). A drop the data show fails even inside the margin:
   the margin bounds what the data cannot rule out, it does not license a shown drop.
2. inconclusive, n too small: n < n_min(margin, alpha, beta), the smallest n at which
   (a) zero discordance passes, -z^2/(n + z^2) > -margin, i.e. n > z^2 (1 - margin) / margin,
   and (b) the MDE at one discordant pair, (z_{1-alpha} + z_{1-beta}) / n, is within the
   margin. No n resolves margin 0. Such an n never passes, whatever it shows.
3. inconclusive, vacuous: ref_correct <= margin * n. The candidate cannot lose more than
   the reference got right, so "not worse by more than the margin" holds for any candidate.
4. pass: lower_bound > -margin (non-inferior).
5. inconclusive: the bound does not exclude a drop of the margin and no drop is shown.
   n_needed = max(n_min, ceil((z_{1-alpha} + z_{1-beta})^2 psi / margin^2)), psi = (b + c) / n,
   is the usual paired sample size (Connor, Biometrics 1987;43:207-211) for power 1 - beta
   when the true difference is 0 at this discordance: where the MDE below meets the margin.

Minimum detectable effect: under H0 the per-question difference has variance close
to the discordance rate psi, so a true drop of

    mde = (z_{1-alpha} + z_{1-beta}) * sqrt(psi / n)

is detected with power 1 - beta; psi is floored at 1/n (one discordant pair) so perfect
agreement still states a finite figure. For comparison, the unpaired one-sided z-test
TensorRT-LLM uses treats the runs as independent with sigma = 50 points: threshold =
ref - z_{1-alpha} sqrt(2 sigma^2 / n) (3.20 points for n = 1319) and mde = (z_{1-alpha} +
z_{1-beta}) sqrt(2 sigma^2 / n) (4.84 points).

Distributions (normal quantile and CDF, binomial CDF) and the root finder are scipy's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Hashable, Mapping

from scipy import optimize
from scipy.stats import binom, norm

from k3verify.errors import UsageError

# Sigma of a 0/1 score on the 0-100 scale at 50% accuracy, the worst case TensorRT-LLM assumes.
TRTLLM_SIGMA_POINTS = 50.0
METHOD = "tango-score"
VERDICTS = ("pass", "fail", "inconclusive")


def normal_cdf(x: float) -> float:
    """Phi(x), the standard normal CDF."""
    return float(norm.cdf(x))


def normal_ppf(p: float) -> float:
    """Phi^{-1}(p) for 0 < p < 1."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"normal_ppf needs 0 < p < 1, got {p}")
    return float(norm.ppf(p))


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    if n < 0 or not 0.0 <= p <= 1.0:
        raise ValueError(f"binom_cdf needs n >= 0 and 0 <= p <= 1, got n={n}, p={p}")
    return float(binom.cdf(k, n, p))


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    if b + c == 0:
        return 1.0
    return min(1.0, 2.0 * binom_cdf(min(b, c), b + c, 0.5))


def mcnemar_p_worse(b: int, c: int) -> float:
    """One-sided exact McNemar p-value for "the candidate is worse": P(X <= c), X ~ Bin(b + c, 1/2)."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    return 1.0 if b + c == 0 else binom_cdf(c, b + c, 0.5)


def wilson_interval(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Two-sided 1 - alpha Wilson score interval for k successes out of n."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"wilson_interval needs n > 0 and 0 <= k <= n, got k={k}, n={n}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    z = normal_ppf(1.0 - alpha / 2.0)
    p = k / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z * z / (4 * n * n))
    # The bounds at k = 0 and k = n are exactly 0 and 1; rounding would leave ~1e-17.
    lo = 0.0 if k == 0 else max(0.0, center - half)
    hi = 1.0 if k == n else min(1.0, center + half)
    return lo, hi


# ---------------------------------------------------------------- Tango's score interval


def _tango_q(n: int, b: int, c: int, delta: float) -> float:
    """Constrained MLE of p_b (reference right, candidate wrong) given p_c - p_b = delta."""
    a2 = 2.0 * n
    bq = -b - c + (2.0 * n + b - c) * delta
    cq = -b * delta * (1.0 - delta)
    root = math.sqrt(max(0.0, bq * bq - 4.0 * a2 * cq))
    # The cancellation-free form of the larger root when bq > 0 (-bq + root would lose digits).
    q = (-bq + root) / (2.0 * a2) if bq <= 0 else 2.0 * cq / (-bq - root)
    return min(max(q, 0.0, -delta), (1.0 - delta) / 2.0)  # p_b, p_c = p_b + delta, 1 - 2p_b - delta in [0, 1]


def tango_z(n: int, b: int, c: int, delta: float) -> float:
    """Tango's score statistic for H0: p_c - p_b = delta (decreasing in delta)."""
    num = c - b - n * delta
    if num == 0:
        return 0.0
    var = n * (2.0 * _tango_q(n, b, c, delta) + delta * (1.0 - delta))
    return num / math.sqrt(var) if var > 0 else math.copysign(math.inf, num)


def tango_bounds(n: int, b: int, c: int, alpha: float = 0.05) -> tuple[float, float]:
    """(lower, upper): one-sided 1 - alpha score bounds on p_c - p_b; together a 1 - 2 alpha interval."""
    if n <= 0 or b < 0 or c < 0 or b + c > n:
        raise ValueError(f"tango_bounds needs n > 0 and 0 <= b, c with b + c <= n, got n={n}, b={b}, c={c}")
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    z = normal_ppf(1.0 - alpha)
    d = (c - b) / n
    edge = 1e-12  # Z is unbounded at delta = +-1, where one discordant cell holds every pair

    def f(delta: float) -> float:
        return tango_z(n, b, c, delta) - z

    def g(delta: float) -> float:
        return tango_z(n, b, c, delta) + z

    lower = -1.0 if d <= -1.0 or f(-1.0 + edge) <= 0 else optimize.brentq(f, -1.0 + edge, d, xtol=1e-14)
    upper = 1.0 if d >= 1.0 or g(1.0 - edge) >= 0 else optimize.brentq(g, d, 1.0 - edge, xtol=1e-14)
    return float(lower), float(upper)


# ---------------------------------------------------------------- power and sample size


def trtllm_threshold_drop(n: int, alpha: float = 0.05, sigma: float = TRTLLM_SIGMA_POINTS) -> float:
    """Points below the reference that TensorRT-LLM's unpaired z-test still accepts."""
    return normal_ppf(1.0 - alpha) * math.sqrt(2.0 * sigma * sigma / n)


def unpaired_mde(n: int, alpha: float = 0.05, beta: float = 0.2, sigma: float = TRTLLM_SIGMA_POINTS) -> float:
    """Minimum detectable drop (points) of the unpaired z-test at power 1 - beta."""
    return (normal_ppf(1.0 - alpha) + normal_ppf(1.0 - beta)) * math.sqrt(2.0 * sigma * sigma / n)


def paired_mde(n: int, discordance: float, alpha: float = 0.05, beta: float = 0.2) -> float:
    """Minimum detectable drop (fraction) of the paired test for an assumed discordance rate."""
    return (normal_ppf(1.0 - alpha) + normal_ppf(1.0 - beta)) * math.sqrt(discordance / n)


def n_min_for_margin(margin: float, alpha: float = 0.05, beta: float = 0.2) -> int | None:
    """Smallest n that can pass at `margin` (rule 2 of the module docstring); None for margin 0."""
    if margin <= 0:
        return None
    z = normal_ppf(1.0 - alpha)
    n_bound = math.floor(z * z * (1.0 - margin) / margin) + 1       # -z^2 / (n + z^2) > -margin
    # one-pair MDE <= margin; the 1e-9 keeps a quotient that is an integer up to rounding from rounding up
    n_mde = math.ceil((z + normal_ppf(1.0 - beta)) / margin - 1e-9)
    return max(n_bound, n_mde)


def n_for_power(margin: float, discordance: float, alpha: float = 0.05, beta: float = 0.2) -> int | None:
    """Questions for power 1 - beta to pass at `margin` when the true difference is 0 (rule 5)."""
    n_min = n_min_for_margin(margin, alpha, beta)
    if n_min is None:
        return None
    zz = normal_ppf(1.0 - alpha) + normal_ppf(1.0 - beta)
    return max(n_min, math.ceil(zz * zz * discordance / (margin * margin) - 1e-9))


def _points(fraction: float) -> str:
    value = 100 * fraction
    return f"{value:g} point" + ("" if value == 1 else "s")


# ---------------------------------------------------------------- joining outcomes


def _as_bool(value: Any, side: str, key: Hashable) -> bool:
    if value is True or value is False:
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if getattr(getattr(value, "dtype", None), "kind", None) == "b":  # numpy / torch scalar bools
        return bool(value)
    raise UsageError(f"{side} outcome for {key!r} must be a bool, got {value!r}")


def pair_outcomes(
    ref: Mapping[Hashable, Any], cand: Mapping[Hashable, Any]
) -> list[tuple[Hashable, bool, bool]]:
    """Join per-question correctness by key; rows sorted by the key's text for stable output."""
    only_ref = sorted(set(ref) - set(cand), key=str)
    only_cand = sorted(set(cand) - set(ref), key=str)
    if only_ref or only_cand:
        parts = []
        for side, keys in (("reference", only_ref), ("candidate", only_cand)):
            if keys:
                shown = ", ".join(repr(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else "")
                parts.append(f"{len(keys)} only in {side} ({shown})")
        raise UsageError("paired outcomes need the same questions on both sides: " + "; ".join(parts))
    if not ref:
        raise UsageError("paired outcomes need at least one question, got none")
    return [(k, _as_bool(ref[k], "reference", k), _as_bool(cand[k], "candidate", k))
            for k in sorted(ref, key=str)]


# ---------------------------------------------------------------- the paired result


@dataclass
class PairedResult:
    """Paired comparison of reference and candidate on the same n questions (fractions)."""

    n: int
    ref_correct: int
    cand_correct: int
    b: int  # reference right, candidate wrong
    c: int  # reference wrong, candidate right
    acc_ref: float
    acc_cand: float
    d: float
    se: float  # Wald standard error of d; descriptive only, the bounds are Tango's
    mcnemar_p: float  # two-sided exact
    p_worse: float  # one-sided exact: P(this few candidate wins | no difference)
    margin: float
    alpha: float  # one-sided
    beta: float
    z_alpha: float  # z_{1-alpha}
    method: str  # how lower_bound / upper_bound were computed
    lower_bound: float
    upper_bound: float
    noninferior: bool  # lower_bound > -margin; the verdict also weighs n and the McNemar test
    verdict: str  # pass | fail | inconclusive (module docstring)
    verdict_reason: str
    n_min: int | None  # smallest n that can pass at this margin; None: no n (margin 0)
    n_needed: int | None  # n for power 1 - beta at the observed discordance
    discordance_rate: float
    mde: float  # paired minimum detectable drop, fraction
    mde_discordance: float  # the discordance rate mde assumes
    trtllm_threshold_points: float  # TensorRT-LLM unpaired pass line: ref - drop, 0-100 scale
    trtllm_mde_points: float
    power_note: str

    def __post_init__(self) -> None:
        if self.n <= 0:
            raise ValueError(f"n must be > 0, got {self.n}")
        if min(self.b, self.c) < 0 or self.b > self.ref_correct or self.c > self.n - self.ref_correct:
            raise ValueError(
                f"discordant counts b={self.b}, c={self.c} do not fit n={self.n}, "
                f"ref_correct={self.ref_correct}"
            )
        if self.cand_correct != self.ref_correct - self.b + self.c:
            raise ValueError(
                f"cand_correct must equal ref_correct - b + c = {self.ref_correct - self.b + self.c}, "
                f"got {self.cand_correct}"
            )
        if self.noninferior != (self.lower_bound > -self.margin):
            raise ValueError("noninferior contradicts lower_bound and margin")
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}, got {self.verdict!r}")
        if self.verdict == "pass" and not self.noninferior:
            raise ValueError("a pass needs lower_bound > -margin")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _verdict(n: int, ref_correct: int, b: int, c: int, lower: float, upper: float, p_worse: float,
             margin: float, alpha: float, n_min: int | None, n_needed: int | None) -> tuple[str, str]:
    """(verdict, one-line reason): the rules of the module docstring, in order."""
    m = _points(margin)
    if p_worse <= alpha:
        return "fail", (f"fail: the candidate is worse: b={b} losses against c={c} wins, exact one-sided "
                        f"McNemar p={p_worse:.3g} <= alpha={alpha:g}")
    if upper < -margin:
        return "fail", f"fail: inferior: the upper bound {upper:+.4f} is below -{margin:g} (a drop beyond {m})"
    if n_min is None:
        return "inconclusive", (f"inconclusive: a margin of {m} cannot be resolved by any n (even zero "
                                f"discordance leaves a lower bound below 0)")
    if n < n_min:
        return "inconclusive", f"inconclusive: n={n} cannot resolve a margin of {m}; need n >= {n_min}"
    if ref_correct <= margin * n:
        return "inconclusive", (f"inconclusive: the reference answered {ref_correct}/{n}, no more than the margin "
                                f"of {m}: no candidate can lose more than that, so the test carries no evidence")
    if lower > -margin:
        return "pass", f"pass: non-inferior: the lower bound {lower:+.4f} > -{margin:g}"
    why = (f"inconclusive: the lower bound {lower:+.4f} does not exclude a drop of {m} and the exact McNemar "
           f"test shows none (p={p_worse:.3g})")
    if n_needed is not None and n_needed > n:
        return "inconclusive", why + f"; need n >= {n_needed} at this discordance ({(b + c) / n:.1%})"
    return "inconclusive", why + f"; the observed d={(c - b) / n:+.4f} holds the bound down"


def paired_from_counts(
    n: int, ref_correct: int, b: int, c: int, *, margin: float = 0.01, alpha: float = 0.05, beta: float = 0.2
) -> PairedResult:
    """PairedResult from the 2x2 table: n questions, reference correct count, discordant b and c."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin is a fraction (0.01 = 1 point), must be in [0, 1), got {margin}")
    for name, value in (("alpha", alpha), ("beta", beta)):
        if not 0.0 < value < 0.5:
            raise ValueError(f"{name} must be in (0, 0.5), got {value}")
    if n <= 0 or not 0 <= ref_correct <= n:
        raise ValueError(f"need n > 0 and 0 <= ref_correct <= n, got n={n}, ref_correct={ref_correct}")
    if b < 0 or c < 0 or b > ref_correct or c > n - ref_correct:
        raise ValueError(f"discordant counts b={b}, c={c} do not fit n={n}, ref_correct={ref_correct}")
    z_alpha = normal_ppf(1.0 - alpha)
    d = (c - b) / n
    # max() guards a tiny negative from rounding when b + c = (c - b)^2 / n exactly.
    se = math.sqrt(max(0.0, b + c - (c - b) ** 2 / n)) / n
    lower, upper = tango_bounds(n, b, c, alpha)
    p_worse = mcnemar_p_worse(b, c)
    discordance = (b + c) / n
    n_min = n_min_for_margin(margin, alpha, beta)
    n_needed = n_for_power(margin, discordance, alpha, beta)
    verdict, verdict_reason = _verdict(n, ref_correct, b, c, lower, upper, p_worse, margin, alpha, n_min, n_needed)
    mde_disc = max(discordance, 1.0 / n)
    mde = paired_mde(n, mde_disc, alpha, beta)
    trt_drop = trtllm_threshold_drop(n, alpha)
    trt_mde = unpaired_mde(n, alpha, beta)
    power_note = (
        f"With n={n} paired questions and {b + c} discordant ({discordance:.1%}), a true drop of "
        f"{100 * mde:.2f} points is detected with {1 - beta:.0%} power at one-sided alpha={alpha:g}"
        f"{' (discordance floored at one pair)' if discordance < mde_disc else ''}; "
        f"the unpaired z-test TensorRT-LLM uses needs {trt_mde:.2f} points and accepts drops up to "
        f"{trt_drop:.2f}."
    )
    return PairedResult(
        n=n, ref_correct=ref_correct, cand_correct=ref_correct - b + c, b=b, c=c,
        acc_ref=ref_correct / n, acc_cand=(ref_correct - b + c) / n, d=d, se=se,
        mcnemar_p=mcnemar_exact_p(b, c), p_worse=p_worse, margin=margin, alpha=alpha, beta=beta,
        z_alpha=z_alpha, method=METHOD, lower_bound=lower, upper_bound=upper, noninferior=lower > -margin,
        verdict=verdict, verdict_reason=verdict_reason, n_min=n_min, n_needed=n_needed,
        discordance_rate=discordance, mde=mde, mde_discordance=mde_disc,
        trtllm_threshold_points=100 * ref_correct / n - trt_drop, trtllm_mde_points=trt_mde, power_note=power_note,
    )


def paired_test(
    ref: Mapping[Hashable, Any],
    cand: Mapping[Hashable, Any],
    margin: float = 0.01,
    alpha: float = 0.05,
    beta: float = 0.2,
) -> PairedResult:
    """Paired non-inferiority and McNemar test from per-question correctness keyed alike."""
    rows = pair_outcomes(ref, cand)
    b = sum(1 for _, ref_ok, cand_ok in rows if ref_ok and not cand_ok)
    c = sum(1 for _, ref_ok, cand_ok in rows if cand_ok and not ref_ok)
    ref_correct = sum(1 for _, ref_ok, _ in rows if ref_ok)
    return paired_from_counts(len(rows), ref_correct, b, c, margin=margin, alpha=alpha, beta=beta)
