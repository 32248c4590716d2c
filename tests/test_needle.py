"""needle: deterministic RULER-style cases of exact length with the needle where asked."""

import time

import pytest

from k3verify.quality.evals import needle
from k3verify.quality.evals.needle import NEEDLE, TOLERANCE_TOKENS, make_case, score
from optimized_stack.errors import K3Error
from optimized_stack.tokenizer import ByteTokenizer

LONGEST_SENTENCE = max(len(" " + s) for s in needle.NOISE)


def pair_tokenize(text: str) -> range:
    """A tokenizer whose counts do not add up piece by piece (2 bytes per token, rounded up)."""
    return range((len(text.encode()) + 1) // 2)


def needle_fraction(case) -> float:
    """Share of the haystack's noise that lies before the needle."""
    start, end = case.haystack_span
    noise = (end - start) - len(" " + NEEDLE.format(key=case.key, value=case.answer))
    return (case.needle_offset - start) / noise


def test_same_inputs_same_case_other_seed_other_case():
    a, b = make_case(2048, 0.3, seed=11), make_case(2048, 0.3, seed=11)
    c = make_case(2048, 0.3, seed=12)
    assert a == b, "same (length, depth, seed) must give the same case"
    assert (c.key, c.answer) != (a.key, a.answer) and c.prompt != a.prompt


@pytest.mark.parametrize("length", [600, 1000, 4096, 10_000, 32_768], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0], ids=lambda d: f"d{round(d * 100)}")
def test_length_is_exact_for_the_byte_tokenizer(length, depth):
    case = make_case(length, depth, seed=1, n_distractors=2)
    measured = len(ByteTokenizer().encode(case.prompt))
    assert measured == case.length_tokens, "recorded length must be the prompt's real length"
    assert abs(measured - length) <= TOLERANCE_TOKENS, f"asked {length}, got {measured}"


@pytest.mark.parametrize("length", [700, 5000], ids=lambda n: f"L{n}")
def test_length_within_tolerance_for_a_non_additive_tokenizer(length):
    case = make_case(length, 0.5, seed=2, tokenize=pair_tokenize)
    assert abs(len(pair_tokenize(case.prompt)) - length) <= TOLERANCE_TOKENS


def test_108k_case_is_fast_and_exact():
    started = time.perf_counter()
    case = make_case(108_000, 0.5, seed=0, n_distractors=3)
    seconds = time.perf_counter() - started
    assert seconds < 0.5, f"108K case took {seconds:.2f} s, budget 0.5 s"
    assert abs(len(case.prompt.encode()) - 108_000) <= TOLERANCE_TOKENS


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0], ids=lambda d: f"d{round(d * 100)}")
@pytest.mark.parametrize("length", [1200, 16_000], ids=lambda n: f"L{n}")
def test_needle_sits_at_the_requested_depth(length, depth):
    case = make_case(length, depth, seed=4)
    needle_text = NEEDLE.format(key=case.key, value=case.answer)
    assert case.prompt[case.needle_offset:].startswith(needle_text)
    assert case.prompt.count(case.answer) == 1 and case.prompt.count(needle_text) == 1
    noise = case.haystack_span[1] - case.haystack_span[0] - len(needle_text)
    allowed = LONGEST_SENTENCE / noise  # one sentence: needles sit on sentence boundaries
    assert abs(needle_fraction(case) - depth) <= allowed, \
        f"needle at {needle_fraction(case):.4f} of the haystack, asked {depth}"
    assert case.prompt.endswith(needle.ANSWER_PREFIX.format(key=case.key))
    assert needle.QUESTION.format(key=case.key) in case.prompt


def test_position_check_can_fail():
    # negative control: a case built for depth 0.1 is not at depth 0.9
    case = make_case(4096, 0.1, seed=4)
    assert abs(needle_fraction(case) - 0.9) > 0.5


def test_distractors_have_other_keys_and_values():
    case = make_case(8000, 0.5, seed=5, n_distractors=6)
    keys = [case.key] + [d.key for d in case.distractors]
    values = [case.answer] + [d.value for d in case.distractors]
    assert len(set(keys)) == 7 and len(set(values)) == 7
    for d in case.distractors:
        assert case.prompt[d.char_offset:].startswith(NEEDLE.format(key=d.key, value=d.value))
        assert not score(f"The number is {d.value}.", case), "a distractor value must not score"
    assert case.prompt.count(f"magic number for {case.key} ") == 2  # question + answer prefix


def test_score_exact_value_only():
    case = make_case(1000, 0.5, seed=6)
    v = case.answer
    assert score(f" {v}.", case)
    assert score(f"The special magic number is {v}", case)
    wrong = str(int(v[0]) % 9 + 1) + v[1:]  # first digit changed, still 7 digits
    assert not score(f" {wrong}.", case), "wrong digits must not score"
    assert not score(f" {v[:-1]}.", case), "six of seven digits must not score"
    assert not score(f" 9{v}.", case), "the value inside a longer number must not score"
    assert not score("", case)


def test_grid_covers_every_pair_with_its_own_key():
    cases = needle.grid([1000, 2000], [0.0, 0.5, 1.0], seed=3)
    assert [(c.requested_tokens, c.depth) for c in cases] == \
        [(L, d) for L in (1000, 2000) for d in (0.0, 0.5, 1.0)]
    assert len({c.key for c in cases}) == len(cases)
    assert needle.recall([c.answer for c in cases], cases) == 1.0
    assert needle.recall(["nothing"] * len(cases), cases) == 0.0


def test_bad_input_is_refused():
    with pytest.raises(K3Error, match=r"depth must be in \[0, 1\], got 1.5"):
        make_case(1000, 1.5, seed=0)
    with pytest.raises(K3Error, match=r"length_tokens must be at least \d+ for this case .* got 100"):
        make_case(100, 0.5, seed=0)
    with pytest.raises(K3Error, match="grid needs at least one length and one depth"):
        needle.grid([], [0.5])
    with pytest.raises(K3Error, match=r"expected one output per case \(1\), got 2"):
        needle.recall(["a", "b"], [make_case(1000, 0.5, seed=0)])
