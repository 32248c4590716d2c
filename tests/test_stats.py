"""k3verify.stats: paired accuracy statistics checked against hand-computed tables."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from k3verify.stats import (
    PairedResult,
    binom_cdf,
    mcnemar_exact_p,
    normal_cdf,
    normal_ppf,
    pair_outcomes,
    paired_from_counts,
    paired_mde,
    paired_test,
    trtllm_threshold_drop,
    unpaired_mde,
    wilson_interval,
)
from k3verify.errors import UsageError

Z95 = 1.6448536269514722


# ------------------------------------------------------------------ primitives


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
    assert binom_cdf(1, 6, 0.5) == 7 / 64
    assert binom_cdf(-1, 6, 0.5) == 0.0 and binom_cdf(6, 6, 0.3) == 1.0
    for k, n, p in [(3, 10, 0.3), (0, 5, 0.9), (40, 100, 0.45)]:
        exact = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))
        assert binom_cdf(k, n, p) == pytest.approx(exact, rel=1e-10)
    # Large n stays exact: by symmetry P(X <= n/2 - 1) = (1 - P(X = n/2)) / 2.
    middle = math.comb(5000, 2500) / 2**5000
    assert binom_cdf(2499, 5000, 0.5) == pytest.approx((1 - middle) / 2, rel=1e-12)


@pytest.mark.parametrize(
    "b, c, p",
    [(5, 1, 0.21875), (1, 5, 0.21875), (0, 0, 1.0), (3, 3, 1.0), (0, 6, 2 / 64), (10, 0, 2 / 1024)],
    ids=["b5-c1", "b1-c5", "none", "tie", "b0-c6", "b10-c0"],
)
def test_mcnemar_exact_table(b, c, p):
    assert mcnemar_exact_p(b, c) == pytest.approx(p, rel=1e-12)


# ---------------------------------------------------------- paired test tables


def test_b5_c1_n100_table():
    r = paired_from_counts(100, 65, b=5, c=1)
    assert (r.cand_correct, r.acc_ref, r.acc_cand) == (61, 0.65, 0.61)
    assert r.d == pytest.approx(-0.04)
    assert r.se == pytest.approx(math.sqrt(6 - 16 / 100) / 100)  # 0.0241661
    assert r.mcnemar_p == pytest.approx(0.21875)
    assert r.lower_bound == pytest.approx(-0.04 - Z95 * 0.024166091, abs=1e-8)
    assert not r.noninferior, "a 4-point observed drop cannot be shown within 1 point"
    assert r.discordance_rate == 0.06


def test_no_discordance_is_noninferior():
    r = paired_from_counts(1319, 1000, b=0, c=0)
    assert (r.mcnemar_p, r.se, r.lower_bound, r.d) == (1.0, 0.0, 0.0, 0.0)
    assert r.noninferior
    assert r.mde_discordance == pytest.approx(1 / 1319), "zero discordance floors at one pair"
    assert "(discordance floored at one pair)" in r.power_note


def test_clearly_worse_candidate_fails():
    # Negative control: the gate must be able to fail.
    r = paired_from_counts(100, 80, b=30, c=2, margin=0.01)
    assert r.se == pytest.approx(math.sqrt(32 - 28**2 / 100) / 100)
    assert r.lower_bound < -0.3 and not r.noninferior
    assert r.mcnemar_p < 1e-6


def test_few_balanced_flips_pass_at_one_point():
    r = paired_from_counts(1319, 1000, b=2, c=2)
    assert r.d == 0.0 and r.se == pytest.approx(2 / 1319)
    assert r.lower_bound == pytest.approx(-Z95 * 2 / 1319) and r.noninferior


def test_margin_decides_at_the_boundary():
    r = paired_from_counts(1000, 700, b=20, c=10)  # d = -0.01, lower bound about -0.0190
    assert not paired_from_counts(1000, 700, b=20, c=10, margin=0.01).noninferior
    assert paired_from_counts(1000, 700, b=20, c=10, margin=0.02).noninferior
    assert -0.02 < r.lower_bound < -0.01


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
