"""Paired statistics for accuracy gates: the same questions, answered by reference and candidate.

Accuracies are fractions in [0, 1]; `margin` is on the same scale (0.01 = one
point). With b = questions the reference got right and the candidate wrong,
c = the reverse, and n questions:

    d  = (c - b) / n                               paired accuracy difference
    se = sqrt(b + c - (c - b)^2 / n) / n           its standard error
    lower_bound = d - z_{1-alpha} * se             one-sided bound
    noninferior = lower_bound > -margin
    McNemar exact p = min(1, 2 * BinomCDF(min(b, c); b + c, 1/2)), 1 when b + c = 0

Minimum detectable effect (paired): under H0 the per-question difference has
variance close to the discordance rate p_disc, so a true drop of

    mde = (z_{1-alpha} + z_{1-beta}) * sqrt(p_disc / n)

is detected with power 1 - beta. p_disc defaults to the observed rate, floored
at 1/n (one discordant pair) so perfect agreement still states a finite figure.
For comparison, the unpaired one-sided z-test TensorRT-LLM uses treats the
runs as independent with sigma = 50 points: threshold = ref - z_{1-alpha} *
sqrt(2 sigma^2 / n) (3.20 points for n = 1319) and mde = (z_{1-alpha} +
z_{1-beta}) * sqrt(2 sigma^2 / n) (4.84 points).

Only `math` is used: the normal quantile is Acklam's rational approximation
with one Halley step, the binomial CDF an exact sum.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Hashable, Mapping

from k3verify.errors import UsageError

# Sigma of a 0/1 score on the 0-100 scale at 50% accuracy, the worst case TensorRT-LLM assumes.
TRTLLM_SIGMA_POINTS = 50.0

# Acklam's coefficients for the inverse normal CDF (relative error < 1.15e-9 before refinement).
_A = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02,
      1.383577518672690e02, -3.066479806614716e01, 2.506628277459239e00)
_B = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02,
      6.680131188771972e01, -1.328068155288572e01)
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00,
      -2.549732539343734e00, 4.374664141464968e00, 2.938163982698783e00)
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
_P_LOW = 0.02425


def normal_cdf(x: float) -> float:
    """Phi(x), the standard normal CDF."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def normal_ppf(p: float) -> float:
    """Phi^{-1}(p) for 0 < p < 1."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"normal_ppf needs 0 < p < 1, got {p}")
    if p < _P_LOW:
        q = math.sqrt(-2.0 * math.log(p))
        x = (((((_C[0] * q + _C[1]) * q + _C[2]) * q + _C[3]) * q + _C[4]) * q + _C[5]) / (
            (((_D[0] * q + _D[1]) * q + _D[2]) * q + _D[3]) * q + 1.0)
    elif p <= 1.0 - _P_LOW:
        q = p - 0.5
        r = q * q
        x = (((((_A[0] * r + _A[1]) * r + _A[2]) * r + _A[3]) * r + _A[4]) * r + _A[5]) * q / (
            ((((_B[0] * r + _B[1]) * r + _B[2]) * r + _B[3]) * r + _B[4]) * r + 1.0)
    else:
        q = math.sqrt(-2.0 * math.log1p(-p))
        x = -(((((_C[0] * q + _C[1]) * q + _C[2]) * q + _C[3]) * q + _C[4]) * q + _C[5]) / (
            (((_D[0] * q + _D[1]) * q + _D[2]) * q + _D[3]) * q + 1.0)
    # One Halley step against erfc brings the error to near machine precision.
    e = normal_cdf(x) - p
    u = e * math.sqrt(2.0 * math.pi) * math.exp(x * x / 2.0)
    return x - u / (1.0 + x * u / 2.0)


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p); exact integer sum when p = 1/2."""
    if n < 0 or not 0.0 <= p <= 1.0:
        raise ValueError(f"binom_cdf needs n >= 0 and 0 <= p <= 1, got n={n}, p={p}")
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p == 0.5:
        # Integer true division is correctly rounded, even for huge numerators.
        return sum(math.comb(n, i) for i in range(k + 1)) / (1 << n)
    if p in (0.0, 1.0):
        return 1.0 if p == 0.0 else 0.0
    log_terms = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
        + i * math.log(p) + (n - i) * math.log1p(-p)
        for i in range(k + 1)
    ]
    top = max(log_terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in log_terms))


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    if b + c == 0:
        return 1.0
    return min(1.0, 2.0 * binom_cdf(min(b, c), b + c, 0.5))


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


def trtllm_threshold_drop(n: int, alpha: float = 0.05, sigma: float = TRTLLM_SIGMA_POINTS) -> float:
    """Points below the reference that TensorRT-LLM's unpaired z-test still accepts."""
    return normal_ppf(1.0 - alpha) * math.sqrt(2.0 * sigma * sigma / n)


def unpaired_mde(n: int, alpha: float = 0.05, beta: float = 0.2, sigma: float = TRTLLM_SIGMA_POINTS) -> float:
    """Minimum detectable drop (points) of the unpaired z-test at power 1 - beta."""
    return (normal_ppf(1.0 - alpha) + normal_ppf(1.0 - beta)) * math.sqrt(2.0 * sigma * sigma / n)


def paired_mde(n: int, discordance: float, alpha: float = 0.05, beta: float = 0.2) -> float:
    """Minimum detectable drop (fraction) of the paired test for an assumed discordance rate."""
    return (normal_ppf(1.0 - alpha) + normal_ppf(1.0 - beta)) * math.sqrt(discordance / n)


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
    se: float
    mcnemar_p: float
    margin: float
    alpha: float  # one-sided
    beta: float
    z_alpha: float  # z_{1-alpha}
    lower_bound: float
    noninferior: bool
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    z_alpha = normal_ppf(1.0 - alpha)
    d = (c - b) / n
    # max() guards a tiny negative from rounding when b + c = (c - b)^2 / n exactly.
    se = math.sqrt(max(0.0, b + c - (c - b) ** 2 / n)) / n
    lower_bound = d - z_alpha * se
    discordance = (b + c) / n
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
        mcnemar_p=mcnemar_exact_p(b, c), margin=margin, alpha=alpha, beta=beta, z_alpha=z_alpha,
        lower_bound=lower_bound, noninferior=lower_bound > -margin, discordance_rate=discordance,
        mde=mde, mde_discordance=mde_disc, trtllm_threshold_points=100 * ref_correct / n - trt_drop,
        trtllm_mde_points=trt_mde, power_note=power_note,
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
