"""Run one vLLM engine configuration over token-id prompts and save full-vocab logprobs.

    python -m k3verify.serving.backends.vllm_worker --model DIR --settings JSON --prompts JSON --out FILE.pt

One engine per process: two `vllm.LLM` instances in one process share global
state (platform env, batch-invariant op overrides, torch thread count), so the
reference and the candidate each get a fresh interpreter. The capture written to
--out (atomically) is a dict:

    {"requests": [{"prompt_ids": [...], "tokens": [...], "logprobs": float32 [steps, V]}],
     "settings": {...}, "vllm_version": str, "torch_version": str, "timing_s": {...}}

This module must import under the vLLM interpreter (its own venv), so besides the
standard library, torch and vllm it imports only k3verify.io (standard library only; its
atomic write); settings are plain JSON and are validated by
k3verify.serving.backends.vllm_backend before they get here.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import time
from pathlib import Path

from k3verify.io import atomic_write_bytes

# Keys that are not vllm.LLM keyword arguments.
WORKER_KEYS = ("env", "submit", "logprobs_mode")


def _set_env(settings: dict) -> None:
    """Environment must be in place before vllm is imported: envs.py reads it lazily but
    platform and batch-invariance setup read it once per process."""
    # In-process engine core: with the default multiprocess engine on a 2-core box the
    # worker is pinned to one core and an 8-token request took 55 s instead of 0.2 s.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for key, value in settings.get("env", {}).items():
        os.environ[str(key)] = str(value)


def _logprob_row(step: dict, vocab_size: int) -> list[float]:
    """One step's {token_id: Logprob} as a dense row; ids vLLM did not return stay NaN."""
    row = [math.nan] * vocab_size
    for token_id, lp in step.items():
        row[token_id] = lp.logprob
    return row


def run_engine(model_dir: str, settings: dict, prompts: list[list[int]], max_tokens: int) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm_kwargs = {k: v for k, v in settings.items() if k not in WORKER_KEYS}
    submit = settings.get("submit", "together")
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, max_logprobs=-1, logprobs_mode=settings.get("logprobs_mode", "raw_logprobs"),
              disable_log_stats=True, **llm_kwargs)
    t_init = time.perf_counter() - t0
    vocab_size = llm.llm_engine.model_config.get_vocab_size()
    # logprobs=-1: every vocab entry, every step (needs max_logprobs=-1 above). detokenize=False:
    # otherwise every one of the V entries is detokenized per step, 5-10x the generate time.
    # ignore_eos: every request runs max_tokens steps, so captures line up step for step.
    params = SamplingParams(temperature=0.0, logprobs=-1, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]

    t0 = time.perf_counter()
    if submit == "one_at_a_time":
        outputs = [llm.generate([r], params, use_tqdm=False)[0] for r in requests]
    else:
        outputs = llm.generate(requests, params, use_tqdm=False)
    t_generate = time.perf_counter() - t0

    captured = []
    for prompt, out in zip(prompts, outputs):
        # num_cached_tokens: prompt tokens served from the prefix cache (evidence the toggle acted).
        completion = out.outputs[0]
        rows = [_logprob_row(step, vocab_size) for step in completion.logprobs]
        captured.append({
            "prompt_ids": list(prompt),
            "tokens": list(completion.token_ids),
            "num_cached_tokens": int(out.num_cached_tokens or 0),
            "logprobs": torch.tensor(rows, dtype=torch.float32).reshape(len(rows), vocab_size),  # [steps, V]
        })
    return {
        "requests": captured,
        "settings": settings,
        "model_dir": str(model_dir),
        "max_tokens": max_tokens,
        "vllm_version": str(vllm.__version__),
        "torch_version": str(torch.__version__),  # TorchVersion is not weights_only-loadable
        "torch_threads": torch.get_num_threads(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "loadavg_1m": os.getloadavg()[0],  # other processes on the box; timings are only as good as this
        "timing_s": {"engine_init": t_init, "generate": t_generate},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one vLLM engine config, save full-vocab logprobs.")
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--settings", required=True, help="JSON object: vllm.LLM kwargs plus env/submit")
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists, or @file.json")
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--out", required=True, help="capture file (.pt), written atomically")
    args = parser.parse_args(argv)

    t_start = time.perf_counter()
    settings = json.loads(args.settings)
    raw = args.prompts
    prompts = json.loads(Path(raw[1:]).read_text() if raw.startswith("@") else raw)
    _set_env(settings)

    import torch  # after _set_env: thread and platform settings come from the environment

    capture = run_engine(args.model, settings, prompts, args.max_tokens)
    capture["timing_s"]["process"] = time.perf_counter() - t_start
    buf = io.BytesIO()
    torch.save(capture, buf)
    atomic_write_bytes(Path(args.out), buf.getvalue())
    return 0


if __name__ == "__main__":
    # vLLM may spawn helper processes; the guard keeps them from re-running main().
    sys.exit(main())
