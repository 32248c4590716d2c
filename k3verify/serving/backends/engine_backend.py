"""The engine backend: requests served by optimized_stack's Engine, batched across requests.

    backend = EngineBackend(model, tokenizer, serve_stack("counted", [], "cpu"))
    stream = backend.generate(prompt_ids, params, constraint)     # from any number of threads
    for event in stream: ...                                      # TokenEvents, as EmbeddedBackend's
    stream.path_events                                            # what fired in the steps it took part in

One thread (the stepper) owns the Engine. generate() hands a request to it and returns a stream
the caller blocks on; the stepper admits whatever arrived, runs one engine step over every running
request (continuous batching; with batched_decode their decodes are one forward), and hands each
request its token. So concurrent HTTP requests share steps; the server runs up to
`max_concurrent` generations at once (serving/worker.py).

Tokens are chosen by the server's own rule (embedded.pick_token: the same greedy tie-break,
seeded sampling, top_p, grammar constraint and logprobs as the reference backend) from the
engine's logits row, through the engine's per-request sampler hook; the request's grammar being
complete, or its stream closed, ends it between steps (Engine.abort_request). With exact toggles
a greedy request's tokens therefore equal the reference backend's bit for bit
(tests/test_serve_engine.py holds that, and a fast-path mutant breaks it).

Evidence (design.md "Evidence that a check ran"): every step's path events (optimized_stack/
events.py, plus op-slot calls of swapped ops) are added to each request that took part in it, so
a response can say that, e.g., its decodes ran in the batched step (fast_decode_rows).
"""
from __future__ import annotations

import contextlib
import itertools
import queue
import secrets
import threading
import time
from collections import Counter
from typing import Iterator

import torch

from k3verify.serving.backends.base import CompletionParams, TokenConstraint, TokenEvent, check_prompt_ids
from k3verify.serving.backends.embedded import pick_token
from k3verify.serving.stack import ServeStack
from optimized_stack import toggles as registry
from optimized_stack.engine import Engine
from optimized_stack.engine.options import EngineOptions, SamplingParams
from optimized_stack.errors import K3Error

POLL_S = 0.5            # a blocked stream re-checks that the stepper is alive this often


class ServingSampler:
    """The engine's per-request sampler hook running the server's token rule; it sees every row."""

    takes_device_token = False   # logprobs and the grammar need the row, not just the argmax

    def __init__(self, params: CompletionParams, constraint: TokenConstraint | None):
        self.params, self.constraint = params, constraint
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(seed)    # as embedded.decode seeds it
        self.events: list[TokenEvent] = []                      # chosen, not yet handed over

    def sample(self, row: torch.Tensor) -> int:
        allowed = self.constraint.allowed() if self.constraint is not None else None
        event = pick_token(row.detach().to("cpu", torch.float32), self.params, allowed, self.generator)
        if self.constraint is not None:
            self.constraint.advance(event.token_id)
        self.events.append(event)
        return event.token_id

    @property
    def complete(self) -> bool:
        """The grammar allows nothing more: the reference loop ends here without another token."""
        allowed = self.constraint.allowed() if self.constraint is not None else None
        return allowed is not None and not allowed


class EngineStream:
    """One request's tokens, as the stepper hands them over; close() ends the request."""

    def __init__(self, backend: "EngineBackend", request_id: str):
        self._backend, self.request_id = backend, request_id
        self._items: queue.Queue = queue.Queue()   # ("token", TokenEvent) | ("end", None) | ("error", exc)
        self.path_events: Counter = Counter()      # filled by the stepper; final once the stream ended
        self._ended = False

    def __iter__(self) -> "EngineStream":
        return self

    def __next__(self) -> TokenEvent:
        if self._ended:
            raise StopIteration
        while True:
            try:
                kind, value = self._items.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self._backend.alive:
                    self._ended = True
                    raise K3Error("the engine's stepper thread stopped; restart the server") from None
        if kind == "token":
            return value
        self._ended = True
        if kind == "error":
            raise value
        raise StopIteration

    def close(self) -> None:
        if not self._ended:
            self._ended = True
            self._backend._abort(self.request_id)


class EngineBackend:
    """TextBackend over an Engine with `stack`'s toggles applied for the backend's life."""

    def __init__(self, model, tokenizer, stack: ServeStack, batch_window_s: float = 0.0):
        if not stack.engine:
            raise K3Error("EngineBackend serves an engine stack; the reference stack is EmbeddedBackend's")
        if batch_window_s < 0:
            raise K3Error(f"batch_window_s must be >= 0, got {batch_window_s!r}")
        self.model, self.tokenizer, self.stack = model, tokenizer, stack
        self.vocab_size = int(model.config.vocab_size)
        # why a window: requests that arrive together start together, so their decodes share
        # steps from the first token (tests rely on it to batch; 0 = step as soon as one arrives)
        self.batch_window_s = batch_window_s
        self._toggles = contextlib.ExitStack()
        applied = self._toggles.enter_context(registry.applied(list(stack.resolved)))
        self._op_events = applied.events
        try:
            # the stack's options on the KDA grid in force (the sub-block toggles' wider blocks)
            self.engine = Engine(model, EngineOptions.from_dict(applied.engine_for(model.device)))
        except Exception:
            self._toggles.close()
            raise
        opts = self.engine.opts
        self.max_concurrent = opts.max_num_seqs if opts.continuous_batching else 1
        self.events_total: Counter = Counter()     # every step's events since start (GET /stack)
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, list[int], SamplingParams, ServingSampler, EngineStream]] = []
        self._aborts: set[str] = set()
        self._streams: dict[str, tuple[EngineStream, ServingSampler]] = {}
        self._ids = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="k3verify-engine-step", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- any thread ---------------------------------------------------------------------------

    def generate(self, prompt_ids: list[int], params: CompletionParams,
                 constraint: TokenConstraint | None = None) -> Iterator[TokenEvent]:
        check_prompt_ids(prompt_ids, self.vocab_size)
        need = len(prompt_ids) + params.max_tokens - 1
        capacity = self.engine.store.capacity_tokens()
        if capacity and need > capacity:
            raise K3Error(f"the request needs {need} tokens of MLA cache (prompt + max_tokens - 1); "
                          f"the engine's pool holds {capacity}")
        rid = f"serve-{next(self._ids)}"
        sampling = SamplingParams(max_new_tokens=params.max_tokens, temperature=float(params.temperature),
                                  stop_ids=tuple(params.stop_token_ids), ignore_eos=True)
        stream = EngineStream(self, rid)
        with self._cond:
            if self._closed or not self.alive:
                raise K3Error("the engine backend is closed")
            self._inbox.append((rid, list(map(int, prompt_ids)), sampling, ServingSampler(params, constraint),
                                stream))
            self._cond.notify_all()
        return stream

    def path_events(self) -> dict[str, int]:
        with self._cond:
            return dict(self.events_total)

    def close(self) -> None:
        """Stop the stepper (open streams end with an error) and restore the toggles' op slots."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(10)
        self._toggles.close()

    def _abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.add(request_id)
            self._cond.notify_all()

    # ---- the stepper thread -------------------------------------------------------------------

    def _serve(self) -> None:
        eng = self.engine
        while True:
            with self._cond:
                while not (self._closed or self._inbox or self._aborts or eng.has_unfinished()):
                    self._cond.wait(POLL_S)
                if self._closed:
                    break
                if self._inbox and not eng.has_unfinished() and self.batch_window_s:
                    deadline = time.monotonic() + self.batch_window_s    # let the rest of a burst arrive
                    while not self._closed and time.monotonic() < deadline:
                        self._cond.wait(deadline - time.monotonic())
                arrived, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
            for rid, ids, sampling, sampler, stream in arrived:
                try:
                    eng.add_request(ids, sampling, request_id=rid, arrival_step=eng.step_index, sampler=sampler)
                except Exception as e:      # refused (pool too small ...): this request only
                    stream._items.put(("error", e))
                    continue
                self._streams[rid] = (stream, sampler)
            for rid in aborts:
                self._end(rid, abort=True)
            if not eng.has_unfinished():
                continue
            try:
                self._step()
            except Exception as e:          # a failed step leaves the engine unusable: say so to all
                for rid in list(self._streams):
                    self._streams.pop(rid)[0]._items.put(("error", e))
                break
        for rid in list(self._streams):
            self._streams.pop(rid)[0]._items.put(("error", K3Error("the engine backend closed")))

    def _step(self) -> None:
        eng = self.engine
        before = Counter(eng.events) + Counter(self._op_events)
        outputs = eng.step()
        fired = (Counter(eng.events) + Counter(self._op_events)) - before
        self.events_total.update(fired)
        for out in outputs:
            if out.request_id not in self._streams:
                continue
            stream, sampler = self._streams[out.request_id]
            stream.path_events.update(fired)
            for event in sampler.events:
                stream._items.put(("token", event))
            sampler.events.clear()
            if out.finished:
                self._end(out.request_id)
            elif sampler.complete:           # the grammar is done: no further token, as embedded.decode
                self._end(out.request_id, abort=True)

    def _end(self, request_id: str, abort: bool = False) -> None:
        if abort:
            self.engine.abort_request(request_id)
        self.engine.forget(request_id)
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            entry[0]._items.put(("end", None))

