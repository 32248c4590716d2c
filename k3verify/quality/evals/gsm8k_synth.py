"""Seeded GSM8K-format word problems small enough for a ~1M-parameter byte model.

Each problem is 2-4 arithmetic steps (add, sub, mul, exact div) told as a short
everyday story; the worked answer writes every step as "a op b = c" and ends
with GSM8K's answer line "#### N", so lm-eval's gsm8k task scores it unchanged.

Split disjointness is by construction: a question belongs to the split chosen
by a hash of its own text (1 in 5 -> test), and a draw whose hash points at the
other split is redrawn. No seed can put the same question text in both splits.
Example i of a split depends only on (seed, split, i) and on the examples
before it (duplicates within a split are redrawn), so a longer run extends a
shorter one and the same seed gives the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from k3verify.io import atomic_write_text
from optimized_stack.errors import K3Error

# the split sizes the gsm8k task is built with (evals/gsm8k.py); here, where planning reads them
# without importing lm-eval (a machine without it plans a suite, its gsm8k units then error)
SYNTH_TRAIN_N = 200  # few-shot pool; more would only cost generation time
SYNTH_TEST_N = 500

SPLITS = ("train", "test")
TEST_BUCKETS = 5  # a question is "test" when its text hash is 0 mod 5
MAX_ATTEMPTS = 200  # redraws per example before giving up (space exhausted)

NAMES = [
    ("Ava", "she"), ("Ben", "he"), ("Cora", "she"), ("Dan", "he"), ("Ella", "she"),
    ("Finn", "he"), ("Gia", "she"), ("Hugo", "he"), ("Ivy", "she"), ("Jack", "he"),
    ("Kate", "she"), ("Leo", "he"), ("Mia", "she"), ("Noah", "he"), ("Olga", "she"),
    ("Paul", "he"), ("Rosa", "she"), ("Sam", "he"), ("Tina", "she"), ("Umar", "he"),
    ("Vera", "she"), ("Will", "he"), ("Xena", "she"), ("Yuri", "he"), ("Zoe", "she"),
    ("Amir", "he"), ("Beth", "she"), ("Carl", "he"), ("Dina", "she"), ("Eli", "he"),
    ("Fay", "she"), ("Gus", "he"), ("Hana", "she"), ("Ivan", "he"), ("Jade", "she"),
    ("Kai", "he"), ("Lily", "she"), ("Max", "he"), ("Nora", "she"), ("Omar", "he"),
]
ITEMS = [
    ("apple", "apples"), ("pencil", "pencils"), ("marble", "marbles"), ("cookie", "cookies"),
    ("sticker", "stickers"), ("shell", "shells"), ("egg", "eggs"), ("card", "cards"),
    ("book", "books"), ("candle", "candles"), ("orange", "oranges"), ("button", "buttons"),
    ("stamp", "stamps"), ("muffin", "muffins"), ("toy car", "toy cars"), ("ribbon", "ribbons"),
    ("peach", "peaches"), ("cupcake", "cupcakes"), ("crayon", "crayons"), ("flower", "flowers"),
]
CONTAINERS = [
    ("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("jar", "jars"),
    ("pack", "packs"), ("crate", "crates"), ("tray", "trays"),
]
SHARE_GROUPS = [("friend", "friends"), ("bag", "bags"), ("table", "tables"),
                ("classmate", "classmates"), ("plate", "plates"), ("shelf", "shelves")]
RATES = [  # (verb phrase, unit plural)
    ("reads", "pages"), ("walks", "miles"), ("saves", "dollars"), ("bakes", "cookies"),
    ("folds", "paper cranes"), ("plants", "seeds"), ("writes", "lines"), ("picks", "berries"),
]

# difficulty -> (largest small operand, largest price, cap on every number)
LEVELS = {1: (9, 9, 99), 2: (20, 15, 500), 3: (50, 25, 999)}


@dataclass(frozen=True)
class _Level:
    difficulty: int

    def __post_init__(self):
        if self.difficulty not in LEVELS:
            raise K3Error(f"difficulty must be one of {sorted(LEVELS)}, got {self.difficulty!r}")

    @property
    def small(self) -> int:
        return LEVELS[self.difficulty][0]

    @property
    def price(self) -> int:
        return LEVELS[self.difficulty][1]

    @property
    def cap(self) -> int:
        return LEVELS[self.difficulty][2]

    @property
    def max_steps(self) -> int:
        return 1 + self.difficulty  # 2, 3 or 4 steps


class _Redraw(Exception):
    """A draw broke a constraint (number too big, no divisor); draw again."""


def _ok(level: _Level, *values: int) -> None:
    # every number is at least 2 so plural nouns always read right ("1 apples")
    if any(v < 2 or v > level.cap for v in values):
        raise _Redraw


def _two_people(rng: random.Random):
    (a, pa), (b, _) = rng.sample(NAMES, 2)
    return a, pa, b


def _collection(rng: random.Random, level: _Level):
    """Containers of items, then gains and losses, maybe an equal share at the end."""
    name, pro, other = _two_people(rng)
    (cont, conts), (item, items) = rng.choice(CONTAINERS), rng.choice(ITEMS)
    a, b = rng.randint(2, level.small), rng.randint(2, min(level.small, 12))
    total = a * b
    _ok(level, total)
    q = [f"{name} has {a} {conts} of {items}. Each {cont} holds {b} {items}."]
    s = [f"{name} has {a} * {b} = {total} {items}."]
    n_steps = rng.randint(2, level.max_steps)
    share = n_steps >= 3 and rng.random() < 0.5
    for _ in range(n_steps - 1 - int(share)):
        if rng.random() < 0.5:
            c = rng.randint(2, level.small)
            new = total + c
            q.append(f"{pro.capitalize()} gets {c} more {items} from {other}.")
            s.append(f"After getting {c} more, {pro} has {total} + {c} = {new} {items}.")
        else:
            if total < 4:
                raise _Redraw
            c = rng.randint(2, total - 2)
            new = total - c
            q.append(f"{pro.capitalize()} gives {c} {items} to {other}.")
            s.append(f"After giving {c} away, {pro} has {total} - {c} = {new} {items}.")
        _ok(level, c, new)
        total = new
    if share:
        divisors = [k for k in range(2, 10) if total % k == 0 and total // k >= 2]
        if not divisors:
            raise _Redraw
        k = rng.choice(divisors)
        group, groups = rng.choice(SHARE_GROUPS)
        each = total // k
        q.append(f"{pro.capitalize()} splits the {items} equally among {k} {groups}. "
                 f"How many {items} does each {group} get?")
        s.append(f"Each {group} gets {total} / {k} = {each} {items}.")
        return q, s, each
    q.append(f"How many {items} does {name} have now?")
    return q, s, total


def _shopping(rng: random.Random, level: _Level):
    """Unit prices times counts, maybe a second purchase, maybe change from a bill."""
    name, pro, _ = _two_people(rng)
    (item, items), (item2, items2) = rng.sample(ITEMS, 2)
    a, p = rng.randint(2, level.small), rng.randint(2, level.price)
    cost = a * p
    _ok(level, cost)
    n_steps = rng.randint(2, level.max_steps)
    q = [f"{name} buys {a} {items} for ${p} each."]
    s = [f"The {items} cost {a} * {p} = ${cost}."]
    if n_steps >= 3:
        b, r = rng.randint(2, level.small), rng.randint(2, level.price)
        cost2, both = b * r, cost + b * r
        _ok(level, cost2, both)
        q.append(f"{pro.capitalize()} also buys {b} {items2} for ${r} each.")
        s.append(f"The {items2} cost {b} * {r} = ${cost2}.")
        s.append(f"Together {pro} spends {cost} + {cost2} = ${both}.")
        cost = both
    if n_steps in (2, 4):
        bills = [m for m in (10, 20, 50, 100, 200, 500) if m > cost and m <= level.cap]
        if not bills:
            raise _Redraw
        m = bills[0]
        change = m - cost
        q.append(f"{pro.capitalize()} pays with a ${m} bill. How much change does {name} get?")
        s.append(f"{name} gets {m} - {cost} = ${change} in change.")
        return q, s, change
    q.append(f"How much money does {name} spend in total?")
    return q, s, cost


def _rate(rng: random.Random, level: _Level):
    """A daily rate over days or weeks, maybe a weekend rate, maybe a goal left to reach."""
    name, pro, _ = _two_people(rng)
    verb, unit = rng.choice(RATES)
    a = rng.randint(2, level.small)
    n_steps = rng.randint(2, level.max_steps)
    if n_steps >= 3:
        b, w = rng.randint(2, level.small), rng.randint(2, 4)
        week_days, week_end = 5 * a, 2 * b
        week = week_days + week_end
        total = w * week
        _ok(level, week_days, week_end, week, total)
        q = [f"{name} {verb} {a} {unit} each weekday and {b} {unit} each day of the weekend."]
        s = [f"On weekdays {pro} {verb} 5 * {a} = {week_days} {unit}.",
             f"On the weekend {pro} {verb} 2 * {b} = {week_end} {unit}."]
        if n_steps == 3:
            s.append(f"In one week {pro} {verb} {week_days} + {week_end} = {week} {unit}.")
            q.append(f"How many {unit} does {name} get through in one week?")
            return q, s, week
        s.append(f"In one week that is {week_days} + {week_end} = {week} {unit}.")
        s.append(f"In {w} weeks {pro} {verb} {w} * {week} = {total} {unit}.")
        q.append(f"How many {unit} does {name} get through in {w} weeks?")
        return q, s, total
    d = rng.randint(2, 9)
    done = a * d
    goal = done + rng.randint(2, level.small * 3)
    _ok(level, done, goal)
    q = [f"{name} {verb} {a} {unit} every day. {pro.capitalize()} wants to reach {goal} {unit}.",
         f"How many more {unit} are needed after {d} days?"]
    s = [f"In {d} days {pro} {verb} {a} * {d} = {done} {unit}.",
         f"{name} still needs {goal} - {done} = {goal - done} {unit}."]
    return q, s, goal - done


def _compare(rng: random.Random, level: _Level):
    """Two or three people with 'more than' and 'times as many', summed at the end."""
    (n1, _), (n2, _), (n3, _) = rng.sample(NAMES, 3)
    item, items = rng.choice(ITEMS)
    a, c = rng.randint(2, level.small), rng.randint(2, level.small)
    b = a + c
    q = [f"{n1} has {a} {items}. {n2} has {c} more {items} than {n1}."]
    s = [f"{n2} has {a} + {c} = {b} {items}."]
    n_steps = rng.randint(2, level.max_steps)
    if n_steps == 2:
        total = a + b
        _ok(level, b, total)
        q.append(f"How many {items} do {n1} and {n2} have together?")
        s.append(f"Together they have {a} + {b} = {total} {items}.")
        return q, s, total
    k = rng.randint(2, 4)
    d = k * b
    q.append(f"{n3} has {k} times as many {items} as {n2}.")
    s.append(f"{n3} has {k} * {b} = {d} {items}.")
    if n_steps == 3:
        _ok(level, b, d, d - a)
        q.append(f"How many more {items} does {n3} have than {n1}?")
        s.append(f"{n3} has {d} - {a} = {d - a} more {items} than {n1}.")
        return q, s, d - a
    ab, total = a + b, a + b + d
    _ok(level, b, d, ab, total)
    q.append(f"How many {items} do the three of them have in all?")
    s.append(f"{n1} and {n2} have {a} + {b} = {ab} {items}.")
    s.append(f"All three have {ab} + {d} = {total} {items}.")
    return q, s, total


TEMPLATES = (_collection, _shopping, _rate, _compare)


def split_of(question: str) -> str:
    """The split a question text belongs to; fixed by the text, not by any seed."""
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0 else "train"


def _draw(split: str, index: int, attempt: int, seed: int, level: _Level) -> dict | None:
    key = f"gsm8k-synth|{seed}|{split}|{index}|{attempt}|{level.difficulty}".encode()
    rng = random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))
    template = rng.choice(TEMPLATES)
    try:
        q, s, result = template(rng, level)
    except _Redraw:
        return None
    question = " ".join(q)
    if split_of(question) != split:
        return None
    return {"question": question, "answer": "\n".join(s) + f"\n#### {result}"}


def generate(split: str, n: int, seed: int = 0, difficulty: int = 2) -> list[dict]:
    """n problems of `split` as GSM8K rows {"question", "answer"}, deterministic in (split, seed)."""
    if split not in SPLITS:
        raise K3Error(f"split must be one of {SPLITS}, got {split!r}")
    if not isinstance(n, int) or n < 0:
        raise K3Error(f"n must be a non-negative int, got {n!r}")
    level = _Level(difficulty)
    rows, seen = [], set()
    for index in range(n):
        for attempt in range(MAX_ATTEMPTS):
            row = _draw(split, index, attempt, seed, level)
            if row is not None and row["question"] not in seen:
                break
        else:
            raise K3Error(f"could not draw {n} distinct {split} problems at difficulty "
                          f"{difficulty}; got {index}")
        seen.add(row["question"])
        rows.append(row)
    return rows


def to_jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def write_jsonl(path: str | os.PathLike, split: str, n: int, seed: int = 0,
                difficulty: int = 2) -> Path:
    """Write `generate(split, n, seed, difficulty)` as GSM8K-style JSONL, atomically."""
    text = to_jsonl(generate(split, n, seed=seed, difficulty=difficulty))
    return atomic_write_text(path, text)
