"""k3verify.quality.stats: paired accuracy statistics against hand-computed tables, published worked
examples, and an independent implementation of Tango's score bound."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from scipy import optimize

from k3verify.errors import UsageError
from k3verify.quality.stats import (PairedResult, binom_cdf, mcnemar_exact_p, mcnemar_p_worse, n_for_power,
                                    n_min_for_margin, normal_cdf, normal_ppf, pair_outcomes, paired_from_counts,
                                    paired_mde, paired_test, tango_bounds, tango_z, trtllm_threshold_drop, unpaired_mde,
                                    wilson_interval)

Z95 = 1.6448536269514722
Z975 = 1.959963984540054


# ------------------------------------------------------------------ primitives (scipy-backed)


@pytest.mark.parametrize(
    "p, z",
    [(0.95, 1.6448536), (0.8, 0.8416212), (0.975, 1.9599640), (0.5, 0.0), (0.01, -2.3263479),
     (1e-10, -6.3613409)],
    ids=["p95", "p80", "p975", "median", "p01-low-tail", "p1e-10"],
)
def test_normal_ppf_known_values(p, z):
    assert normal_ppf(p) == pytest.approx(z, abs=5e-8)


def test_normal_ppf_inverts_cdf_and_is_symmetric():
    for p in (1e-300, 1e-6, 0.02425, 0.3, 0.7, 0.97575, 1 - 1e-12):
        assert normal_cdf(normal_ppf(p)) == pytest.approx(p, rel=1e-9)
    assert normal_ppf(0.2) == pytest.approx(-normal_ppf(0.8), abs=1e-12)
    with pytest.raises(ValueError, match="normal_ppf needs 0 < p < 1, got 1.0"):
        normal_ppf(1.0)


def test_binom_cdf_exact_and_general():
    assert binom_cdf(1, 6, 0.5) == pytest.approx(7 / 64, rel=1e-15)
    assert binom_cdf(-1, 6, 0.5) == 0.0 and binom_cdf(6, 6, 0.3) == 1.0
    for k, n, p in [(3, 10, 0.3), (0, 5, 0.9), (40, 100, 0.45)]:
        exact = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))
        assert binom_cdf(k, n, p) == pytest.approx(exact, rel=1e-10)
    # Large n: by symmetry P(X <= n/2 - 1) = (1 - P(X = n/2)) / 2.
    middle = math.comb(5000, 2500) / 2**5000
    assert binom_cdf(2499, 5000, 0.5) == pytest.approx((1 - middle) / 2, rel=1e-12)
    with pytest.raises(ValueError, match="binom_cdf needs n >= 0 and 0 <= p <= 1, got n=3, p=1.5"):
        binom_cdf(1, 3, 1.5)


@pytest.mark.parametrize(
    "b, c, p",
    [(5, 1, 0.21875), (1, 5, 0.21875), (0, 0, 1.0), (3, 3, 1.0), (0, 6, 2 / 64), (10, 0, 2 / 1024)],
    ids=["b5-c1", "b1-c5", "none", "tie", "b0-c6", "b10-c0"],
)
def test_mcnemar_exact_table(b, c, p):
    assert mcnemar_exact_p(b, c) == pytest.approx(p, rel=1e-12)


def test_mcnemar_one_sided_is_half_the_two_sided_when_worse():
    assert mcnemar_p_worse(5, 1) == pytest.approx(7 / 64) and mcnemar_p_worse(10, 0) == pytest.approx(1 / 1024)
    assert mcnemar_p_worse(1, 5) == pytest.approx(63 / 64), "more wins than losses is not evidence of worse"
    assert mcnemar_p_worse(0, 0) == 1.0


# ---------------------------------------------------------- Tango's score interval


def _score_bound_reference(n, b, c, z, side):
    """Tango's bound the long way: the constrained MLE by maximising the multinomial likelihood
    numerically (not the closed-form quadratic), then bisection on the score statistic."""
    def z_stat(delta):
        lo, hi = max(0.0, -delta), (1.0 - delta) / 2.0

        def nll(q):
            cells = ((b, q), (c, q + delta), (n - b - c, 1.0 - 2.0 * q - delta))
            return -sum(k * math.log(max(p, 1e-300)) for k, p in cells if k)
        q = optimize.minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-13}).x
        var = n * (2 * q + delta * (1 - delta))
        return (c - b - n * delta) / math.sqrt(var)
    d = (c - b) / n
    lo, hi = (-1 + 1e-9, d) if side == "lower" else (d, 1 - 1e-9)
    target = z if side == "lower" else -z
    for _ in range(60):                        # Z decreases in delta: left of the bound Z > target
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if z_stat(mid) > target else (lo, mid)
    return (lo + hi) / 2


def test_tango_reproduces_the_published_cavo_example():
    # Fagerland, Lydersen & Laake, "Statistical Analysis of Contingency Tables" (2017), ch. 8,
    # worked example (Cavo et al. 2012, complete response before/after consolidation therapy):
    # table [[59, 6], [16, 80]], estimate -0.0621, Tango 95% CI -0.1240 to -0.0054 (the figures
    # their companion R package `contingencytables` checks). Off-diagonal 6 -> c, 16 -> b.
    lower, upper = tango_bounds(161, b=16, c=6, alpha=0.025)
    assert (round(lower, 4), round(upper, 4)) == (-0.1240, -0.0054)


def test_tango_at_zero_discordance_is_the_wilson_bound():
    # Hand-derived: with b = c = 0 the constrained MLE is q = -delta, so Z = sqrt(n|d| / (1 - |d|))
    # and Z = z at |d| = z^2 / (n + z^2). Newcombe 1998 (paired), Table III, example (54, 0, 0, 0):
    # -0.0664 to 0.0664 at 95%, which is this bound for n = 54.
    assert tango_bounds(54, 0, 0, alpha=0.025) == (pytest.approx(-0.0664, abs=5e-5), pytest.approx(0.0664, abs=5e-5))
    for n in (1, 2, 54, 267, 268, 1319):
        lower, upper = tango_bounds(n, 0, 0, alpha=0.05)
        assert lower == pytest.approx(-Z95**2 / (n + Z95**2), rel=1e-9) and upper == pytest.approx(-lower, rel=1e-9)
    assert tango_bounds(2, 0, 0)[0] == pytest.approx(-0.57497, abs=1e-5)


def test_tango_z_at_zero_is_mcnemar():
    for b, c in ((5, 1), (16, 6), (0, 3), (40, 40)):
        assert tango_z(100, b, c, 0.0) == pytest.approx((c - b) / math.sqrt(b + c), rel=1e-12)
    assert tango_z(10, 0, 0, 0.0) == 0.0


@pytest.mark.parametrize("n, b, c", [(161, 16, 6), (100, 5, 1), (2, 0, 0), (1319, 2, 2), (50, 12, 2), (30, 0, 7),
                                     (10, 4, 0)], ids=lambda v: str(v))
def test_tango_matches_an_independent_implementation(n, b, c):
    lower, upper = tango_bounds(n, b, c, alpha=0.05)
    assert lower == pytest.approx(_score_bound_reference(n, b, c, Z95, "lower"), abs=2e-7)
    assert upper == pytest.approx(_score_bound_reference(n, b, c, Z95, "upper"), abs=2e-7)
    assert lower <= (c - b) / n <= upper
    deltas = np.linspace(-0.999, 0.999, 401)
    zs = [tango_z(n, b, c, x) for x in deltas]
    assert all(z1 >= z2 for z1, z2 in zip(zs, zs[1:])), "the score statistic must decrease in delta"


def test_tango_edges_and_validation():
    assert tango_bounds(5, 5, 0)[0] == -1.0 and tango_bounds(5, 0, 5)[1] == 1.0
    assert tango_bounds(100, 5, 1, alpha=0.1)[0] > tango_bounds(100, 5, 1, alpha=0.01)[0], "lower alpha, wider"
    with pytest.raises(ValueError, match=r"b \+ c <= n, got n=3, b=2, c=2"):
        tango_bounds(3, 2, 2)


def test_wald_bound_passed_two_questions_and_tango_does_not():
    # Negative control for the method: the Wald bound d - z*se that the gate used is exactly 0
    # at zero discordance for every n (se = 0), so n = 2 "showed" non-inferiority at 1 point.
    r = paired_from_counts(2, 0, 0, 0)
    assert r.se == 0.0 and r.d - r.z_alpha * r.se == 0.0 > -0.01
    assert r.lower_bound == pytest.approx(-0.57497, abs=1e-5) and not r.noninferior


# ---------------------------------------------------------------- the three-way verdict


def test_zero_discordance_at_n2_is_inconclusive():
    r = paired_from_counts(2, 0, 0, 0)
    assert (r.verdict, r.n_min) == ("inconclusive", 268)
    assert r.verdict_reason == "inconclusive: n=2 cannot resolve a margin of 1 point; need n >= 268"
    assert r.mde == pytest.approx((Z95 + 0.8416212) / 2, abs=1e-6) and r.mde > 1, "the 124-point MDE"


def test_large_n_with_zero_discordance_passes():
    r = paired_from_counts(1319, 1000, 0, 0)
    assert r.verdict == "pass" and r.noninferior and (r.mcnemar_p, r.d) == (1.0, 0.0)
    assert r.lower_bound == pytest.approx(-Z95**2 / (1319 + Z95**2))             # -0.00205
    assert r.verdict_reason == "pass: non-inferior: the lower bound -0.0020 > -0.01"
    assert r.mde_discordance == pytest.approx(1 / 1319) and "(discordance floored at one pair)" in r.power_note


def test_n_min_is_the_boundary():
    # z^2 (1 - m) / m = 2.70554 * 99 = 267.85: n = 267 cannot pass, n = 268 can.
    below, at = paired_from_counts(267, 200, 0, 0), paired_from_counts(268, 200, 0, 0)
    assert below.lower_bound < -0.01 < at.lower_bound
    assert (below.verdict, at.verdict) == ("inconclusive", "pass")
    # the MDE rule binds for higher power: (z_.95 + z_.95) / 0.01 = 328.97 -> 329
    assert [n_min_for_margin(m) for m in (0.01, 0.02, 0.05)] == [268, 133, 52]
    assert n_min_for_margin(0.01, beta=0.05) == 329 and n_min_for_margin(0.0) is None


def test_a_real_drop_fails():
    # negative control: the gate must be able to fail
    r = paired_from_counts(100, 80, b=30, c=2)
    assert r.verdict == "fail" and r.verdict_reason.startswith("fail: the candidate is worse: b=30 losses")
    assert r.upper_bound < -0.1 and r.mcnemar_p < 1e-6 and r.p_worse == pytest.approx(r.mcnemar_p / 2)


def test_inferior_fails_even_when_n_is_small():
    # 4 losses in 10, no win: exact p = 1/16 is not below alpha, but the whole score interval
    # is beyond the margin (upper bound -0.102)
    r = paired_from_counts(10, 8, b=4, c=0)
    assert r.p_worse == 1 / 16 and r.upper_bound < -0.1
    assert r.verdict == "fail" and "inferior: the upper bound -0.1019 is below -0.01" in r.verdict_reason


def test_a_shown_drop_fails_inside_the_margin():
    r = paired_from_counts(1000, 700, b=20, c=10, margin=0.02)  # exact one-sided p = 0.0494
    assert r.noninferior and r.lower_bound > -0.02
    assert r.verdict == "fail" and "p=0.0494 <= alpha=0.05" in r.verdict_reason
    assert paired_from_counts(1000, 700, b=19, c=10, margin=0.02).verdict == "pass", "one loss fewer: p = 0.068"


def test_vacuous_reference_is_inconclusive():
    # both sides at 0%: no candidate can lose anything, so a pass would mean nothing
    r = paired_from_counts(500, 0, 0, 0)
    assert r.noninferior and r.verdict == "inconclusive"
    assert "the reference answered 0/500, no more than the margin of 1 point" in r.verdict_reason
    assert paired_from_counts(500, 400, 0, 0).verdict == "pass", "negative control: a reference with answers"


def test_a_bound_below_the_margin_without_a_shown_drop_is_inconclusive():
    r = paired_from_counts(300, 200, b=2, c=0)                     # p_worse = 0.25, bound -0.0199
    assert r.verdict == "inconclusive" and not r.noninferior
    # (z_.95 + z_.8)^2 * (2/300) / 0.01^2 = 6.18255 * 66.667 = 412.2 -> 413
    assert r.n_needed == 413 == n_for_power(0.01, 2 / 300)
    assert r.verdict_reason.endswith("need n >= 413 at this discordance (0.7%)")


def test_zero_margin_can_never_pass():
    r = paired_from_counts(1319, 1000, 0, 0, margin=0.0)
    assert r.verdict == "inconclusive" and r.n_min is None and "cannot be resolved by any n" in r.verdict_reason


def test_few_balanced_flips_pass_at_one_point():
    r = paired_from_counts(1319, 1000, b=2, c=2)
    assert r.d == 0.0 and r.se == pytest.approx(2 / 1319)
    assert -0.01 < r.lower_bound < -Z95 * 2 / 1319, "the score bound is wider than Wald's at 4 discordant"
    assert r.verdict == "pass"


def test_b5_c1_n100_table():
    r = paired_from_counts(100, 65, b=5, c=1)
    assert (r.cand_correct, r.acc_ref, r.acc_cand) == (61, 0.65, 0.61)
    assert r.d == pytest.approx(-0.04)
    assert r.se == pytest.approx(math.sqrt(6 - 16 / 100) / 100)  # 0.0241661 (Wald, descriptive)
    assert r.mcnemar_p == pytest.approx(0.21875) and r.p_worse == pytest.approx(7 / 64)
    assert r.lower_bound == pytest.approx(-0.090738, abs=1e-6) and r.method == "tango-score"
    assert tango_z(100, 5, 1, r.lower_bound) == pytest.approx(Z95, abs=1e-9)
    assert not r.noninferior and r.discordance_rate == 0.06
    assert r.verdict == "inconclusive", "n=100 cannot resolve 1 point"


# ---------------------------------------------------------------- power / MDE


def test_trtllm_threshold_for_gsm8k():
    assert trtllm_threshold_drop(1319) == pytest.approx(3.20, abs=0.01)
    assert unpaired_mde(1319) == pytest.approx(4.84, abs=0.01)
    r = paired_from_counts(1319, 1000, b=3, c=1)
    assert r.trtllm_threshold_points == pytest.approx(100 * 1000 / 1319 - 3.2025, abs=1e-3)
    assert r.trtllm_mde_points == pytest.approx(4.84, abs=0.01)


def test_paired_mde_sanity():
    # (z_.95 + z_.8) * sqrt(0.01 / 1319) = 2.4864748 * 0.0027535 = 0.0068465
    assert paired_mde(1319, 0.01) == pytest.approx(0.0068465, abs=1e-6)
    assert paired_mde(1319, 0.01) * 100 < unpaired_mde(1319), "pairing must buy power at low discordance"
    # 2 sigma^2 = 0.5 on the 0-1 scale: at half the questions discordant, pairing buys nothing.
    assert paired_mde(1319, 0.5) * 100 == pytest.approx(unpaired_mde(1319), rel=1e-9)
    assert paired_mde(4 * 1319, 0.01) == pytest.approx(paired_mde(1319, 0.01) / 2)
    assert paired_mde(1319, 0.04) == pytest.approx(2 * paired_mde(1319, 0.01))
    assert paired_mde(n_for_power(0.01, 0.01), 0.01) <= 0.01 < paired_mde(n_for_power(0.01, 0.01) - 1, 0.01)


def test_power_note_states_the_figures():
    r = paired_from_counts(1319, 1000, b=5, c=3)
    assert r.power_note.startswith("With n=1319 paired questions and 8 discordant (0.6%)")
    assert f"a true drop of {100 * r.mde:.2f} points is detected with 80% power" in r.power_note
    assert "needs 4.84 points and accepts drops up to 3.20" in r.power_note


# ----------------------------------------------------------- joining outcomes


def _outcomes(both_right, b, c, both_wrong):
    """Reference and candidate dicts with the given 2x2 table, keyed like the evals do."""
    ref, cand, i = {}, {}, 0
    for n, r, cd in ((both_right, True, True), (b, True, False), (c, False, True), (both_wrong, False, False)):
        for _ in range(n):
            key = f"gsm8k-{i:04d}:{i * 7919 % 65536:04x}"
            ref[key], cand[key] = r, cd
            i += 1
    return ref, cand


def test_paired_test_from_dicts_matches_counts():
    ref, cand = _outcomes(60, 5, 1, 34)
    r = paired_test(ref, cand)
    assert (r.n, r.ref_correct, r.cand_correct, r.b, r.c) == (100, 65, 61, 5, 1)
    assert r.to_dict() == paired_from_counts(100, 65, 5, 1).to_dict()
    json.dumps(r.to_dict(), allow_nan=False)


def test_pair_outcomes_joins_by_key_and_accepts_numpy_bools():
    rows = pair_outcomes({"b": True, "a": np.bool_(False)}, {"a": 1, "b": False})
    assert rows == [("a", False, True), ("b", True, False)]


def test_pair_outcomes_names_missing_keys():
    ref = {f"q{i}": True for i in range(6)}
    cand = {f"q{i}": True for i in range(2)} | {"extra": False}
    with pytest.raises(
        UsageError,
        match=r"same questions on both sides: 4 only in reference \('q2', 'q3', 'q4', \.\.\.\); "
        r"1 only in candidate \('extra'\)$",
    ):
        pair_outcomes(ref, cand)


@pytest.mark.parametrize(
    "ref, cand, message",
    [
        ({}, {}, "at least one question, got none"),
        ({"a": "yes"}, {"a": True}, "reference outcome for 'a' must be a bool, got 'yes'"),
        ({"a": True}, {"a": 2}, "candidate outcome for 'a' must be a bool, got 2"),
    ],
    ids=["empty", "ref-string", "cand-int2"],
)
def test_pair_outcomes_rejects_bad_input(ref, cand, message):
    with pytest.raises(UsageError, match=message):
        pair_outcomes(ref, cand)


def test_arguments_and_construction_are_validated():
    with pytest.raises(ValueError, match="alpha must be in \\(0, 0.5\\), got 0.7"):
        paired_from_counts(100, 50, 1, 1, alpha=0.7)
    with pytest.raises(ValueError, match="margin is a fraction \\(0.01 = 1 point\\), must be in \\[0, 1\\), got 1"):
        paired_from_counts(100, 50, 1, 1, margin=1)
    with pytest.raises(ValueError, match="discordant counts b=60, c=0 do not fit n=100, ref_correct=50"):
        paired_from_counts(100, 50, 60, 0)
    good = paired_from_counts(100, 50, 1, 1)
    with pytest.raises(ValueError, match="cand_correct must equal ref_correct - b \\+ c = 50, got 49"):
        replace(good, cand_correct=49)
    with pytest.raises(ValueError, match="a pass needs lower_bound > -margin"):
        replace(good, verdict="pass")
    with pytest.raises(ValueError, match="verdict must be one of pass, fail, inconclusive, got 'maybe'"):
        replace(good, verdict="maybe")
    assert isinstance(good, PairedResult)


# -------------------------------------------------------------------- Wilson


def test_wilson_interval_known_values():
    z2 = normal_ppf(0.975) ** 2
    assert wilson_interval(0, 10) == (0.0, pytest.approx(z2 / (10 + z2)))  # 0.2775
    lo, hi = wilson_interval(15, 20)
    assert (lo, hi) == (pytest.approx(0.5313, abs=1e-4), pytest.approx(0.8881, abs=1e-4))
    lo_m, hi_m = wilson_interval(5, 20)
    assert (lo_m, hi_m) == (pytest.approx(1 - hi), pytest.approx(1 - lo)), "k and n-k mirror"
    assert wilson_interval(20, 20)[1] == 1.0
    narrow, wide = wilson_interval(15, 20, alpha=0.2), wilson_interval(15, 20, alpha=0.01)
    assert wide[0] < lo < narrow[0] < 0.75 < narrow[1] < hi < wide[1]


def test_wilson_interval_rejects_bad_counts():
    with pytest.raises(ValueError, match="n > 0 and 0 <= k <= n, got k=5, n=4"):
        wilson_interval(5, 4)
