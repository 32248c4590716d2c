"""An lm-eval model over any greedy text generator.

lm-eval asks the model for `generate_until(requests)`; this class forwards the
prompts to a plain function

    generate_fn(prompts: list[str], max_new_tokens: int, stop: list[str]) -> list[str]

so the same gsm8k task runs on the embedded engine, a test double or a remote
endpoint wrapper. Registered as "k3verify": `lm_eval --model k3verify
--model_args pretrained=k3-mini` builds a greedy generator over the named preset.
Scoring stays inside lm-eval; nothing here looks at answers.
"""

from __future__ import annotations

from typing import Callable, Sequence

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from optimized_stack.errors import K3Error

GenerateFn = Callable[[list[str], int, list[str]], list[str]]


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """Cut at the earliest stop string, as lm-eval's own models do; generators may overshoot."""
    cut = len(text)
    for s in stop:
        if s:
            i = text.find(s)
            if i != -1:
                cut = min(cut, i)
    return text[:cut]


@register_model("k3verify")
class GenerateFnLM(LM):
    """lm-eval LM whose generation is a caller-given greedy `generate_fn`."""

    def __init__(self, generate_fn: GenerateFn | None = None, *, max_new_tokens: int = 256,
                 batch_size: int | str | None = 8, pretrained: str | None = None,
                 **_ignored) -> None:
        super().__init__()
        if generate_fn is None and pretrained is None:
            raise K3Error("GenerateFnLM needs generate_fn or pretrained=<preset or path>, got neither")
        if generate_fn is None:
            # the CLI route: lm-eval builds us from a string, so build the generator here
            from k3verify.quality.evals.gsm8k import greedy_generate_fn
            from optimized_stack import load_model
            from optimized_stack.tokenizer import ByteTokenizer
            generate_fn = greedy_generate_fn(load_model(pretrained), ByteTokenizer())
        if not callable(generate_fn):
            raise K3Error(f"generate_fn must be callable, got {type(generate_fn).__name__}")
        if int(max_new_tokens) < 1:
            raise K3Error(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.generate_fn = generate_fn
        self.max_new_tokens = int(max_new_tokens)
        # lm-eval passes "auto" or None through simple_evaluate; both mean our default
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.calls = 0  # generate_fn invocations, for timing reports

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        # one call per run of identical generation settings, batch_size prompts at a time
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            if gen_kwargs.get("do_sample"):
                raise K3Error(f"generate_fn is greedy; task asked for do_sample=True ({gen_kwargs})")
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_new_tokens))
            groups.setdefault((tuple(until), max_new), []).append(i)
        for (until, max_new), idxs in groups.items():
            for start in range(0, len(idxs), self.batch_size):
                chunk = idxs[start:start + self.batch_size]
                prompts = [requests[i].args[0] for i in chunk]
                texts = self.generate_fn(prompts, max_new, list(until))
                self.calls += 1
                if len(texts) != len(prompts):
                    raise K3Error(f"generate_fn returned {len(texts)} texts for {len(prompts)} prompts")
                for i, text in zip(chunk, texts):
                    if not isinstance(text, str):
                        raise K3Error(f"generate_fn must return str, got {type(text).__name__}")
                    out[i] = truncate_at_stop(text, until)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out  # type: ignore[return-value]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("k3verify's lm-eval model only generates (generate_until); "
                                  "loglikelihood tasks are not supported")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("k3verify's lm-eval model only generates (generate_until); "
                                  "loglikelihood_rolling tasks are not supported")
