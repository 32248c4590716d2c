"""gsm8k_synth: deterministic, split-disjoint, GSM8K-format problems whose worked steps add up."""

import json
import re

import pytest

from k3verify.quality.evals import gsm8k_synth
from optimized_stack.errors import K3Error

from shared_data import SHARED  # noqa: E402

STEP_RE = re.compile(r"(\d+) ([-+*/]) (\d+) = \$?(\d+)")
STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval gsm8k strict-match pattern
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
       "/": lambda a, b: a / b}


def answer_errors(row: dict) -> list[str]:
    """Every way a row breaks the worked-answer rules; empty when it is sound."""
    errors = []
    lines = row["answer"].split("\n")
    steps = [STEP_RE.search(line) for line in lines[:-1]]
    if not 2 <= len(steps) <= 4:
        errors.append(f"{len(steps)} steps, expected 2-4")
    for line, m in zip(lines, steps):
        if m is None:
            errors.append(f"no 'a op b = c' in {line!r}")
            continue
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        if OPS[op](a, b) != c:
            errors.append(f"wrong arithmetic {m[0]!r}")
    final = STRICT_RE.fullmatch(lines[-1])
    if final is None:
        errors.append(f"last line {lines[-1]!r} is not '#### N'")
    elif steps and steps[-1] is not None and final[1] != steps[-1][4]:
        errors.append(f"answer {final[1]} is not the last step's result {steps[-1][4]}")
    numbers = [int(x) for x in re.findall(r"\d+", row["question"] + row["answer"])]
    if max(numbers) > 999:
        errors.append(f"number {max(numbers)} has more than 3 digits")
    return errors


def overlap(a: list[dict], b: list[dict]) -> set[str]:
    return {r["question"] for r in a} & {r["question"] for r in b}


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    p1 = gsm8k_synth.write_jsonl(tmp_path / "a.jsonl", "train", 300, seed=7)
    p2 = gsm8k_synth.write_jsonl(tmp_path / "b.jsonl", "train", 300, seed=7)
    p3 = gsm8k_synth.write_jsonl(tmp_path / "c.jsonl", "train", 300, seed=8)
    assert p1.read_bytes() == p2.read_bytes(), "same seed must give the same bytes"
    assert p1.read_bytes() != p3.read_bytes(), "another seed must give other problems"
    assert not list(tmp_path.glob(".*.tmp")), "atomic write left a temp file behind"


def test_longer_run_extends_shorter_run():
    assert gsm8k_synth.generate("test", 40, seed=3) == gsm8k_synth.generate("test", 80, seed=3)[:40]


@pytest.mark.parametrize("train_seed,test_seed", [(0, 0), (0, 1), (5, 9)],
                         ids=["same-seed", "seeds-0-1", "seeds-5-9"])
def test_train_and_test_never_share_a_question(train_seed, test_seed):
    train = gsm8k_synth.generate("train", 3000, seed=train_seed)
    test = gsm8k_synth.generate("test", 1000, seed=test_seed)
    assert not overlap(train, test), "a question appears in both train and test"
    assert {gsm8k_synth.split_of(r["question"]) for r in train} == {"train"}
    assert {gsm8k_synth.split_of(r["question"]) for r in test} == {"test"}
    assert len({r["question"] for r in train}) == 3000, "duplicate questions within train"


def test_overlap_check_can_fail():
    # negative control: the same split drawn twice must be reported as overlapping
    rows = gsm8k_synth.generate("test", 50, seed=0)
    assert len(overlap(rows, gsm8k_synth.generate("test", 50, seed=0))) == 50


@pytest.mark.parametrize("difficulty", [1, 2, 3], ids=lambda d: f"difficulty{d}")
def test_worked_answers_add_up_and_end_in_answer_line(difficulty):
    rows = gsm8k_synth.generate("train", 500, seed=1, difficulty=difficulty)
    bad = {r["question"]: answer_errors(r) for r in rows if answer_errors(r)}
    assert not bad, f"{len(bad)} rows break the answer rules, e.g. {next(iter(bad.items()))}"
    steps = {r["answer"].count("\n") for r in rows}
    assert max(steps) == 1 + difficulty, f"difficulty {difficulty} must reach {1 + difficulty} steps"
    assert min(steps) == 2


def test_answer_checker_can_fail():
    row = gsm8k_synth.generate("train", 1, seed=0)[0]
    lines = row["answer"].split("\n")
    wrong_sum = dict(row, answer=row["answer"].replace(" = ", " = 1", 1))
    wrong_final = dict(row, answer="\n".join(lines[:-1] + ["#### 1000"]))
    no_final = dict(row, answer="\n".join(lines[:-1]))
    assert any("arithmetic" in e for e in answer_errors(wrong_sum))
    assert any("not the last step" in e for e in answer_errors(wrong_final))
    assert any("more than 3 digits" in e for e in answer_errors(wrong_final))
    assert answer_errors(no_final)


def test_rows_have_gsm8k_fields():
    with open(SHARED / "data" / "gsm8k" / "test.jsonl") as f:
        gsm8k_keys = set(json.loads(f.readline()))
    row = gsm8k_synth.generate("test", 1, seed=0)[0]
    assert set(row) == gsm8k_keys, f"fields {set(row)} differ from GSM8K's {gsm8k_keys}"
    assert all(isinstance(v, str) for v in row.values())


def test_bad_input_is_refused():
    with pytest.raises(K3Error, match=r"split must be one of \('train', 'test'\), got 'dev'"):
        gsm8k_synth.generate("dev", 3)
    with pytest.raises(K3Error, match="difficulty must be one of \\[1, 2, 3\\], got 7"):
        gsm8k_synth.generate("train", 3, difficulty=7)
    with pytest.raises(K3Error, match="n must be a non-negative int, got -1"):
        gsm8k_synth.generate("train", -1)
