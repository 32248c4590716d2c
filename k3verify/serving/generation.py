"""One request's generation: backend tokens in, text deltas out (streamed and whole answers alike).

Generation runs on the server's generation worker (serving/worker.py), never on the event
loop. `should_stop` is asked after every token the backend produced, so a cancelled
request (client gone, server draining) stops within one forward and the backend's
stream is closed at once.
"""

from __future__ import annotations

from typing import Callable, Iterator

from k3verify.serving.backends.base import CompletionParams, TextBackend


class Generation:
    """Runs one request on the backend; `deltas()` yields (text, events) pieces, then the
    attributes finish_reason, tool_calls, completion_tokens are final."""

    def __init__(self, backend: TextBackend, tokenizer, prompt_ids: list[int], params: CompletionParams,
                 constraint=None, stops: list[str] = (), chat: bool = False):
        self.backend, self.tokenizer = backend, tokenizer
        self.prompt_ids, self.params, self.constraint = prompt_ids, params, constraint
        self.stops, self.chat = list(stops), chat
        self.ids: list[int] = []
        self.finish_reason = "stop"
        self.tool_calls: list[dict] = []
        self.stopped_early = False  # should_stop() ended it: the answer is incomplete
        # the path events of the engine steps it took part in (engine backend only; {} otherwise)
        self.path_events: dict[str, int] = {}

    @property
    def completion_tokens(self) -> int:
        return len(self.ids)

    def deltas(self, should_stop: Callable[[], bool] = lambda: False) -> Iterator[tuple[str, list]]:
        section_begin = self.tokenizer.token_id("<|tool_calls_section_begin|>")
        decoder = self.tokenizer.incremental_decoder(skip_special=True)
        hold = max((len(s) for s in self.stops), default=1) - 1  # chars a stop string could still need
        pending, events, in_tools, stopped, cut_here = "", [], False, False, False
        stream = self.backend.generate(self.prompt_ids, self.params, self.constraint)
        try:
            for ev in stream:
                if should_stop():  # checked before any use of ev: a cancelled answer shows nothing more
                    self.stopped_early = True
                    return
                self.ids.append(ev.token_id)
                if ev.token_id in self.params.stop_token_ids:
                    stopped = True
                    break
                if self.chat and ev.token_id == section_begin:
                    in_tools = True
                if in_tools:
                    continue  # the tool-call section is returned as tool_calls, never as content
                pending += decoder.feed(ev.token_id)
                events.append(ev)
                cut = min((i for i in (pending.find(s) for s in self.stops) if i >= 0), default=-1)
                if cut >= 0:
                    pending, stopped, cut_here = pending[:cut], True, True
                    break
                if len(pending) > hold:
                    yield pending[: len(pending) - hold], events
                    pending, events = pending[len(pending) - hold:], []
        finally:
            stream.close()  # ends the backend's generator now, also on early stop, cancel or error
            self.path_events = dict(getattr(stream, "path_events", {}))
        if not cut_here:
            pending += decoder.flush()  # a dangling partial UTF-8 sequence shows as U+FFFD
        if pending or events:
            yield pending, events
        done = stopped or (self.constraint is not None and getattr(self.constraint, "done", False))
        self.finish_reason = "stop" if done or len(self.ids) < self.params.max_tokens else "length"
        if in_tools:
            _, calls = self.tokenizer.parse_tool_calls(self.ids, strict=False)
            self.tool_calls = [{"id": c["id"], "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
            if self.tool_calls:
                self.finish_reason = "tool_calls"

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": self.completion_tokens,
                "total_tokens": len(self.prompt_ids) + self.completion_tokens}


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer, events) -> list[dict]:
    def entry(tid, lp):
        text = _token_text(tokenizer, tid)
        return {"token": text, "logprob": lp, "bytes": list(tokenizer.decode_bytes([tid]))}
    return [{**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top_logprobs]}
            for e in events]


def completion_logprobs(tokenizer, events, offset: int) -> dict:
    tokens, offsets = [], []
    for e in events:
        tokens.append(_token_text(tokenizer, e.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in e.top_logprobs} for e in events],
            "text_offset": offsets}
