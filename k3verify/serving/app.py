"""An OpenAI-compatible server over a TextBackend (by default the embedded engine).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(streamed over SSE or not), POST /tokenize (vLLM's shape: count, tokens).
Requests are held to K3's API contract as the Kimi Vendor Verifier checks it
(check_* in serving/validation.py); a bad request gets HTTP 400 with a one-line reason and the
server keeps serving. `enforce_contract=False` turns the K3-specific rules off
(sampling values clamped, tools and formats not judged, no constraints) and
exists only as the negative control for the checks in k3verify/evals/kvv.py.

Robustness (issue 16): one worker thread owns the backend and takes requests from a bounded
queue (serving/worker.py); past --max-queue a request gets 429 with Retry-After, never a hang.
A request whose client disconnects is cancelled within one forward, streamed or not. Bodies
past --max-body-bytes get 413; nesting past 64 levels, unknown parameters, prompts past
--max-prompt-tokens and prompt + max_tokens past --max-model-len get 400. GET /health is
readiness (200 only if the worker is alive and not wedged), apart from /v1/models.

Hardening (issue 29): every field is checked by type before use (serving/fields.py: UTF-8 strings,
message fields, seeds in [0, 2**63), JSON Schemas against the draft 2020-12 meta-schema), so a bad
request is a 400 naming its field, never a 500 (tests/test_serve_fuzz.py); Retry-After on 429 is
the queue's expected wait from measured job times (serving/worker.py).

Which stack served (issue 26): the backend's `stack` (serving/stack.py) names it on every response
(header X-K3verify-Stack, `system_fingerprint` "k3verify-<label>"); answers, and a stream's finishing
chunk, carry `k3verify.path_events`, the engine path events of the steps the request took part in;
GET /stack gives the stack and every event fired since start. The engine backend batches: the
worker then runs as many generations at once as the engine schedules (max_concurrent).

Structured output is real, not simulated: response_format json_object/json_schema
and tool_choice required/named run a token constraint (backends/base.py), so the
model's own logits choose among grammar-legal tokens. Schema coverage: type,
properties (all emitted, in order), required, enum, const, items, min/maxItems,
min/maxLength, anyOf/oneOf/allOf (first branch); numeric bounds, pattern and
format are not enforced.
"""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from k3verify.serving.backends.base import (MAX_TOP_LOGPROBS, BanConstraint, CompletionParams, ProgramConstraint,
                                            TextBackend, json_object_program, tool_call_program)
from k3verify.serving.generation import Generation, chat_logprobs, completion_logprobs
from k3verify.serving.http import (ClientGone, JobStream, collect, error_body, error_response, gone_response, read_body,
                                   sse, submit)
from k3verify.serving.validation import (CHAT_PARAMS, COMPLETION_PARAMS, RequestError, ServeLimits, _fail,
                                         check_context, check_known_params, check_messages, check_response_format,
                                         check_sampling, check_stop, check_stream, check_tool_choice, check_tools,
                                         parse_json_object, type_name)
from k3verify.serving.worker import GenerationWorker, JobCancelled
from optimized_stack.errors import K3Error

class StackHeader:
    """ASGI middleware: X-K3verify-Stack on every response. Plain ASGI, not BaseHTTPMiddleware, which
    would wrap streamed bodies and hide a client's disconnect from the cancellation in serving/http.py."""

    def __init__(self, app, label: str):
        self.app, self.header = app, (b"x-k3verify-stack", label.encode("ascii"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)
        await self.app(scope, receive, send_with_header)


class InternalErrors:
    """ASGI middleware: an exception raised before the response started becomes a JSON 500 that
    names it, logged with its traceback, and is not re-raised. Why: the fourth H200 release run's
    KVV rows read only "Internal Server Error" (or a connection reset: uvicorn closes the connection
    when an app raises after a response went out, which starlette's handler path does), and the
    cause, jsonschema missing on the device, sat in a worker log that did not come back. A loopback
    verification server has nothing to hide from its own client."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, tracking)
        except Exception as exc:
            if started:                  # a stream cut mid-way: nothing left to answer with
                raise
            logging.getLogger("k3verify.serve").exception("internal error on %s", scope.get("path"))
            await JSONResponse(status_code=500, content=error_body(f"internal error: {type(exc).__name__}: {exc}",
                                                                   500))(scope, receive, send)


# ---------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------

def create_app(backend: TextBackend, tokenizer, model_name: str = "k3-mini", enforce_contract: bool = True,
               limits: ServeLimits = ServeLimits()):
    """FastAPI app over `backend`, which from now on only app.state.worker calls.
    enforce_contract=False is the KVV negative control only."""
    app = FastAPI(title="k3verify serve")
    # a batching backend (the engine's) runs several generations at once, one worker thread each
    worker = app.state.worker = GenerationWorker(limits.max_queue, limits.stall_s,
                                                 workers=getattr(backend, "max_concurrent", 1))
    app.state.model_name = model_name
    app.state.backend = backend
    # which stack serves (serving/stack.py), on every response: the KVV run proves with it which
    # stack it judged (X-K3verify-Stack, system_fingerprint; per request the path events that fired)
    stack = getattr(backend, "stack", None)
    stack_label = stack.label if stack is not None else type(backend).__name__
    fingerprint = f"k3verify-{stack_label}"

    def evidence(gen: Generation) -> dict:
        return {"k3verify": {"stack": stack_label, "path_events": dict(sorted(gen.path_events.items()))}}

    app.add_middleware(InternalErrors)
    app.add_middleware(StackHeader, label=stack_label)        # outermost: the 500 carries the header too
    unit_ids = {chr(b): tokenizer.encode(chr(b))[0] for b in range(32, 127)}
    unit_ids.update({s: tokenizer.token_id(s) for s in tokenizer.specials})
    vocab_size = tokenizer.vocab_size
    chat_stops = (tokenizer.im_end_id, tokenizer.eos_id)
    created = int(time.time())

    async def read_json(request: Request, allowed: frozenset | None = None) -> dict:
        body = parse_json_object(await read_body(request, limits.max_body_bytes), limits.max_json_depth)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError(f"model: expected a string; got {type_name(model)}", "model")
        if model is not None and model != model_name:
            raise RequestError(f"model {model!r} is not served here; this server serves {model_name!r}", "model", 404)
        if allowed is not None:
            check_known_params(body, allowed, request.url.path)
        return body

    @app.exception_handler(RequestError)
    async def _request_error(request, exc: RequestError):
        return error_response(exc)

    @app.exception_handler(K3Error)
    async def _k3_error(request, exc: K3Error):
        return JSONResponse(status_code=400, content=error_body(str(exc), 400))

    @app.exception_handler(JobCancelled)
    async def _cancelled(request, exc: JobCancelled):  # a whole answer cut short by shutdown
        return error_response(RequestError(f"generation cancelled: {exc}", None, 503, "cancelled",
                                           {"Retry-After": "5"}))

    @app.exception_handler(ClientGone)
    async def _gone(request, exc: ClientGone):  # nobody reads this; it keeps the access log honest
        return gone_response()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "k3verify"}]}

    @app.get("/stack")
    @app.get("/v1/stack")
    async def stack_info():
        """What serves, and every path event its steps fired since the server started."""
        info = stack.to_dict() if stack is not None else {"stack": None, "label": stack_label, "toggles": []}
        fired = backend.path_events() if callable(getattr(backend, "path_events", None)) else {}
        return {**info, "fingerprint": fingerprint, "path_events": dict(sorted(fired.items()))}

    @app.get("/health")
    async def health():
        probe = Generation(backend, tokenizer, tokenizer.encode("ok"), CompletionParams(max_tokens=1))
        ok, detail = await worker.ready(probe, limits.probe_timeout_s)
        return JSONResponse(status_code=200 if ok else 503, content={"status": "ok" if ok else "unavailable",
                                                                     **detail})

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
        body = await read_json(request)
        if "messages" in body:
            ids, _ = chat_prompt(body)
        elif isinstance(body.get("prompt"), str):
            ids = tokenizer.encode(body["prompt"])
        else:
            _fail("tokenize needs 'prompt' (a string) or 'messages'", "prompt")
        return {"count": len(ids), "tokens": ids, "max_model_len": limits.max_model_len}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_json(request, CHAT_PARAMS)
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
        check_context(len(prompt_ids), params.max_tokens, limits, "messages")
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
        job = submit(worker, gen)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": now, "model": model_name, "system_fingerprint": fingerprint}

        if not stream:
            pieces = await collect(worker, job, request)
            text, events = "".join(t for t, _ in pieces), [e for _, evs in pieces for e in evs]
            message = {"role": "assistant", "content": text if text or not gen.tool_calls else None}
            if gen.tool_calls:
                message["tool_calls"] = gen.tool_calls
            choice_ = {"index": 0, "message": message, "finish_reason": gen.finish_reason,
                       "logprobs": {"content": chat_logprobs(tokenizer, events)} if want_logprobs else None}
            return {**head, "object": "chat.completion", "choices": [choice_], "usage": gen.usage(), **evidence(gen)}

        def chunk(delta, finish=None, logprobs=None):
            c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            return sse({**head, "object": "chat.completion.chunk", "choices": [c],
                        **({"usage": None} if include_usage else {}), **(evidence(gen) if finish else {})})

        async def events_stream():
            yield chunk({"role": "assistant", "content": ""})
            try:
                async for text, events in job.pieces():
                    lp = {"content": chat_logprobs(tokenizer, events)} if want_logprobs else None
                    yield chunk({"content": text}, logprobs=lp)
            except Exception as e:  # cancelled by shutdown, or the backend failed: say so, no [DONE]
                yield sse(error_body(f"generation ended early: {e}", 503, code="cancelled"))
                return
            if gen.tool_calls:
                yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(gen.tool_calls)]})
            yield chunk({}, finish=gen.finish_reason)
            if include_usage:
                yield sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"
        return JobStream(events_stream(), worker, job)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request, COMPLETION_PARAMS)
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
        if body.get("echo") is not None and body["echo"] is not False:  # `in (None, False)` would let 0 through
            _fail("echo is not supported by this server; send false or omit it", "echo")
        params = check_sampling(body, enforce_contract, logprobs, (tokenizer.eos_id,))
        check_context(len(prompt_ids), params.max_tokens, limits, "prompt")
        gen = Generation(backend, tokenizer, prompt_ids, params, None, stops)
        job = submit(worker, gen)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name,
                "system_fingerprint": fingerprint}

        if not stream:
            pieces = await collect(worker, job, request)
            text = "".join(t for t, _ in pieces)
            events = [e for _, evs in pieces for e in evs]
            choice_ = {"index": 0, "text": text, "finish_reason": gen.finish_reason,
                       "logprobs": completion_logprobs(tokenizer, events, 0) if logprobs is not None else None}
            return {**head, "object": "text_completion", "choices": [choice_], "usage": gen.usage(), **evidence(gen)}

        async def events_stream():
            offset = 0
            try:
                async for text, events in job.pieces():
                    lp = completion_logprobs(tokenizer, events, offset) if logprobs is not None else None
                    offset += len(text)
                    yield sse({**head, "object": "text_completion",
                               "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": lp}]})
            except Exception as e:
                yield sse(error_body(f"generation ended early: {e}", 503, code="cancelled"))
                return
            yield sse({**head, "object": "text_completion",
                       "choices": [{"index": 0, "text": "", "finish_reason": gen.finish_reason, "logprobs": None}],
                       **evidence(gen)})
            if include_usage:
                yield sse({**head, "object": "text_completion", "choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"
        return JobStream(events_stream(), worker, job)

    return app
