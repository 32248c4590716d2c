"""k3verify.compare: ULP distance (ulp.py), bitwise/tolerance findings, logit distances, hashes (tensors.py)."""

import json
import math

import pytest
import torch

from k3verify.compare.tensors import Finding, compare_logits, compare_tensors, first_divergence, hash_tensor
from k3verify.compare.ulp import HIST_LABELS, ULP_MAX, ulp_distance, ulp_histogram

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
FLOAT_IDS = ["fp16", "bf16", "fp32", "fp64"]


def _next_up(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, math.inf))


def _next_down(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, -math.inf))


def _seeded(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


# ---------------------------------------------------------------- ulp_distance


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_adjacent_floats_are_one_ulp_apart(dtype):
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([1.0, -3.5, 1e-3, -1e-3, 100.0, tiny, -tiny], dtype=dtype)
    assert ulp_distance(x, _next_up(x)).tolist() == [1] * len(x), "nextafter up must be 1 ULP away"
    assert ulp_distance(_next_down(x), x).tolist() == [1] * len(x), "distance is symmetric in order"
    assert ulp_distance(x, x).tolist() == [0] * len(x)


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_ulp_across_zero(dtype):
    zero, neg_zero = torch.tensor([0.0], dtype=dtype), torch.tensor([-0.0], dtype=dtype)
    smallest = _next_up(zero)  # smallest positive subnormal
    assert ulp_distance(zero, neg_zero).item() == 0, "-0 and +0 are the same point on the line"
    assert ulp_distance(smallest, zero).item() == 1
    assert ulp_distance(smallest, neg_zero).item() == 1
    assert ulp_distance(-smallest, smallest).item() == 2, "-tiny .. 0 .. +tiny is two steps"


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_ulp_infinities_and_nan(dtype):
    big = torch.finfo(dtype).max
    a = torch.tensor([math.inf, -math.inf, math.nan, math.nan, 1.0], dtype=dtype)
    b = torch.tensor([big, -big, math.nan, 1.0, math.nan], dtype=dtype)
    assert ulp_distance(a, b).tolist() == [1, 1, 0, ULP_MAX, ULP_MAX]


def test_ulp_nan_payloads_differ():
    quiet = torch.tensor([math.nan], dtype=torch.float32)
    payload = (quiet.view(torch.int32) + 1).view(torch.float32)
    assert torch.isnan(payload).all()
    assert ulp_distance(quiet, payload).item() == 1, "NaNs with different bits are not 0 apart"


def test_ulp_float64_saturates_instead_of_wrapping():
    a = torch.tensor([-math.inf, -1e308], dtype=torch.float64)
    b = torch.tensor([math.inf, 1e308], dtype=torch.float64)
    assert ulp_distance(a, b).tolist() == [ULP_MAX, ULP_MAX]


def test_ulp_rejects_ints_and_mixed_dtypes():
    with pytest.raises(ValueError, match="a must be a float tensor .* got torch.int64"):
        ulp_distance(torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="equal dtype and shape, got torch.float32\\[1\\] and torch.float64\\[1\\]"):
        ulp_distance(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))


def test_ulp_histogram_bins():
    ulps = torch.tensor([0, 0, 1, 2, 3, 4, 7, 8, 1 << 19, (1 << 20) - 1, 1 << 20, ULP_MAX])
    hist = dict(ulp_histogram(ulps))
    assert list(hist) == HIST_LABELS
    assert HIST_LABELS[:5] == ["0", "1", "2-3", "4-7", "8-15"] and HIST_LABELS[-1] == ">=1048576"
    assert (hist["0"], hist["1"], hist["2-3"], hist["4-7"], hist["8-15"]) == (2, 1, 2, 2, 1)
    assert hist["524288-1048575"] == 2 and hist[">=1048576"] == 2
    assert sum(hist.values()) == len(ulps)


# ------------------------------------------------------------- compare_tensors


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("where", [(0, 0), (2, 5), (3, 15)], ids=["first", "middle", "last"])
def test_one_ulp_perturbation_found_exactly(dtype, where):
    # Negative control: the comparator must see a single one-ULP fault and point at it.
    ref = _seeded((4, 16), dtype)
    cand = ref.clone()
    cand[where] = _next_up(cand[where])
    f = compare_tensors(ref, cand, label="x")
    assert not f.passed and not f.equal
    assert (f.n_mismatched, f.n_bit_different, f.n_total) == (1, 1, 64)
    assert f.max_ulp == 1 and f.max_ulp_index == where
    assert f.first_index_tuple == where and f.first_index == where[0] * 16 + where[1]
    assert f.max_abs_index == where and f.max_abs > 0
    assert dict(f.ulp_histogram)["1"] == 1 and dict(f.ulp_histogram)["0"] == 63


def test_identical_tensors_pass_bitwise():
    ref = _seeded((8, 8))
    f = compare_tensors(ref, ref.clone(), label="same")
    assert f.passed and f.equal and f.mode == "bitwise"
    assert (f.n_mismatched, f.max_ulp, f.max_abs, f.first_index) == (0, 0, 0.0, None)
    assert f.message() == "'same' [8, 8] float32: bitwise equal (64 elements)"


def test_known_mismatch_counts_and_indices():
    ref = torch.ones(4, 16)
    cand = ref.clone()
    cand[1, 7] = (ref[1, 7].view(torch.int32) + 12).view(torch.float32)  # 12 ULP up
    cand[2, 2] = 1.0 + 2**-22  # 2 ULP
    cand[3, 0] = 1.0 - 2**-24  # 1 ULP down (spacing halves below 1.0)
    f = compare_tensors(ref, cand, label="logits[step 3]")
    assert (f.n_mismatched, f.n_total) == (3, 64)
    assert (f.max_ulp, f.max_ulp_index) == (12, (1, 7))
    assert f.max_abs == pytest.approx(12 * 2**-23) and f.max_abs_index == (1, 7)
    assert f.median_ulp == 2
    assert f.first_index == 23 and f.first_index_tuple == (1, 7)
    assert f.first_ref == "1.0 (0x3f800000)" and f.first_cand == "1.0000014 (0x3f80000c)"
    lines = f.message().splitlines()
    assert lines[0] == "Tensor-likes are not equal!"
    assert "Mismatched elements: 3 / 64 (4.7%)" in lines
    assert "Greatest absolute difference: 1.4e-06 at index (1, 7) (up to 0 allowed)" in lines
    assert "Greatest ULP distance: 12 at index (1, 7)" in lines
    assert "ULP histogram: 0: 61 | 1: 1 | 2-3: 1 | 8-15: 1" in lines
    assert "First difference at index (1, 7) (flat 23): ref 1.0 (0x3f800000) vs cand 1.0000014 (0x3f80000c)" in lines
    assert lines[-1] == "The failure occurred for 'logits[step 3]' [4, 16] float32."


def test_signed_zero_differs_bitwise_only():
    ref, cand = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    bitwise = compare_tensors(ref, cand, label="z")
    assert not bitwise.passed and bitwise.n_mismatched == 1 and bitwise.max_ulp == 0
    assert "ref 0.0 (0x00000000) vs cand -0.0 (0x80000000)" in bitwise.message()
    assert compare_tensors(ref, cand, label="z", max_ulp=0).n_mismatched == 1, "max_ulp=0 is bitwise"
    loose = compare_tensors(ref, cand, label="z", max_ulp=1)
    assert loose.passed and not loose.equal and loose.mode == "tolerance"


def test_nan_handling_bitwise_vs_tolerance():
    quiet = torch.tensor([math.nan, 2.0])
    other_payload = quiet.clone()
    other_payload[0] = (quiet[0].view(torch.int32) + 1).view(torch.float32)
    assert not compare_tensors(quiet, other_payload, label="n").passed, "bitwise sees NaN payloads"
    assert compare_tensors(quiet, other_payload, label="n", atol=1e-6).passed, "tolerance: NaN == NaN"
    assert compare_tensors(quiet, quiet.clone(), label="n").equal

    one_side = compare_tensors(torch.tensor([1.0, 2.0]), torch.tensor([math.nan, 2.5]), label="n", atol=1.0)
    assert not one_side.passed and one_side.n_nan_mismatch == 1 and one_side.n_mismatched == 1
    assert one_side.max_abs == 0.5 and one_side.max_abs_index == (1,), "NaN is excluded from the max"
    assert "NaN on one side only: 1" in one_side.message()
    assert "Greatest ULP distance: NaN vs number at index (0,)" in one_side.message()


def test_tolerances_atol_rtol_ulp():
    ref = torch.tensor([1.0, 100.0, 0.0])
    cand = torch.tensor([1.001, 100.05, 0.0])
    assert compare_tensors(ref, cand, label="t", atol=2e-3, rtol=1e-3).passed
    tight = compare_tensors(ref, cand, label="t", atol=2e-3)
    assert not tight.passed and tight.n_mismatched == 1 and tight.max_abs_index == (1,)
    assert tight.message().startswith("Tensor-likes are not close!")
    assert "(up to 0.002 allowed)" in tight.message()
    # 1.001 is 8389 ULP above 1.0 (0x3f8020c5); 100.05 is 6554 ULP above 100.0.
    ulp_budget = compare_tensors(ref, cand, label="t", max_ulp=8000)
    assert not ulp_budget.passed and ulp_budget.n_mismatched == 1
    assert (ulp_budget.max_ulp, ulp_budget.max_ulp_index) == (8389, (0,))
    assert "Greatest ULP distance: 8389 at index (0,) (up to 8000 allowed)" in ulp_budget.message()
    assert compare_tensors(ref, cand, label="t", max_ulp=8389).passed


def test_relative_difference_against_zero_reference_is_inf():
    f = compare_tensors(torch.tensor([0.0, 1.0]), torch.tensor([1e-30, 1.0]), label="r")
    assert f.max_rel == math.inf and f.max_rel_index == (0,)
    json.dumps(f.to_dict(), allow_nan=False)


@pytest.mark.parametrize(
    "cand, expected",
    [
        (torch.zeros(4, 3), "'shape' do not match: [4, 4] != [4, 3]"),
        (torch.zeros(4, 4, dtype=torch.float64), "'dtype' do not match: torch.float32 != torch.float64"),
    ],
    ids=["shape", "dtype"],
)
def test_structure_checked_before_values(cand, expected):
    f = compare_tensors(torch.zeros(4, 4), cand, label="s")
    assert not f.passed and not f.equal and f.problem is not None
    assert f.max_ulp is None and f.max_abs is None, "values are not compared across structures"
    assert expected in f.message() and f.message().startswith("Tensor-likes are not comparable!")


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="ref must be a torch.Tensor, got list"):
        compare_tensors([1.0], torch.tensor([1.0]), label="x")
    with pytest.raises(ValueError, match="tolerances must be >= 0, got atol=-1"):
        compare_tensors(torch.tensor([1.0]), torch.tensor([1.0]), label="x", atol=-1)


def test_integer_empty_and_scalar_tensors():
    ints = compare_tensors(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]), label="ids")
    assert (ints.n_mismatched, ints.max_abs, ints.max_ulp, ints.first_index) == (1, 1.0, None, 2)
    assert "ref 3 vs cand 4" in ints.message()
    empty = compare_tensors(torch.zeros(0, 5), torch.zeros(0, 5), label="e")
    assert empty.passed and empty.equal and empty.n_total == 0
    scalar = compare_tensors(torch.tensor(1.0), torch.tensor(2.0), label="s")
    assert scalar.max_abs_index == () and scalar.n_mismatched == 1


def test_finding_to_dict_is_strict_json():
    ref = torch.tensor([1.0, math.inf, 3.0])
    cand = torch.tensor([math.nan, -math.inf, 3.0])
    d = compare_tensors(ref, cand, label="j").to_dict()
    text = json.dumps(d, allow_nan=False)
    assert json.loads(text)["max_abs"] == "inf" and d["ulp_histogram"][0][0] == "0"


def test_finding_validates_on_construction():
    with pytest.raises(ValueError, match="passed=True with a structural problem or mismatched elements"):
        Finding(what="x", shape=(1,), dtype="float32", mode="bitwise", atol=0, rtol=0,
                max_ulp_allowed=None, n_total=1, n_mismatched=1, n_bit_different=1,
                n_nan_mismatch=0, equal=False, passed=True)


# -------------------------------------------------------------- compare_logits


def test_identical_logits_have_zero_kl_and_full_agreement():
    logits = _seeded((5, 272), seed=3)
    f = compare_logits(logits, logits.clone(), label="logits")
    assert f.passed and f.equal
    assert (f.kl_max, f.kl_mean, f.argmax_flips, f.top1_agreement) == (0.0, 0.0, 0, 1.0)


def test_kl_matches_hand_computation():
    # p = [1/2, 1/2], q = [3/4, 1/4]: KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3).
    ref = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    cand = torch.tensor([[math.log(3.0), 0.0], [1.0, 2.0]])
    f = compare_logits(ref, cand, label="logits")
    assert f.kl_max == pytest.approx(0.5 * math.log(4.0 / 3.0), rel=1e-6)
    assert f.kl_max_row == 0 and f.kl_mean == pytest.approx(0.25 * math.log(4.0 / 3.0), rel=1e-6)
    assert "KL(ref || cand): max 1.438e-01 at row 0, mean 7.192e-02" in f.message()


def test_kl_ignores_masked_vocab_entries():
    ref = torch.tensor([[0.0, -math.inf, 0.0]])
    f = compare_logits(ref, ref.clone(), label="masked")
    assert f.kl_max == 0.0 and f.equal


def test_argmax_flip_detection():
    ref = torch.tensor([[1.0, 3.0, 2.0], [5.0, 0.0, 0.0], [0.0, 1.0, 9.0], [2.0, 1.0, 0.0]])
    cand = ref.clone()
    cand[1] = torch.tensor([5.0, 6.0, 0.0])  # flip 0 -> 1
    cand[3] = torch.tensor([2.0, 1.0, 2.5])  # flip 0 -> 2
    f = compare_logits(ref, cand, label="logits")
    assert (f.argmax_flips, f.first_flip_row, f.first_flip_tokens) == (2, 1, (0, 1))
    assert f.top1_agreement == 0.5 and not f.passed
    assert "Argmax flips: 2 / 4 rows (first at row 1: ref 0 vs cand 1)" in f.message()
    assert "Top-1 agreement: 50.00%" in f.message()


def test_small_logit_drift_keeps_argmax_but_fails_bitwise():
    # Negative control for "exact": a one-ULP drift flips nothing yet must not pass.
    ref = _seeded((3, 64), seed=7)
    cand = ref.clone()
    cand[2, 10] = _next_up(cand[2, 10])
    f = compare_logits(ref, cand, label="logits")
    assert not f.passed and f.argmax_flips == 0 and f.max_ulp_index == (2, 10) and f.kl_max >= 0


def test_compare_logits_rejects_non_2d_and_reports_shape_mismatch():
    with pytest.raises(ValueError, match=r"ref_logits must be a 2-D \[N, V\] tensor, got shape \[4\]"):
        compare_logits(torch.zeros(4), torch.zeros(4), label="l")
    f = compare_logits(torch.zeros(2, 4), torch.zeros(2, 5), label="l")
    assert not f.passed and f.kl_max is None and "'shape' do not match" in f.message()


# ------------------------------------------------------ divergence and hashing


@pytest.mark.parametrize(
    "ref, cand, expected",
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3, 4], [1, 2, 9, 4], 2),
        ([5, 2], [1, 2], 0),
        ([1, 2, 3], [1, 2], 2),
        ([], [], None),
        (torch.tensor([7, 8, 9]), torch.tensor([7, 8, 1]), 2),
    ],
    ids=["same", "step2", "step0", "cand-stops-early", "empty", "tensors"],
)
def test_first_divergence(ref, cand, expected):
    assert first_divergence(ref, cand) == expected


def test_hash_equal_for_equal_bits_and_different_otherwise():
    x = _seeded((4, 8))
    assert hash_tensor(x) == hash_tensor(x.clone())
    assert hash_tensor(x.t().contiguous().t()) == hash_tensor(x), "layout does not matter"
    y = x.clone()
    y[3, 7] = _next_up(y[3, 7])
    assert hash_tensor(y) != hash_tensor(x), "a one-ULP change must change the hash"
    assert hash_tensor(torch.tensor([0.0])) != hash_tensor(torch.tensor([-0.0]))
    assert hash_tensor(x.reshape(8, 4)) != hash_tensor(x), "shape is part of the hash"
    assert hash_tensor(x).startswith("float32[4,8]:")


@pytest.mark.parametrize("dtype", FLOATS + [torch.int64, torch.bool], ids=FLOAT_IDS + ["int64", "bool"])
def test_hash_every_dtype(dtype):
    t = torch.ones(3, dtype=dtype)
    h = hash_tensor(t)
    assert h.split("[")[0] == str(dtype).removeprefix("torch.") and len(h.split(":")[1]) == 32
