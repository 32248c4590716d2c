"""Check kind `gsm8k`: lm-eval's gsm8k task on the embedded model or an endpoint and, per
toggle, the paired non-inferiority gate (quality/gsm8k_gate.py).

Without a toggle it measures the reference path (or `base_url` through lm-eval's
local-completions model). With a toggle the same questions and prompts (same few-shot seed)
are answered again with the toggle applied, joined per question and judged by the paired
test at `margin`: pass, fail, or inconclusive when n cannot resolve the margin; never a raw
score compare. `smoke` marks the results as a smoke test (counts toward no verdict; a fail
still fails). `batch` > 1 answers that many questions at once through the engine's continuous
batching (evals/engine_generate.py: the same answers, bit for bit; on a GPU the one-at-a-time
loop is all host dispatch). `stack = "counted"` answers on the engine with the counted exact
toggles on both sides (batched_decode, and cuda_graphs on CUDA: serving/stack.py): the
reference's answers bit for bit by their contract, one decode forward per step for every
question. One unit per toggle, or one reference unit when the check names none.

The reference's answers are computed once per run: reused within a process and, under `k3verify
all`, read from the run directory by its other processes (quality/shared_answers.py); each result
says where its unit's came from (`reference_source`: computed, process, run_dir, or mixed).
"""
from __future__ import annotations

import ipaddress
import sys
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

from k3verify.verdict.result import Result, Subject

from .base import (CheckSpec, Context, OptionError, Unit, check_fraction, check_int, check_toggles, device_skip,
                   is_number, gate_units)

NAME = "gsm8k"
OPTIONS = {"toggles": None, "dataset": "synth", "limit": 20, "data_dir": None, "base_url": None,
           "model_name": None, "num_fewshot": 5, "fewshot_seed": 1234, "max_new_tokens": 256, "margin": 0.01,
           "alpha": 0.05, "beta": 0.2, "min_accuracy": None, "smoke": False, "batch": 1,
           "stack": "reference"}
STACKS = ("reference", "counted")
DATASETS = ("synth", "gsm8k")
OPENAI_TEST_N = 1319            # openai/gsm8k's test split
SETUP_S = 10.0                  # lm-eval set-up per side (progress only)


def completions_url(base_url: str) -> str:
    """http://host:port/v1 (or .../v1/completions) -> the completions URL lm-eval posts to."""
    try:
        parsed = urlparse(str(base_url))
        parsed.port                      # parsed lazily: "http://h:x/v1" raises only here
    except ValueError as exc:            # urllib's "Invalid IPv6 URL", a port that is not a number
        raise OptionError("base_url", f"must be an http(s) URL with a host, like http://127.0.0.1:8000/v1, "
                                      f"got {base_url!r} ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise OptionError("base_url", f"must be an http(s) URL with a host, like http://127.0.0.1:8000/v1, "
                                      f"got {base_url!r}")
    url = str(base_url).rstrip("/")
    return url if url.endswith("/completions") else url + "/completions"


def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def validate(o: dict) -> None:
    check_toggles(o["toggles"])
    if o["dataset"] not in DATASETS:
        raise OptionError("dataset", f"must be 'synth' or 'gsm8k', got {o['dataset']!r}")
    if o["limit"] is not None:
        check_int(o["limit"], "limit", 1, "questions")
    check_int(o["num_fewshot"], "num_fewshot", 0)
    check_int(o["fewshot_seed"], "fewshot_seed", 0)
    check_int(o["max_new_tokens"], "max_new_tokens", 1)
    check_int(o["batch"], "batch", 1, "questions at once")
    check_fraction(o["margin"], "margin", nullable=False, closed=False)
    for key in ("alpha", "beta"):
        if not is_number(o[key]) or not 0.0 < o[key] < 0.5:
            raise OptionError(key, f"must be in (0, 0.5), got {o[key]!r}")
    check_fraction(o["min_accuracy"], "min_accuracy")
    if o["data_dir"] is not None and not Path(o["data_dir"]).is_dir():
        raise OptionError("data_dir", f"must be a folder with train.jsonl and test.jsonl, got {o['data_dir']}")
    if not isinstance(o["smoke"], bool):
        raise OptionError("smoke", f"must be true or false, got {o['smoke']!r}")
    if o["stack"] not in STACKS:
        raise OptionError("stack", f"must be one of {', '.join(STACKS)}, got {o['stack']!r}")
    if o["stack"] != "reference" and o["base_url"] is not None:
        raise OptionError("stack", "picks the embedded engine's stack; an endpoint serves its own")
    if o["base_url"] is not None:
        completions_url(o["base_url"])
        if o["toggles"] is not None:
            raise OptionError("toggle", "applies to the embedded model; it cannot be combined with a base_url")


def plan(spec: CheckSpec) -> list[Unit]:
    return gate_units(spec)


def questions(o: dict) -> int:
    """How many questions each side answers: `limit`, else the test split."""
    from k3verify.quality.evals.gsm8k_synth import SYNTH_TEST_N

    if o["dataset"] == "synth":
        size = SYNTH_TEST_N
    elif o["data_dir"] is not None and (Path(o["data_dir"]) / "test.jsonl").is_file():
        with open(Path(o["data_dir"]) / "test.jsonl", encoding="utf-8", errors="replace") as f:
            size = sum(1 for line in f if line.strip())
    else:
        size = OPENAI_TEST_N
    return min(o["limit"], size) if o["limit"] else size


def question_s(o: dict) -> float:
    return (0.1 * o["max_new_tokens"] + 2.0 * o["num_fewshot"]) / min(o["batch"], 8)


def cost_s(unit: Unit) -> float:
    sides = 2 if unit.toggle else 1
    return sides * (SETUP_S + questions(unit.options) * question_s(unit.options))


def run(unit: Unit, ctx: Context) -> list[Result]:
    from k3verify.quality.gate_run import toggled
    from k3verify.quality.gsm8k_gate import gsm8k_gate

    o = unit.options
    skip = device_skip(unit.toggle, ctx.device)
    if skip:
        return [Result.skipped(Subject.of(unit.toggle), NAME, skip).tag(gate=NAME)]
    endpoint = None
    if o["base_url"] is not None:
        ref_fn, model_name = endpoint_generate_fn(o["base_url"], o["model_name"])
        endpoint = {"base_url": o["base_url"], "model_name": model_name}
        if not is_loopback(o["base_url"]):
            print(f"note: sending GSM8K prompts to {o['base_url']}", file=sys.stderr)
    else:
        from k3verify.quality.evals.engine_generate import engine_generate_fn
        from k3verify.quality.evals.gsm8k import greedy_generate_fn
        from optimized_stack.tokenizer import load_tokenizer
        tok = load_tokenizer(ctx.model_arg)
        if o["batch"] > 1 or o["stack"] != "reference":
            from k3verify.serving.stack import counted_toggles
            stack = counted_toggles(ctx.device) if o["stack"] == "counted" else ()
            ref_fn = engine_generate_fn(ctx.model, tok, batch=o["batch"], stack_toggles=stack)
        else:
            ref_fn = greedy_generate_fn(ctx.model, tok)

    fired: Counter = Counter()                   # the engine's path events over this unit's calls
    timing: Counter = Counter()                  # and its steps' wall seconds, prefill vs decode-only

    def counted(prompts, *a, **kw):              # one progress item per question answered, either side
        out = ref_fn(prompts, *a, **kw)
        stats = getattr(ref_fn, "stats", {})
        fired.update(stats.get("events", {}))
        timing.update(stats.get("timing", {}))   # Counter.update adds: the unit's engine seconds, by step kind
        ctx.progress.advance(len(prompts))
        return out
    # Only the reference side is remembered: the candidate wraps the plain function, so a toggle's
    # answers are always computed (tests/test_engine_generate.py, tests/test_shared_reference.py).
    cand_fn = toggled(counted, [unit.toggle]) if unit.toggle else None
    reference = counted if endpoint else remembered(counted, ctx, batch=o["batch"], stack=o["stack"])
    gate = gsm8k_gate(reference, cand_fn, toggle=unit.toggle, margin=o["margin"], alpha=o["alpha"], beta=o["beta"],
                      min_accuracy=o["min_accuracy"], smoke=o["smoke"], progress=ctx.progress.note,
                      dataset=o["dataset"], data_dir=o["data_dir"], limit=o["limit"], num_fewshot=o["num_fewshot"],
                      seed=o["fewshot_seed"], max_new_tokens=o["max_new_tokens"], batch_size=max(8, o["batch"]))
    if endpoint:
        tags = {"endpoint": endpoint}
    else:
        answers = reference.evidence()
        tags = {"engine": {"stack": o["stack"], "batch": o["batch"], "events": dict(fired),
                           "timing": {k: round(v, 3) for k, v in timing.items()}},
                "reference_source": answers["source"], "reference_answers": answers}
    for r in gate.results:
        r.tag(gate=NAME, **tags)
    return gate.results


def remembered(generate_fn, ctx: Context, **options):
    """The reference side's generate_fn: prompts this process answered before come from
    ctx.reference_answers; under a run directory (`k3verify all`), answers another process of the
    run computed come from its file, and answers computed here are filed for the others
    (quality/shared_answers.py). `options` are the kind's, which decide the answers too."""
    from k3verify.quality.shared_answers import for_context
    return for_context(generate_fn, ctx, NAME, **options)


def endpoint_generate_fn(base_url: str, model_name: str | None, timeout_s: float = 600.0):
    """A generate_fn that forwards to lm-eval's own local-completions model (string prompts).

    Scoring and the task stay in run_gsm8k; only generation goes to the endpoint, through
    lm-eval's client (its payload: prompt, max_tokens, temperature 0, stop, seed)."""
    from k3verify.errors import UsageError
    from k3verify.serving.endpoint import served_model

    url = completions_url(base_url)
    root = url[: -len("/completions")]
    # Probe first, with or without a model name: lm-eval's client answers a closed port with
    # a traceback after its retries, not with a line that names the URL.
    model_name = served_model(root, model_name)
    try:
        from lm_eval.api.instance import Instance
        from lm_eval.models.openai_completions import LocalCompletionsAPI
        lm = LocalCompletionsAPI(base_url=url, model=model_name, tokenizer_backend=None,
                                 tokenized_requests=False, timeout=int(timeout_s), max_retries=1)
    except ModuleNotFoundError as e:
        raise UsageError(f"--base-url needs lm-eval's API extra ({e}); install lm-eval[api]==0.4.13") from None

    def generate(prompts: list[str], max_new_tokens: int, stop: list[str]) -> list[str]:
        gen = {"until": list(stop), "max_gen_toks": max_new_tokens, "do_sample": False, "temperature": 0.0}
        reqs = [Instance("generate_until", {}, (p, dict(gen)), i) for i, p in enumerate(prompts)]
        return lm.generate_until(reqs, disable_tqdm=True)

    return generate, model_name
