"""GSM8K through lm-eval's own gsm8k task (5-shot, strict-match and flexible-extract).

k3verify never scores answers itself: it hands lm-eval a model (GenerateFnLM)
and a task, and reads back lm-eval's metrics and logged samples.

Data sources, one task definition:
- dataset="gsm8k", data_dir=None: lm-eval's gsm8k.yaml as shipped (Hugging Face
  `openai/gsm8k`, needs the hub or its cache).
- dataset="gsm8k", data_dir=DIR: the same YAML included by a small task file that
  swaps the data to DIR/train.jsonl and DIR/test.jsonl (`dataset_path: json`,
  `dataset_kwargs.data_files`); few-shot examples come from train, as upstream.
- dataset="synth": the same, over gsm8k_synth JSONL written to a cache dir first
  (or read from data_dir when given).
The task file is written at run time because it holds absolute paths; it sits in
its own folder and is loaded with TaskManager(include_path=..., include_defaults=False),
which also skips indexing lm-eval's ~15K other tasks (about 27 s on 2 cores).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Sequence

from k3verify.io import atomic_write_text
from k3verify.quality.evals import gsm8k_synth
from k3verify.quality.evals.lm_eval_model import GenerateFn, GenerateFnLM, truncate_at_stop
from optimized_stack.errors import K3Error

DATASETS = ("gsm8k", "synth")
FILTERS = ("strict-match", "flexible-extract")
from k3verify.quality.evals.gsm8k_synth import SYNTH_TEST_N, SYNTH_TRAIN_N  # noqa: E402,F401


def default_cache_dir() -> Path:
    return Path(os.environ.get("K3VERIFY_CACHE", "~/.cache/k3verify")).expanduser()


def lm_eval_gsm8k_yaml() -> Path:
    """lm-eval's own gsm8k task file, from the installed package."""
    import lm_eval.tasks

    path = Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k.yaml"
    if not path.is_file():
        raise K3Error(f"expected lm-eval's gsm8k task at {path}, found nothing; is lm-eval==0.4.13 installed?")
    return path


def local_task_dir(task: str, data_dir: str | os.PathLike, cache_dir: Path) -> Path:
    """Write a task YAML that includes lm-eval's gsm8k.yaml with local JSONL data; return its folder."""
    data_dir = Path(data_dir).expanduser().resolve()
    files = {split: data_dir / f"{split}.jsonl" for split in ("train", "test")}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise K3Error(f"data_dir must hold train.jsonl and test.jsonl; missing {', '.join(missing)}")
    # JSON scalars are valid YAML, so json.dumps quotes paths safely
    text = "\n".join([
        "# Written by k3verify.quality.evals.gsm8k: lm-eval's gsm8k task, data from local JSONL.",
        f"include: {json.dumps(str(lm_eval_gsm8k_yaml()))}",
        f"task: {task}",
        "dataset_path: json",
        "dataset_name: null",
        "dataset_kwargs:",
        "  data_files:",
        f"    train: {json.dumps(str(files['train']))}",
        f"    test: {json.dumps(str(files['test']))}",
        "",
    ])
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    folder = cache_dir / "lm_eval_tasks" / f"{task}-{digest}"
    target = folder / f"{task}.yaml"
    if not target.is_file() or target.read_text() != text:
        atomic_write_text(target, text)
    return folder


def synth_data_dir(cache_dir: Path, seed: int, difficulty: int,
                   n_train: int = SYNTH_TRAIN_N, n_test: int = SYNTH_TEST_N) -> Path:
    """gsm8k_synth train/test JSONL in the cache, written once per (seed, difficulty, sizes)."""
    folder = cache_dir / "gsm8k_synth" / f"seed{seed}-d{difficulty}-train{n_train}-test{n_test}"
    for split, n in (("train", n_train), ("test", n_test)):
        if not (folder / f"{split}.jsonl").is_file():
            gsm8k_synth.write_jsonl(folder / f"{split}.jsonl", split, n, seed=seed, difficulty=difficulty)
    return folder


def _task_source(dataset: str, data_dir, cache_dir: Path, synth_seed: int, synth_difficulty: int):
    """(task name, include_path for lm-eval's TaskManager, local data folder or None)."""
    if dataset == "gsm8k" and data_dir is None:
        return "gsm8k", lm_eval_gsm8k_yaml().parent, None  # upstream as shipped: HF openai/gsm8k
    if dataset == "gsm8k":
        return "gsm8k", local_task_dir("gsm8k", data_dir, cache_dir), data_dir
    if data_dir is None:
        data_dir = synth_data_dir(cache_dir, synth_seed, synth_difficulty)
    return "gsm8k_synth", local_task_dir("gsm8k_synth", data_dir, cache_dir), data_dir


def run_gsm8k(generate_fn: GenerateFn, *, dataset: str = "gsm8k", data_dir: str | os.PathLike | None = None,
              limit: int | None = None, num_fewshot: int = 5, seed: int = 1234, max_new_tokens: int = 256,
              batch_size: int = 8, cache_dir: str | os.PathLike | None = None, synth_seed: int = 0,
              synth_difficulty: int = 2) -> dict:
    """Run lm-eval's gsm8k task on `generate_fn`; return accuracies and per-question rows.

    seed is lm-eval's few-shot sampling seed (its default is 1234), so two runs with
    the same seed see the same prompts and can be compared question by question.
    """
    if dataset not in DATASETS:
        raise K3Error(f"dataset must be one of {DATASETS}, got {dataset!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise K3Error(f"limit must be a positive int or None, got {limit!r}")
    if num_fewshot < 0:
        raise K3Error(f"num_fewshot must be >= 0, got {num_fewshot}")
    import lm_eval
    from lm_eval.tasks import TaskManager

    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    task, include_path, data_dir = _task_source(dataset, data_dir, cache, synth_seed, synth_difficulty)
    manager = TaskManager(include_path=str(include_path), include_defaults=False)
    started = time.perf_counter()
    try:  # building the task loads its data; do it here so a missing hub is a clear input error
        task_obj = manager.load([task])["tasks"][task]
    except ConnectionError as e:
        raise K3Error(f"could not load the {task} data ({e}); to run offline pass "
                      f"data_dir=<folder with train.jsonl and test.jsonl>") from e
    lm = GenerateFnLM(generate_fn, max_new_tokens=max_new_tokens, batch_size=batch_size)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=[task_obj], task_manager=manager, num_fewshot=num_fewshot, limit=limit,
        log_samples=True, bootstrap_iters=0, fewshot_random_seed=seed,
    )
    seconds = time.perf_counter() - started
    rows = _rows(out["samples"][task])
    metrics = out["results"][task]
    accuracy = {f: float(metrics[f"exact_match,{f}"]) for f in FILTERS}
    return {
        "task": task,
        "dataset": dataset,
        "data_dir": None if data_dir is None else str(data_dir),
        "task_config": str(include_path),
        "n": len(rows),
        "num_fewshot": num_fewshot,
        "seed": seed,
        "max_new_tokens": max_new_tokens,
        "accuracy": accuracy,
        "rows": rows,
        "seconds": seconds,
        "seconds_per_question": seconds / max(1, len(rows)),
        "generate_calls": lm.calls,
        "lm_eval_version": lm_eval.__version__,
        "task_version": out.get("versions", {}).get(task),
    }


def _rows(samples: Sequence[dict]) -> list[dict]:
    """lm-eval logs one sample per (doc, filter); fold them into one row per question."""
    by_doc: dict[int, dict] = {}
    for s in samples:
        row = by_doc.setdefault(s["doc_id"], {
            "doc_id": s["doc_id"],
            "prompt_hash": s["prompt_hash"],  # lm-eval's sha256 of the exact prompt string
            "doc_hash": s["doc_hash"],
            "question": s["doc"]["question"],
            "target": str(s["target"]).split("####")[-1].strip(),
            "response": s["resps"][0][0],
        })
        key = {"strict-match": "strict", "flexible-extract": "flexible"}.get(s["filter"])
        if key is None:
            continue
        row[f"correct_{key}"] = bool(s["exact_match"])
        row[f"extracted_{key}"] = s["filtered_resps"][0]
    rows = [by_doc[k] for k in sorted(by_doc)]
    for row in rows:
        if "correct_strict" not in row or "correct_flexible" not in row:
            raise K3Error(f"lm-eval logged no {FILTERS} result for doc {row['doc_id']}; "
                          f"is the gsm8k task version {FILTERS} still?")
    return rows


def greedy_generate_fn(model, tokenizer, add_bos: bool = False) -> GenerateFn:
    """A generate_fn over optimized_stack's reference incremental API, one prompt at a time.

    Plain argmax decoding: prefill the prompt into a fresh state, then one token per
    forward until eos, a stop string or max_new_tokens.
    """
    import torch

    def generate(prompts: list[str], max_new_tokens: int, stop: list[str]) -> list[str]:
        texts = []
        for prompt in prompts:
            ids = tokenizer.encode(prompt, add_bos=add_bos)
            state = model.new_state()
            with torch.no_grad():
                logits = model.forward(torch.tensor(ids, dtype=torch.long), state)  # [T, V]
                new: list[int] = []
                for _ in range(max_new_tokens):
                    token = int(torch.argmax(logits[-1]))
                    if token == tokenizer.eos_id:
                        break
                    new.append(token)
                    text = tokenizer.decode(new, skip_special=True)
                    if any(s and s in text for s in stop):
                        break
                    logits = model.forward(torch.tensor([token], dtype=torch.long), state)
            texts.append(truncate_at_stop(tokenizer.decode(new, skip_special=True), stop))
        return texts

    return generate


def lookup_generate_fn(answers: dict[str, str]) -> Callable[[list[str], int, list[str]], list[str]]:
    """A test double: answer the last question in each prompt from a question -> text table."""

    def generate(prompts: list[str], max_new_tokens: int, stop: list[str]) -> list[str]:
        out = []
        for prompt in prompts:
            question = prompt.rsplit("Question: ", 1)[-1].rsplit("\nAnswer:", 1)[0]
            if question not in answers:
                raise K3Error(f"lookup_generate_fn has no answer for question {question[:60]!r}")
            out.append(answers[question])
        return out

    return generate
