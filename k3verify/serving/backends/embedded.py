"""The embedded backend: the optimized stack's model, driven token by token in this process.

`decode` is the whole generation loop (prefill the prompt, then one forward per
token) and is kept apart so the engine's scheduler can replace it: an
EmbeddedBackend calls whatever `decode_fn` it was given. One generation is open at
a time, because a model's incremental state is per request and the reference path
is not meant to interleave. That is the caller's job (the server's one generation
worker owns the backend); a second generation opened while one is open is refused
at once rather than made to wait, so no lock is ever held across a yielded token.
Closing the stream (gen.close()) between tokens ends the generation there; the
prompt's prefill is one forward and runs to its end (the server's --max-prompt-tokens
bounds how long that is).
"""

from __future__ import annotations

import secrets
import threading
from typing import Callable, Iterator

import torch

from k3verify.serving.backends.base import CompletionParams, TextBackend, TokenConstraint, TokenEvent, check_prompt_ids
from optimized_stack.errors import K3Error


def pick_token(logits: torch.Tensor, params: CompletionParams, allowed: list[int] | None,
               generator: torch.Generator | None) -> TokenEvent:
    """Choose the next token from one fp32 logit row [V]; logprobs are of the raw distribution."""
    raw_logprobs = torch.log_softmax(logits.float(), dim=-1)  # [V]
    scores = logits.float()
    if allowed is not None:
        mask = torch.full_like(scores, float("-inf"))
        index = torch.tensor(allowed, dtype=torch.long)
        mask[index] = scores[index]
        scores = mask
    if params.temperature == 0:
        token = int(torch.argmax(scores))  # first maximum: ties go to the lowest id
    else:
        probs = torch.softmax(scores / params.temperature, dim=-1)  # [V]
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest head whose mass reaches top_p (the token crossing it included).
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        token = int(torch.multinomial(probs, 1, generator=generator))
    top: tuple[tuple[int, float], ...] = ()
    if params.logprobs:
        values, ids = torch.topk(raw_logprobs, params.logprobs)
        top = tuple((int(i), float(v)) for i, v in zip(ids, values))
    return TokenEvent(token_id=token, logprob=float(raw_logprobs[token]), top_logprobs=top)


@torch.no_grad()
def decode(model, prompt_ids: list[int], params: CompletionParams,
           constraint: TokenConstraint | None = None) -> Iterator[TokenEvent]:
    """Reference generation loop: whole-prompt prefill, then one forward per generated token.

    Stops after max_tokens, after a stop token (which is yielded) or when the constraint is complete.
    """
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    generator = torch.Generator().manual_seed(seed)
    state = model.new_state()
    logits = model.forward(torch.tensor(prompt_ids, dtype=torch.long), state)[-1]  # [V]
    for _ in range(params.max_tokens):
        allowed = constraint.allowed() if constraint is not None else None
        if allowed is not None and not allowed:
            return
        event = pick_token(logits, params, allowed, generator)
        yield event
        if constraint is not None:
            constraint.advance(event.token_id)
        if event.token_id in params.stop_token_ids:
            return
        logits = model.forward(torch.tensor([event.token_id], dtype=torch.long), state)[-1]


class EmbeddedBackend(TextBackend):
    """TextBackend over an in-process K3 model with the incremental new_state/forward API."""

    def __init__(self, model, tokenizer, decode_fn: Callable[..., Iterator[TokenEvent]] = decode):
        for name in ("new_state", "forward"):
            if not callable(getattr(model, name, None)):
                raise K3Error(f"the embedded backend needs a model with {name}(), got {type(model).__name__}")
        self.model = model
        self.tokenizer = tokenizer
        self.decode_fn = decode_fn
        from k3verify.serving.stack import ServeStack
        device = getattr(model, "device", None)
        self.stack = ServeStack("reference", (), getattr(device, "type", str(device or "cpu")))
        self.vocab_size = int(model.config.vocab_size)
        self._guard = threading.Lock()  # held only to flip _open, never across a yield
        self._open = False

    def generate(self, prompt_ids: list[int], params: CompletionParams,
                 constraint: TokenConstraint | None = None) -> Iterator[TokenEvent]:
        check_prompt_ids(prompt_ids, self.vocab_size)
        with self._guard:
            if self._open:
                raise K3Error("the embedded backend runs one generation at a time and one is still open; "
                              "finish or close() it first")
            self._open = True
        try:
            yield from self.decode_fn(self.model, list(prompt_ids), params, constraint)
        finally:  # runs on exhaustion, on close() (cancel) and on error
            with self._guard:
                self._open = False
