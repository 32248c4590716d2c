"""Two-sample test that two samplers draw from the same distribution: the judge of a
`distribution` contract (sampled speculation: the output must be distributed as the plain
sampler's, though no two random streams agree bit for bit).

Each arm is a list of hashable outcomes (a token, a pair or triple of tokens). The test is
Pearson's chi-square test of homogeneity on the 2 x C table of counts. Categories whose expected
count is below `min_expected` (5, the usual rule for the chi-square approximation) in either arm
are pooled into one "rest" category; if the rest is itself too small it is merged into the
smallest kept category. df = C' - 1 for the C' categories left.

Power: with n draws per arm, arm distributions a and b and pooled m = (a + b) / 2, the
statistic is approximately noncentral chi-square with df and noncentrality
lambda = n / 2 * sum_i (a_i - b_i)^2 / m_i. By Cauchy-Schwarz sum (a - b)^2 / m >= (sum |a - b|)^2
= 4 delta^2 for a total-variation distance delta, so every shift of TV >= delta gives
lambda >= 2 n delta^2. `n_for_tv_shift` is the smallest n at which that worst case is detected
with the asked power at level alpha: a sample of that size sees any shift of TV delta.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Hashable, Iterable

from scipy.stats import chi2, ncx2

from k3verify.errors import UsageError

MIN_EXPECTED = 5.0
REST = "<rest>"


def pooled_table(a: Counter, b: Counter, min_expected: float = MIN_EXPECTED
                 ) -> tuple[list[Hashable], list[int], list[int], int]:
    """(categories, counts of a, counts of b, how many were pooled) with the rare categories
    pooled into REST."""
    n_a, n_b = sum(a.values()), sum(b.values())
    small = min(n_a, n_b) / (n_a + n_b)             # the smaller arm's share of every column
    cats = sorted(set(a) | set(b), key=lambda c: (-(a[c] + b[c]), repr(c)))
    keep = [c for c in cats if (a[c] + b[c]) * small >= min_expected]
    rest = [c for c in cats if (a[c] + b[c]) * small < min_expected]
    col_a, col_b = [a[c] for c in keep], [b[c] for c in keep]
    if rest:
        ra, rb = sum(a[c] for c in rest), sum(b[c] for c in rest)
        if (ra + rb) * small >= min_expected or not keep:
            keep, col_a, col_b = keep + [REST], col_a + [ra], col_b + [rb]
        else:                                       # too small alone: into the smallest kept column
            keep[-1] = f"{keep[-1]!r}+{REST}"
            col_a[-1] += ra
            col_b[-1] += rb
    return keep, col_a, col_b, len(rest)


@dataclass
class DistributionVerdict:
    passed: bool                 # p_value >= alpha: no evidence the distributions differ
    p_value: float
    statistic: float
    df: int
    alpha: float
    n_a: int
    n_b: int
    categories: int              # columns after pooling
    pooled: int                  # rare categories pooled into REST
    tv_observed: float           # total-variation distance of the two empirical distributions
    worst_cell: str              # the category with the largest contribution to the statistic

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def message(self) -> str:
        verdict = "same distribution (not rejected)" if self.passed else "distributions differ"
        return (f"{verdict}: chi-square {self.statistic:.2f} on {self.df} df, p = {self.p_value:.3g} "
                f"(alpha {self.alpha:g}), n = {self.n_a} / {self.n_b}, {self.categories} categories "
                f"({self.pooled} pooled), observed TV {self.tv_observed:.4f}, worst cell {self.worst_cell}")


def same_distribution(a: Iterable[Hashable], b: Iterable[Hashable], alpha: float = 1e-3,
                      min_expected: float = MIN_EXPECTED) -> DistributionVerdict:
    """Chi-square test of homogeneity of two samples of outcomes (see the module docstring)."""
    return same_counts(Counter(a), Counter(b), alpha, min_expected)


def same_counts(ca: Counter, cb: Counter, alpha: float = 1e-3, min_expected: float = MIN_EXPECTED
                ) -> DistributionVerdict:
    """`same_distribution` on the two samples' counts (outcome -> times drawn)."""
    if not 0 < alpha < 1:
        raise UsageError(f"alpha must be in (0, 1), got {alpha!r}")
    n_a, n_b = sum(ca.values()), sum(cb.values())
    if not n_a or not n_b:
        raise UsageError(f"distribution test: both samples need outcomes, got {n_a} and {n_b}")
    cats, col_a, col_b, pooled = pooled_table(ca, cb, min_expected)
    n = n_a + n_b
    stat, worst, worst_c = 0.0, -1.0, ""
    for c, x, y in zip(cats, col_a, col_b):
        col = x + y
        ex, ey = col * n_a / n, col * n_b / n
        term = (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
        stat += term
        if term > worst:
            worst, worst_c = term, repr(c)
    df = len(cats) - 1
    p = float(chi2.sf(stat, df)) if df > 0 else 1.0
    tv = 0.5 * sum(abs(ca[c] / n_a - cb[c] / n_b) for c in set(ca) | set(cb))
    return DistributionVerdict(p >= alpha, p, stat, df, alpha, n_a, n_b, len(cats), pooled, tv, worst_c)


def power_for_tv_shift(n: int, tv: float, df: int, alpha: float) -> float:
    """The least power, over every pair of distributions at total variation `tv`, of the test with
    n draws per arm at `df` degrees of freedom (noncentrality 2 n tv^2, the Cauchy-Schwarz bound)."""
    crit = chi2.isf(alpha, df)
    return float(ncx2.sf(crit, df, 2.0 * n * tv * tv))


def n_for_tv_shift(tv: float, df: int, alpha: float = 1e-3, power: float = 0.9) -> int:
    """The smallest n per arm at which any shift of total variation `tv` is detected with at least
    `power` at level `alpha` by the chi-square test on `df` degrees of freedom."""
    if not (0 < tv <= 1 and df >= 1 and 0 < alpha < 1 and 0 < power < 1):
        raise UsageError(f"n_for_tv_shift: expected 0 < tv <= 1, df >= 1, alpha and power in (0, 1); "
                         f"got tv={tv}, df={df}, alpha={alpha}, power={power}")
    lo, hi = 1, 2
    while power_for_tv_shift(hi, tv, df, alpha) < power:
        lo, hi = hi, hi * 2
    while hi - lo > 1:                               # the power grows with n: bisect
        mid = (lo + hi) // 2
        if power_for_tv_shift(mid, tv, df, alpha) >= power:
            hi = mid
        else:
            lo = mid
    return hi if power_for_tv_shift(lo, tv, df, alpha) < power else lo


def min_detectable_tv(n: int, df: int, alpha: float = 1e-3, power: float = 0.9) -> float:
    """The smallest total-variation shift the test sees with `power` at n per arm (worst case)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if power_for_tv_shift(n, mid, df, alpha) >= power:
            hi = mid
        else:
            lo = mid
    return hi
