"""GSM8K through lm-eval's own gsm8k task, offline, on local JSONL and on gsm8k_synth."""

import os

# Offline before datasets/huggingface_hub are imported: they read these at import time.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import hashlib  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from k3verify.quality.evals import gsm8k_synth  # noqa: E402
from k3verify.quality.evals.gsm8k import greedy_generate_fn, lookup_generate_fn, run_gsm8k  # noqa: E402
from k3verify.quality.evals.lm_eval_model import GenerateFnLM  # noqa: E402
from optimized_stack.errors import K3Error  # noqa: E402

from shared_data import SHARED  # noqa: E402

DATA = SHARED / "data" / "gsm8k"


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


TEST_ROWS = read_jsonl(DATA / "test.jsonl")
TRAIN_QUESTIONS = {r["question"] for r in read_jsonl(DATA / "train.jsonl")}
TRUE_ANSWERS = {r["question"]: r["answer"] for r in TEST_ROWS}


class NetworkUsed(RuntimeError):
    pass


@pytest.fixture
def no_network(monkeypatch):
    """Offline mode on, whatever imported datasets first; any socket connection fails loudly."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def refuse(self, address, *args, **kwargs):
        raise NetworkUsed(f"network access to {address} during an offline run")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("k3verify-cache")


def recording(fn, prompts: list):
    def generate(batch, max_new_tokens, stop):
        prompts.extend(batch)
        return fn(batch, max_new_tokens, stop)
    return generate


def test_network_guard_can_fail(no_network):
    # negative control for the offline claim: the guard really blocks connections
    with pytest.raises(NetworkUsed, match="network access"):
        socket.create_connection(("127.0.0.1", 9), timeout=1)


def test_true_answers_score_one_with_rows(no_network, cache):
    prompts: list[str] = []
    result = run_gsm8k(recording(lookup_generate_fn(TRUE_ANSWERS), prompts),
                       data_dir=DATA, limit=5, cache_dir=cache)
    assert result["accuracy"] == {"strict-match": 1.0, "flexible-extract": 1.0}
    assert result["n"] == 5 and result["task"] == "gsm8k"
    rows = result["rows"]
    assert [r["doc_id"] for r in rows] == [0, 1, 2, 3, 4]
    for row, doc, prompt in zip(rows, TEST_ROWS, prompts):
        assert row["question"] == doc["question"]
        assert row["target"] == doc["answer"].split("#### ")[-1]
        assert row["response"] == doc["answer"]
        assert row["correct_strict"] and row["correct_flexible"]
        assert row["prompt_hash"] == hashlib.sha256(prompt.encode()).hexdigest()
        # 5-shot: five solved train questions, then this one, in lm-eval's format
        assert prompt.count("Question: ") == 6
        assert prompt.endswith(f"Question: {doc['question']}\nAnswer:")
        shots = [p.split("\nAnswer:")[0] for p in prompt.split("Question: ")[1:-1]]
        assert all(q in TRAIN_QUESTIONS for q in shots), "few-shot examples must come from train"


def test_wrong_answers_score_zero(no_network, cache):
    def wrong(prompts, max_new_tokens, stop):
        right = lookup_generate_fn(TRUE_ANSWERS)(prompts, max_new_tokens, stop)
        return [f"Some steps.\n#### {int(a.split('#### ')[-1].replace(',', '')) + 1}" for a in right]
    result = run_gsm8k(wrong, data_dir=DATA, limit=5, cache_dir=cache)
    assert result["accuracy"] == {"strict-match": 0.0, "flexible-extract": 0.0}
    assert not any(r["correct_strict"] or r["correct_flexible"] for r in result["rows"])


def test_flexible_extract_catches_answer_without_hashes(no_network, cache):
    table = {q: f"The answer is {a.split('#### ')[-1]}." for q, a in TRUE_ANSWERS.items()}
    result = run_gsm8k(lookup_generate_fn(table), data_dir=DATA, limit=5, cache_dir=cache)
    assert result["accuracy"] == {"strict-match": 0.0, "flexible-extract": 1.0}


def test_generation_is_cut_at_lm_eval_stop_strings(no_network, cache):
    # a generator that runs on into the next few-shot question; lm-eval's "Question:" stop ends it
    def rambling(prompts, max_new_tokens, stop):
        right = lookup_generate_fn(TRUE_ANSWERS)(prompts, max_new_tokens, stop)
        return [a + "\n\nQuestion: what next?\nAnswer: #### 7" for a in right]
    result = run_gsm8k(rambling, data_dir=DATA, limit=2, num_fewshot=0, cache_dir=cache)
    assert result["accuracy"] == {"strict-match": 1.0, "flexible-extract": 1.0}
    assert all("Question:" not in r["response"] for r in result["rows"])


def test_same_seed_same_prompts_other_seed_other_shots(no_network, cache):
    fn = lookup_generate_fn(TRUE_ANSWERS)
    a = run_gsm8k(fn, data_dir=DATA, limit=2, seed=1234, cache_dir=cache)
    b = run_gsm8k(fn, data_dir=DATA, limit=2, seed=1234, cache_dir=cache)
    c = run_gsm8k(fn, data_dir=DATA, limit=2, seed=99, cache_dir=cache)
    hashes = [[r["prompt_hash"] for r in x["rows"]] for x in (a, b, c)]
    assert hashes[0] == hashes[1], "same seed must give the same prompts (paired runs)"
    assert hashes[0] != hashes[2], "another few-shot seed must change the prompts"


def test_synth_runs_through_the_same_task(no_network, cache):
    test_rows = gsm8k_synth.generate("test", 5, seed=0, difficulty=2)
    table = {r["question"]: r["answer"] for r in test_rows}
    prompts: list[str] = []
    result = run_gsm8k(recording(lookup_generate_fn(table), prompts), dataset="synth",
                       limit=5, cache_dir=cache)
    assert result["task"] == "gsm8k_synth"
    assert result["accuracy"] == {"strict-match": 1.0, "flexible-extract": 1.0}
    assert [r["question"] for r in result["rows"]] == [r["question"] for r in test_rows]
    train = {r["question"] for r in gsm8k_synth.generate("train", gsm8k_synth_train_n(), seed=0)}
    shots = [p.split("\nAnswer:")[0] for p in prompts[0].split("Question: ")[1:-1]]
    assert len(shots) == 5 and all(q in train for q in shots), "synth shots must come from synth train"


def gsm8k_synth_train_n() -> int:
    from k3verify.quality.evals.gsm8k import SYNTH_TRAIN_N
    return SYNTH_TRAIN_N


def k3_mini_generate_fn():
    pytest.importorskip("torch")
    from optimized_stack import load_model
    from optimized_stack.tokenizer import ByteTokenizer

    return greedy_generate_fn(load_model("k3-mini"), ByteTokenizer())


def check_real_rows(result, n, max_new_tokens):
    assert result["n"] == n and len(result["rows"]) == n
    for row in result["rows"]:
        # a byte tokenizer: at most 4 bytes of text per token even after U+FFFD replacement
        assert isinstance(row["response"], str) and len(row["response"].encode()) <= 4 * max_new_tokens
        assert isinstance(row["correct_strict"], bool) and isinstance(row["correct_flexible"], bool)
        assert len(row["prompt_hash"]) == 64
    assert set(result["accuracy"]) == {"strict-match", "flexible-extract"}


def test_real_k3_mini_runs_end_to_end(no_network, cache):
    # 0-shot synth keeps prompts near 200 bytes: the reference path prefills ~200 tok/s on 2 cores
    result = run_gsm8k(k3_mini_generate_fn(), dataset="synth", limit=2, num_fewshot=0,
                       max_new_tokens=4, cache_dir=cache)
    check_real_rows(result, n=2, max_new_tokens=4)


@pytest.mark.slow
def test_real_k3_mini_5shot_gsm8k(no_network, cache):
    # the full 5-shot prompt (~3.5K bytes) on the reference path: ~5 s per question on an idle
    # 2-core machine, several times that under load
    result = run_gsm8k(k3_mini_generate_fn(), data_dir=DATA, limit=2, max_new_tokens=16,
                       cache_dir=cache)
    check_real_rows(result, n=2, max_new_tokens=16)


def test_hub_path_offline_says_how_to_run_offline(no_network, cache):
    # the default data source is lm-eval's gsm8k.yaml as shipped (openai/gsm8k on the hub)
    with pytest.raises(K3Error, match="could not load the gsm8k data .*pass data_dir="):
        run_gsm8k(lookup_generate_fn(TRUE_ANSWERS), limit=1, cache_dir=cache)


def test_model_is_registered_with_lm_eval():
    from lm_eval.api.registry import get_model

    assert get_model("k3verify") is GenerateFnLM


def test_lm_rejects_bad_generators():
    class Req:
        def __init__(self, context):
            self.args = (context, {"until": ["Question:"]})

    lm = GenerateFnLM(lambda prompts, n, stop: ["only one"], batch_size=8)
    with pytest.raises(K3Error, match="generate_fn returned 1 texts for 2 prompts"):
        lm.generate_until([Req("a"), Req("b")])
    sampling = Req("a")
    sampling.args = ("a", {"do_sample": True})
    with pytest.raises(K3Error, match="generate_fn is greedy; task asked for do_sample=True"):
        lm.generate_until([sampling])
    with pytest.raises(K3Error, match="needs generate_fn or pretrained"):
        GenerateFnLM()
    with pytest.raises(K3Error, match=r"dataset must be one of \('gsm8k', 'synth'\), got 'math'"):
        run_gsm8k(lambda p, n, s: p, dataset="math")
    with pytest.raises(K3Error, match="data_dir must hold train.jsonl and test.jsonl"):
        run_gsm8k(lambda p, n, s: p, data_dir="/nonexistent", cache_dir="/tmp")
