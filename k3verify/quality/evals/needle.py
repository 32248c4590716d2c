"""RULER-style needle in a haystack, built from no external text.

The haystack repeats five short noise sentences; the needle is "One of the
special magic numbers for {key} is: {value}." with a word-pair key and a
7-digit value, placed at a depth fraction of the haystack; optional distractor
needles carry other keys and values. The prompt ends with RULER's answer
prefix so a base model continues with the number.

Lengths are counted in tokens of a caller-given tokenizer (text -> ids). Pieces
are measured once and summed, which is exact for the byte tokenizer used in
this project (1 byte = 1 token); for other tokenizers the full prompt is
measured at the end and the filler corrected, so a 108K case still costs only
a handful of tokenizer calls.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

from optimized_stack.errors import K3Error

Tokenize = Callable[[str], Sequence[int]]

NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.",
         "Here we go.", "There and back again.")
HEADER = ("Some special magic numbers are hidden within the following text. "
          "Make sure to memorize it. I will quiz you about the numbers afterwards.\n")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "\nWhat is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = " The special magic number for {key} mentioned in the provided text is"
TOLERANCE_TOKENS = 4  # |actual - requested| allowed for a case

# Keys are "adjective-noun" pairs: 40 * 40 = 1600 keys, plenty for a grid plus distractors.
ADJECTIVES = (
    "ancient", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly",
    "keen", "lively", "misty", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy",
    "upbeat", "vivid", "witty", "young", "zesty", "amber", "bold", "crisp", "dim", "early",
    "faint", "grand", "humble", "idle", "loyal", "mellow", "narrow", "plain", "rustic", "sleek",
)
NOUNS = (
    "anchor", "basket", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island",
    "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river",
    "saddle", "tunnel", "umbrella", "valley", "wagon", "yarrow", "zephyr", "beacon", "cabinet",
    "desert", "ember", "fountain", "glacier", "hammer", "ivory", "jungle", "kingdom", "ladder",
    "mirror", "nutmeg", "otter", "pillow",
)


def byte_tokenize(text: str) -> list[int]:
    """The project's tokenizer for lengths: one UTF-8 byte is one token."""
    return list(text.encode("utf-8"))


@dataclass(frozen=True)
class Needle:
    key: str
    value: str
    depth: float  # fraction of the haystack before the needle, 0..1
    char_offset: int  # where the needle sentence starts in the prompt


@dataclass(frozen=True)
class NeedleCase:
    prompt: str
    answer: str  # the 7-digit value
    key: str
    depth: float
    length_tokens: int  # measured length of `prompt`
    requested_tokens: int
    seed: int
    needle_offset: int  # character offset of the needle sentence in `prompt`
    haystack_span: tuple[int, int]  # [start, end) characters of the haystack in `prompt`
    distractors: tuple[Needle, ...] = field(default=())

    def __post_init__(self):
        if not re.fullmatch(r"[1-9][0-9]{6}", self.answer):
            raise K3Error(f"answer must be a 7-digit number, got {self.answer!r}")
        if not 0.0 <= self.depth <= 1.0:
            raise K3Error(f"depth must be in [0, 1], got {self.depth!r}")

    @property
    def name(self) -> str:
        return f"L{self.requested_tokens}-d{round(self.depth * 100)}-s{self.seed}"


def _rng(*parts) -> random.Random:
    key = "|".join(str(p) for p in ("needle", *parts)).encode()
    return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))


def _keys_values(rng: random.Random, n: int) -> list[tuple[str, str]]:
    pairs = rng.sample([(a, b) for a in ADJECTIVES for b in NOUNS], n)
    values = rng.sample(range(1_000_000, 10_000_000), n)
    return [(f"{a}-{b}", str(v)) for (a, b), v in zip(pairs, values)]


def _fill(budget: int, unit_tokens: list[int]) -> list[int]:
    """Indices into NOISE whose token counts sum to exactly `budget` when possible.

    Whole cycles of the five sentences first, then a short exact tail found by a
    small change-making search over the sentence lengths; if no exact tail
    exists, the closest shorter one.
    """
    cycle = sum(unit_tokens)
    n_cycles = max(0, budget // cycle - 2)  # leave two cycles for the exact tail
    order = list(range(len(NOISE))) * n_cycles
    rest = budget - n_cycles * cycle
    # best[t] = sentence indices summing to exactly t tokens (coin-change table)
    best: dict[int, list[int]] = {0: []}
    for total in range(1, rest + 1):
        for i, u in enumerate(unit_tokens):
            prev = best.get(total - u)
            if prev is not None:
                best[total] = prev + [i]
                break
    reachable = max(t for t in best if t <= rest)
    return order + sorted(best[reachable])


def _layout(haystack_tokens: int, depths: list[float], pieces: list[str],
            tokenize: Tokenize) -> tuple[str, list[int]]:
    """Noise with each piece inserted at the sentence boundary nearest its depth."""
    units = [" " + s for s in NOISE]
    unit_tokens = [len(tokenize(u)) for u in units]
    piece_tokens = sum(len(tokenize(" " + p)) for p in pieces)
    # +1: every unit and piece carries a leading space, and the haystack's first one is dropped
    order = _fill(max(0, haystack_tokens - piece_tokens + 1), unit_tokens)
    prefix_tokens = [0]
    for i in order:
        prefix_tokens.append(prefix_tokens[-1] + unit_tokens[i])
    noise_total = prefix_tokens[-1]
    # slot k = "before noise sentence k"; later slots for equal depths keep input order
    slots = [_nearest(prefix_tokens, d * noise_total) for d in depths]
    parts: list[str] = []
    offsets = [0] * len(pieces)
    by_slot = sorted(range(len(pieces)), key=lambda p: (slots[p], p))
    cursor, pos = 0, 0  # cursor: next noise sentence; pos: characters written so far
    for p in by_slot:
        chunk = "".join(units[i] for i in order[cursor:slots[p]])
        parts.append(chunk)
        pos += len(chunk)
        cursor = slots[p]
        offsets[p] = pos + 1  # after the separating space
        parts.append(" " + pieces[p])
        pos += 1 + len(pieces[p])
    parts.append("".join(units[i] for i in order[cursor:]))
    return "".join(parts)[1:], [o - 1 for o in offsets]  # drop the leading space


def _nearest(sorted_values: list[int], target: float) -> int:
    j = bisect.bisect_left(sorted_values, target)
    if j == 0:
        return 0
    if j == len(sorted_values):
        return j - 1
    return j if sorted_values[j] - target < target - sorted_values[j - 1] else j - 1


def make_case(length_tokens: int, depth: float, seed: int, tokenize: Tokenize = byte_tokenize,
              n_distractors: int = 0) -> NeedleCase:
    """One needle case whose prompt is `length_tokens` long (within TOLERANCE_TOKENS)."""
    if not 0.0 <= depth <= 1.0:
        raise K3Error(f"depth must be in [0, 1], got {depth!r}")
    if not 0 <= n_distractors <= 50:
        raise K3Error(f"n_distractors must be in 0..50, got {n_distractors!r}")
    rng = _rng(seed, length_tokens, depth, n_distractors)
    (key, value), *others = _keys_values(rng, 1 + n_distractors)
    needle = NEEDLE.format(key=key, value=value)
    distractor_depths = [rng.random() for _ in others]
    pieces = [needle] + [NEEDLE.format(key=k, value=v) for k, v in others]
    depths = [depth] + distractor_depths
    head, tail = HEADER, QUESTION.format(key=key) + ANSWER_PREFIX.format(key=key)
    fixed = len(tokenize(head)) + len(tokenize(tail))
    minimum = fixed + sum(len(tokenize(" " + p)) for p in pieces)
    if length_tokens < minimum + 30:
        raise K3Error(f"length_tokens must be at least {minimum + 30} for this case "
                      f"(header, question and needles alone take {minimum}), got {length_tokens}")
    budget = length_tokens - fixed
    for _ in range(4):  # correct for tokenizers whose counts are not additive
        haystack, offsets = _layout(budget, depths, pieces, tokenize)
        prompt = head + haystack + tail
        actual = len(tokenize(prompt))
        if abs(actual - length_tokens) <= TOLERANCE_TOKENS:
            break
        budget += length_tokens - actual
    start = len(head)
    distractors = tuple(Needle(k, v, d, start + o)
                        for (k, v), d, o in zip(others, distractor_depths, offsets[1:]))
    return NeedleCase(prompt=prompt, answer=value, key=key, depth=depth, length_tokens=actual,
                      requested_tokens=length_tokens, seed=seed, needle_offset=start + offsets[0],
                      haystack_span=(start, start + len(haystack)), distractors=distractors)


def grid(lengths: Sequence[int], depths: Sequence[float], seed: int = 0,
         tokenize: Tokenize = byte_tokenize, n_distractors: int = 0) -> list[NeedleCase]:
    """Every (length, depth) pair, lengths outer; each case has its own key and value."""
    if not lengths or not depths:
        raise K3Error(f"grid needs at least one length and one depth, got {lengths!r}, {depths!r}")
    return [make_case(L, d, seed, tokenize, n_distractors) for L in lengths for d in depths]


def score(output_text: str, case: NeedleCase) -> bool:
    """True when the exact 7-digit value appears in the output as a whole number."""
    return re.search(rf"(?<![0-9]){case.answer}(?![0-9])", output_text) is not None


def recall(outputs: Sequence[str], cases: Sequence[NeedleCase]) -> float:
    if len(outputs) != len(cases):
        raise K3Error(f"expected one output per case ({len(cases)}), got {len(outputs)}")
    if not cases:
        raise K3Error("recall needs at least one case, got none")
    return sum(score(o, c) for o, c in zip(outputs, cases)) / len(cases)
