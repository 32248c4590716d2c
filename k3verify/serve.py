"""An OpenAI-compatible server over a TextBackend (by default the embedded engine).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(streamed over SSE or not), POST /tokenize (vLLM's shape: count, tokens).
Requests are held to K3's API contract as the Kimi Vendor Verifier checks it
(check_* in serve_validation.py); a bad request gets HTTP 400 with a one-line reason and the
server keeps serving. `enforce_contract=False` turns the K3-specific rules off
(sampling values clamped, tools and formats not judged, no constraints) and
exists only as the negative control for the checks in k3verify/evals/kvv.py.

Structured output is real, not simulated: response_format json_object/json_schema
and tool_choice required/named run a token constraint (backends/base.py), so the
model's own logits choose among grammar-legal tokens. Schema coverage: type,
properties (all emitted, in order), required, enum, const, items, min/maxItems,
min/maxLength, anyOf/oneOf/allOf (first branch); numeric bounds, pattern and
format are not enforced.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from k3verify.backends.base import (MAX_TOP_LOGPROBS, BanConstraint, ProgramConstraint, SamplingParams,
                                    TextBackend, json_object_program, tool_call_program)
from k3verify.serve_validation import (RequestError, _fail, check_messages, check_response_format, check_sampling,
                                       check_stop, check_stream, check_tool_choice, check_tools)
from optimized_stack.errors import K3Error


# ---------------------------------------------------------------------------
# Generation: one code path for streamed and whole answers
# ---------------------------------------------------------------------------

class Generation:
    """Runs one request on the backend; `deltas()` yields (text, events) pieces, then the
    attributes finish_reason, tool_calls, completion_tokens are final."""

    def __init__(self, backend: TextBackend, tokenizer, prompt_ids: list[int], params: SamplingParams,
                 constraint=None, stops: list[str] = (), chat: bool = False):
        self.backend, self.tokenizer = backend, tokenizer
        self.prompt_ids, self.params, self.constraint = prompt_ids, params, constraint
        self.stops, self.chat = list(stops), chat
        self.ids: list[int] = []
        self.finish_reason = "stop"
        self.tool_calls: list[dict] = []

    @property
    def completion_tokens(self) -> int:
        return len(self.ids)

    def deltas(self) -> Iterator[tuple[str, list]]:
        section_begin = self.tokenizer.token_id("<|tool_calls_section_begin|>")
        decoder = self.tokenizer.incremental_decoder(skip_special=True)
        hold = max((len(s) for s in self.stops), default=1) - 1  # chars a stop string could still need
        pending, events, in_tools, stopped, cut_here = "", [], False, False, False
        stream = self.backend.generate(self.prompt_ids, self.params, self.constraint)
        try:
            for ev in stream:
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
            stream.close()  # releases the backend's lock at once, also on early stop or disconnect
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


# ---------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------

def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(backend: TextBackend, tokenizer, model_name: str = "k3-mini", enforce_contract: bool = True):
    """FastAPI app over `backend`. enforce_contract=False is the KVV negative control only."""
    app = FastAPI(title="k3verify serve")
    unit_ids = {chr(b): tokenizer.encode(chr(b))[0] for b in range(32, 127)}
    unit_ids.update({s: tokenizer.token_id(s) for s in tokenizer.specials})
    vocab_size = tokenizer.vocab_size
    chat_stops = (tokenizer.im_end_id, tokenizer.eos_id)
    created = int(time.time())

    async def read_body(request: Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            _fail("the request body must be a JSON object, got something that is not JSON")
        if not isinstance(body, dict):
            _fail(f"the request body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if model is not None and model != model_name:
            raise RequestError(f"model {model!r} is not served here; this server serves {model_name!r}", "model", 404)
        return body

    @app.exception_handler(RequestError)
    async def _request_error(request, exc: RequestError):
        kind = "invalid_request_error" if exc.status == 400 else "not_found_error"
        return JSONResponse(status_code=exc.status,
                            content={"error": {"message": str(exc), "type": kind, "param": exc.param, "code": None}})

    @app.exception_handler(K3Error)
    async def _k3_error(request, exc: K3Error):
        return JSONResponse(status_code=400, content={"error": {"message": str(exc), "type": "invalid_request_error",
                                                                "param": None, "code": None}})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "k3verify"}]}

    def chat_prompt(body: dict) -> tuple[list[int], list[dict]]:
        if not enforce_contract:  # negative control: drop whatever tools arrive instead of judging them
            messages = [{k: v for k, v in m.items() if k != "tools"} if isinstance(m, dict) else m
                        for m in body.get("messages") or []]
            tools = body.get("tools") if isinstance(body.get("tools"), list) else None
            return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True), []
        messages, dynamic = check_messages(body.get("messages"))
        tools = check_tools(body["tools"], "tools") if body.get("tools") is not None else []
        names = [t["function"]["name"] for t in tools + dynamic]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            _fail(f"tool names must be unique across tools and dynamic declarations, got duplicates {dup}", "tools")
        return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True), tools + dynamic

    @app.post("/tokenize")
    @app.post("/v1/tokenize")  # alias, so clients holding the /v1 base URL find it too
    async def tokenize(request: Request):
        body = await read_body(request)
        if "messages" in body:
            ids, _ = chat_prompt(body)
        elif isinstance(body.get("prompt"), str):
            ids = tokenizer.encode(body["prompt"])
        else:
            _fail("tokenize needs 'prompt' (a string) or 'messages'", "prompt")
        return {"count": len(ids), "tokens": ids, "max_model_len": None}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_body(request)
        prompt_ids, tools = chat_prompt(body)
        stream, include_usage = check_stream(body)
        stops = check_stop(body)
        want_logprobs = body.get("logprobs", False)
        if not isinstance(want_logprobs, bool):
            _fail(f"logprobs must be a boolean for chat completions, got {want_logprobs!r}", "logprobs")
        top = body.get("top_logprobs")
        if top is not None and (not want_logprobs or isinstance(top, bool) or not isinstance(top, int)
                                or not 0 <= top <= MAX_TOP_LOGPROBS):
            _fail(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] with logprobs true, got {top!r}",
                  "top_logprobs")
        params = check_sampling(body, enforce_contract, (top or 0) if want_logprobs else None, chat_stops)
        constraint = None
        if enforce_contract:
            forced = check_tool_choice(body.get("tool_choice"), tools)
            fmt, schema = check_response_format(body.get("response_format"))
            if forced not in (None, "none") and fmt != "text":
                _fail("response_format json output cannot be combined with a forced tool call", "response_format")
            prior_calls = sum(len(m.get("tool_calls") or []) for m in body["messages"] if isinstance(m, dict))
            if forced not in (None, "none"):
                constraint = ProgramConstraint(tool_call_program(tools, forced, prior_calls), unit_ids)
            elif fmt != "text":
                constraint = ProgramConstraint(json_object_program(schema), unit_ids)
            elif forced == "none" or not tools:
                constraint = BanConstraint(vocab_size, {tokenizer.token_id("<|tool_calls_section_begin|>")})
        gen = Generation(backend, tokenizer, prompt_ids, params, constraint, stops, chat=True)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": now, "model": model_name}

        if not stream:
            def run():
                pieces = list(gen.deltas())
                return "".join(t for t, _ in pieces), [e for _, evs in pieces for e in evs]
            text, events = await run_in_threadpool(run)
            message = {"role": "assistant", "content": text if text or not gen.tool_calls else None}
            if gen.tool_calls:
                message["tool_calls"] = gen.tool_calls
            choice_ = {"index": 0, "message": message, "finish_reason": gen.finish_reason,
                       "logprobs": {"content": chat_logprobs(tokenizer, events)} if want_logprobs else None}
            return {**head, "object": "chat.completion", "choices": [choice_], "usage": gen.usage()}

        def events_stream():
            def chunk(delta, finish=None, logprobs=None):
                c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
                return _sse({**head, "object": "chat.completion.chunk", "choices": [c],
                             **({"usage": None} if include_usage else {})})
            yield chunk({"role": "assistant", "content": ""})
            for text, events in gen.deltas():
                lp = {"content": chat_logprobs(tokenizer, events)} if want_logprobs else None
                yield chunk({"content": text}, logprobs=lp)
            if gen.tool_calls:
                yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(gen.tool_calls)]})
            yield chunk({}, finish=gen.finish_reason)
            if include_usage:
                yield _sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"
        return StreamingResponse(events_stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            prompt_ids = tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            if not all(0 <= i < vocab_size for i in prompt):
                _fail(f"prompt token ids must be in [0, {vocab_size})", "prompt")
            prompt_ids = list(prompt)
        else:
            _fail("prompt must be a non-empty string or a non-empty list of token ids (one prompt per request)",
                  "prompt")
        stream, include_usage = check_stream(body)
        stops = check_stop(body)
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            _fail(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] for completions, got {logprobs!r}",
                  "logprobs")
        if body.get("echo"):
            _fail("echo is not supported by this server", "echo")
        params = check_sampling(body, enforce_contract, logprobs, (tokenizer.eos_id,))
        gen = Generation(backend, tokenizer, prompt_ids, params, None, stops)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}

        if not stream:
            def run():
                return list(gen.deltas())
            pieces = await run_in_threadpool(run)
            text = "".join(t for t, _ in pieces)
            events = [e for _, evs in pieces for e in evs]
            choice_ = {"index": 0, "text": text, "finish_reason": gen.finish_reason,
                       "logprobs": completion_logprobs(tokenizer, events, 0) if logprobs is not None else None}
            return {**head, "object": "text_completion", "choices": [choice_], "usage": gen.usage()}

        def events_stream():
            offset = 0
            for text, events in gen.deltas():
                lp = completion_logprobs(tokenizer, events, offset) if logprobs is not None else None
                offset += len(text)
                yield _sse({**head, "object": "text_completion",
                            "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": lp}]})
            yield _sse({**head, "object": "text_completion",
                        "choices": [{"index": 0, "text": "", "finish_reason": gen.finish_reason, "logprobs": None}]})
            if include_usage:
                yield _sse({**head, "object": "text_completion", "choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"
        return StreamingResponse(events_stream(), media_type="text/event-stream")

    return app


# ---------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------

class ServerThread:
    """Run an app with uvicorn on a background thread (tests, `k3verify kvv --self`); port 0 = ephemeral."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    lifespan="off", access_log=False))
        self.host = host
        self._thread = threading.Thread(target=self.server.run, name="k3verify-serve", daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://{self.host}:{self.port}/v1"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)


def build_embedded_app(model=None, enforce_contract: bool = True, **load_options):
    """Load a model (preset name, path, or None for the embedded default) and wrap it in the app;
    load_options go to load_model (allow_nonfinite, allow_dtype_cast)."""
    from k3verify.backends.embedded import EmbeddedBackend
    from optimized_stack import load_model
    from optimized_stack.tokenizer import load_tokenizer

    loaded = load_model(model, **load_options)
    tokenizer = load_tokenizer(model) if isinstance(model, str) else load_tokenizer(None)
    if tokenizer.vocab_size != loaded.config.vocab_size:
        raise K3Error(f"tokenizer vocab {tokenizer.vocab_size} does not match the model's {loaded.config.vocab_size}")
    name = str(model) if model is not None else "k3-mini"
    return create_app(EmbeddedBackend(loaded, tokenizer), tokenizer, name, enforce_contract)


def serve_main(model=None, host: str = "127.0.0.1", port: int = 8000, **load_options) -> int:
    """`k3verify serve`: serve the embedded engine until interrupted. Returns an exit code."""
    import uvicorn
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise K3Error(f"port must be an integer in [0, 65535], got {port!r}")
    uvicorn.run(build_embedded_app(model, **load_options), host=host, port=port, log_level="info")
    return 0
