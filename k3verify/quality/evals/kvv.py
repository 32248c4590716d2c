"""Kimi Vendor Verifier, API-contract part, as checks against any OpenAI-compatible endpoint.

Re-expressed from the facts of MoonshotAI/Kimi-Vendor-Verifier (tests/params, k3_features,
tool_call_json_schema, prompt_tokens): K3's immutable sampling values and the wrong values
that must be refused (temperature 0.5, top_p 0.8, presence/frequency penalty 0.5, n 2);
response_format text/json_object/json_schema and their 400s; tool_choice required/none/named
and their 400s; dynamic tools declared on system messages (messages[].tools, no content key)
and their 400s; usage.prompt_tokens; streamed chunks reassembled. One check is this project's,
not KVV's: greedy answers sent at once equal the same requests sent alone (batch invariance of the
served stack under load). Each check is name / status (pass, fail, skip) / reason. A skip always
says what it would need.

Parts that only a real K3 endpoint can answer are skipped with that reason, never passed:
prompt_tokens against KVV's expected constants (they are counts of K3's own tokenizer) and
stream equality where the endpoint refuses greedy decoding.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from dataclasses import asdict
from typing import Callable

import httpx

from k3verify.quality.evals.json_schema import schema_errors
from k3verify.quality.evals.kvv_client import (STATUSES, USER, Client, KvvOutcome, call_check, calls_of, error_line,
                                               expect_200, expect_400, json_reply, message_of, read_json, reassemble,
                                               set_fields)
from optimized_stack.errors import K3Error

# KVV tests/params facts: (parameter, thinking default, non-thinking default, wrong value).
IMMUTABLE_PARAMS = (
    ("temperature", 1.0, 0.6, 0.5),
    ("top_p", 0.95, 0.95, 0.8),
    ("presence_penalty", 0, 0, 0.5),
    ("frequency_penalty", 0, 0, 0.5),
    ("n", 1, 1, 2),
)
# Out of range for every OpenAI-compatible K3 deployment (temperature must lie in [0, 1]).
OUT_OF_RANGE = (("temperature", 1.5), ("temperature", -0.1))

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CALC_TOOL = {"type": "function", "function": {
    "name": "Calculator", "description": "Evaluate one arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
                 "required": ["answer", "confidence"], "additionalProperties": False}


def _plan(c: Client, thinking: bool, small: int, big: int) -> list[tuple[str, Callable[[], KvvOutcome]]]:
    """Every check as (name, thunk), in run order; thunks make their own requests."""
    plan: list[tuple[str, Callable[[], KvvOutcome]]] = []

    def add(name):
        def register(fn):
            plan.append((name, lambda: fn(name)))
            return fn
        return register

    @add("models.lists_model")
    def _(name):
        r = c.http.get("/models")
        ids = [m.get("id") for m in (read_json(r).get("data") or [])] if r.status_code == 200 else []
        if c.model in ids:
            return KvvOutcome(name, "pass", f"/models lists {c.model!r}")
        return KvvOutcome(name, "fail", f"/models (HTTP {r.status_code}) does not list {c.model!r}: {ids[:5]}")

    # -- tests/params: defaults accepted, wrong values refused -------------------------------
    @add("params.no_optional_params")
    def _(name):
        return expect_200(name, *c.chat(small), "a request without optional parameters")

    for param, think_default, plain_default, wrong in IMMUTABLE_PARAMS:
        default = think_default if thinking else plain_default
        plan.append((f"params.accept.{param}={default}", lambda p=param, d=default, n=f"params.accept.{param}={default}":
                     expect_200(n, *c.chat(small, **{p: d}), f"{p}={d}")))
    for param, wrong in [(p, w) for p, _, _, w in IMMUTABLE_PARAMS] + list(OUT_OF_RANGE):
        plan.append((f"params.reject.{param}={wrong}", lambda p=param, w=wrong, n=f"params.reject.{param}={wrong}":
                     expect_400(n, *c.chat(small, **{p: w}), f"{p}={w}")))

    # -- k3_features: response_format -----------------------------------------------------------
    bad_formats = {
        "unknown_type": {"type": "xml"},
        "json_schema_without_schema": {"type": "json_schema", "json_schema": {"name": "answer"}},
        "json_schema_not_an_object": {"type": "json_schema", "json_schema": "answer"},
    }
    for label, fmt in bad_formats.items():
        plan.append((f"response_format.reject.{label}", lambda f=fmt, n=f"response_format.reject.{label}":
                     expect_400(n, *c.chat(small, response_format=f), f"response_format={json.dumps(f)}")))

    @add("response_format.text")
    def _(name):
        return expect_200(name, *c.chat(small, response_format={"type": "text"}), "response_format text")

    @add("response_format.json_object")
    def _(name):
        doc, failed = json_reply(name, "response_format json_object", *c.chat(
            big, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "Reply with a JSON object describing a cat."}]))
        if failed:
            return failed
        if not isinstance(doc, dict):
            return KvvOutcome(name, "fail", f"json_object must give an object, got {type(doc).__name__}")
        return KvvOutcome(name, "pass", f"content is a JSON object with {len(doc)} key(s)")

    @add("response_format.json_schema")
    def _(name):
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
        doc, failed = json_reply(name, "response_format json_schema", *c.chat(
            big, response_format=fmt,
            messages=[{"role": "user", "content": "Is the sky blue? Answer with confidence."}]))
        if failed:
            return failed
        errors = schema_errors(doc, ANSWER_SCHEMA)
        if errors:
            return KvvOutcome(name, "fail", f"content breaks the schema: {errors[0]}")
        return KvvOutcome(name, "pass", "content is valid against the requested schema")

    # -- k3_features: tool_choice ---------------------------------------------------------------
    weather_q = [{"role": "user", "content": "What is the weather in Paris?"}]
    plan.append(("tool_choice.reject.required_without_tools", lambda: expect_400(
        "tool_choice.reject.required_without_tools", *c.chat(small, tool_choice="required"),
        "tool_choice=required with no tools")))
    plan.append(("tool_choice.reject.unknown_function", lambda: expect_400(
        "tool_choice.reject.unknown_function",
        *c.chat(small, tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "no_such_fn"}}),
        "tool_choice naming an undeclared function")))
    plan.append(("tool_choice.reject.bad_value", lambda: expect_400(
        "tool_choice.reject.bad_value", *c.chat(small, tools=[WEATHER_TOOL], tool_choice="sometimes"),
        "tool_choice='sometimes'")))
    plan.append(("tools.reject.malformed", lambda: expect_400(
        "tools.reject.malformed", *c.chat(small, tools=[{"type": "function", "function": {"description": "x"}}]),
        "a tool without a function name")))

    @add("tool_choice.none")
    def _(name):
        status, body = c.chat(small, tools=[WEATHER_TOOL], tool_choice="none", messages=weather_q)
        if status != 200:
            return expect_200(name, status, body, "tool_choice none")
        calls = message_of(body).get("tool_calls")
        if calls:
            return KvvOutcome(name, "fail", f"tool_choice none, but the response has {len(calls)} tool call(s)")
        return KvvOutcome(name, "pass", "accepted, no tool calls")

    @add("tool_choice.required")
    def _(name):
        status, body = c.chat(big, tools=[WEATHER_TOOL, CALC_TOOL], tool_choice="required", messages=weather_q)
        if status != 200:
            return expect_200(name, status, body, "tool_choice required")
        return call_check(name, calls_of(message_of(body)), [WEATHER_TOOL, CALC_TOOL], None)

    @add("tool_choice.required.stream")
    def _(name):
        status, chunks, done = c.chat_stream(big, tools=[WEATHER_TOOL, CALC_TOOL], tool_choice="required",
                                             messages=weather_q)
        if status != 200:
            return expect_200(name, status, chunks, "streamed tool_choice required")
        if not done:
            return KvvOutcome(name, "fail", "the stream did not end with data: [DONE]")
        return call_check(name, reassemble(chunks)[1], [WEATHER_TOOL, CALC_TOOL], None)

    @add("tool_choice.named")
    def _(name):
        status, body = c.chat(big, tools=[WEATHER_TOOL, CALC_TOOL], messages=weather_q,
                              tool_choice={"type": "function", "function": {"name": "Calculator"}})
        if status != 200:
            return expect_200(name, status, body, "tool_choice naming Calculator")
        return call_check(name, calls_of(message_of(body)), [WEATHER_TOOL, CALC_TOOL], "Calculator")

    # -- k3_features: dynamic tools on system messages ------------------------------------------
    calc_q = {"role": "user", "content": "Use Calculator to compute 23 * 47."}
    bad_dynamic = {
        "content_null": [calc_q, {"role": "system", "tools": [CALC_TOOL], "content": None}],
        "content_and_tools": [calc_q, {"role": "system", "tools": [CALC_TOOL], "content": "tools"}],
        "non_system_role": [{**calc_q, "tools": [CALC_TOOL]}],
        "empty_tools": [calc_q, {"role": "system", "tools": []}],
        "malformed_tool": [calc_q, {"role": "system", "tools": [{"type": "function", "function": {}}]}],
    }
    for label, msgs in bad_dynamic.items():
        plan.append((f"dynamic_tools.reject.{label}", lambda m=msgs, n=f"dynamic_tools.reject.{label}", lb=label:
                     expect_400(n, *c.chat(small, messages=m), f"dynamic tool declaration ({lb})")))

    @add("dynamic_tools.declared_on_system_message")
    def _(name):
        msgs = [calc_q, {"role": "system", "tools": [CALC_TOOL]}]
        status, body = c.chat(big, messages=msgs, tool_choice="required")
        if status != 200:
            return expect_200(name, status, body, "a well-formed dynamic declaration with tool_choice required")
        return call_check(name, calls_of(message_of(body)), [CALC_TOOL], "Calculator")

    # -- tests/prompt_tokens ----------------------------------------------------------------------
    root = c.base_url[:-3] if c.base_url.endswith("/v1") else c.base_url
    cases = {
        "plain": {"messages": USER},
        "with_tools": {"messages": [calc_q, {"role": "system", "tools": [CALC_TOOL]}], "tools": [WEATHER_TOOL]},
    }
    for label, fields in cases.items():
        plan.append((f"prompt_tokens.matches_tokenize.{label}", lambda f=fields, n=f"prompt_tokens.matches_tokenize.{label}":
                     _tokens_vs_tokenize(n, c, root, f, small)))

    @add("prompt_tokens.consistent")
    def _(name):
        counts = []
        for _ in range(2):
            status, body = c.chat(1)
            if status != 200:
                return expect_200(name, status, body, "a plain request")
            counts.append((body.get("usage") or {}).get("prompt_tokens"))
        status, chunks, _ = c.chat_stream(1, stream_options={"include_usage": True})
        counts.append((reassemble(chunks)[3] or {}).get("prompt_tokens") if status == 200 else None)
        if None in counts or len(set(counts)) != 1:
            return KvvOutcome(name, "fail", f"prompt_tokens differ for the same prompt (plain, plain, streamed): {counts}")
        return KvvOutcome(name, "pass", f"prompt_tokens {counts[0]} for the same prompt, streamed and not")

    plan.append(("prompt_tokens.expected_constants", lambda: KvvOutcome(
        "prompt_tokens.expected_constants", "skip",
        "needs a real K3 endpoint: KVV's expected counts (testdata/prompt_token_cases) are K3-tokenizer counts")))

    # -- stream reassembly ------------------------------------------------------------------------
    @add("stream.reassembly")
    def _(name):
        fields = {"temperature": 0, "seed": 1234}
        status, body = c.chat(small, **fields)
        if status == 400:
            return _greedy_refused(name, body, "equal text needs greedy decoding")
        if status != 200:
            return expect_200(name, status, body, "temperature 0")
        status, chunks, done = c.chat_stream(small, stream_options={"include_usage": True}, **fields)
        if status != 200:
            return expect_200(name, status, chunks, "streamed temperature 0")
        text, _, finish, usage = reassemble(chunks)
        whole = message_of(body).get("content") or ""
        if not done:
            return KvvOutcome(name, "fail", "the stream did not end with data: [DONE]")
        if text != whole:
            at = next((i for i, (a, b) in enumerate(zip(text, whole)) if a != b), min(len(text), len(whole)))
            return KvvOutcome(name, "fail", f"streamed text differs from the whole answer at character {at}: "
                               f"{text[at:at + 20]!r} vs {whole[at:at + 20]!r}")
        want_finish = (body.get("choices") or [{}])[0].get("finish_reason")
        if finish != want_finish:
            return KvvOutcome(name, "fail", f"finish_reason streamed {finish!r}, whole {want_finish!r}")
        # A key sent as null says no more than a key left out (vLLM's whole answer carries
        # "prompt_tokens_details": null, its usage chunk omits it), so compare what is set.
        if set_fields(usage) != set_fields(body.get("usage")):
            return KvvOutcome(name, "fail", f"final usage chunk {usage} differs from the whole answer's {body.get('usage')}")
        return KvvOutcome(name, "pass", f"{len(chunks)} chunks reassemble to the same {len(text)} characters, "
                           "finish_reason and usage")

    @add("stream.usage_chunk")
    def _(name):
        status, chunks, done = c.chat_stream(small, stream_options={"include_usage": True})
        if status != 200:
            return expect_200(name, status, chunks, "stream_options include_usage")
        last = chunks[-1] if chunks else {}
        usage = last.get("usage") or {}
        if not done or last.get("choices") or not {"prompt_tokens", "completion_tokens", "total_tokens"} <= set(usage):
            return KvvOutcome(name, "fail", "the last chunk before [DONE] must carry usage and empty choices, "
                               f"got {json.dumps(last)[:160]}")
        if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
            return KvvOutcome(name, "fail", f"total_tokens != prompt + completion in {usage}")
        return KvvOutcome(name, "pass", f"final usage chunk {usage}")

    # -- batch invariance under concurrent load -------------------------------------------------
    @add("batch.concurrent_equals_alone")
    def _(name):
        return _concurrent_equals_alone(name, c, small)

    @add("server.alive_after_bad_requests")
    def _(name):
        return expect_200(name, *c.chat(small), "a good request after all the bad ones")

    return plan


def _greedy_refused(name: str, body: dict, why: str) -> KvvOutcome:
    """The skip of a check that needs temperature 0 from an endpoint that refused it."""
    return KvvOutcome(name, "skip", f"needs an endpoint that allows temperature 0 (this one refused it: "
                      f"{error_line(body)}); {why}")


CONCURRENT = 6          # requests sent at once by batch.concurrent_equals_alone


def _concurrent_equals_alone(name: str, c: Client, small: int) -> KvvOutcome:
    """Greedy answers to CONCURRENT different prompts, each asked alone and then all at once: a served
    stack whose batching changes a request's numerics (its kernels' tiles following the batch, a padded
    row leaking into another) answers differently under load. Needs temperature 0 (else a skip that
    says so); the requests are released together (a barrier) so a batching server sees them in one
    arrival window."""
    fields = {"temperature": 0, "seed": 1234}
    prompts = [[{"role": "user", "content": f"Continue the sequence {i}, {i + 3}, {i + 6},"}] for i in range(CONCURRENT)]
    alone = []
    for msgs in prompts:
        status, body = c.chat(small, messages=msgs, **fields)
        if status == 400:
            return _greedy_refused(name, body, "equal answers need greedy decoding")
        if status != 200:
            return expect_200(name, status, body, "temperature 0, alone")
        alone.append(message_of(body).get("content"))
    gate = threading.Barrier(CONCURRENT)

    def together(msgs):
        gate.wait(timeout=60)
        return c.chat(small, messages=msgs, **fields)
    try:
        with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
            answers = list(pool.map(together, prompts))
    except threading.BrokenBarrierError:
        return KvvOutcome(name, "fail", f"the {CONCURRENT} requests could not be released together (a thread "
                           "did not reach the barrier in 60 s)")
    for i, ((status, body), want) in enumerate(zip(answers, alone)):
        if status != 200:
            return expect_200(name, status, body, f"request {i} of {CONCURRENT} sent at once")
        got = message_of(body).get("content")
        if got != want:
            return KvvOutcome(name, "fail", f"request {i} of {CONCURRENT} sent at once answered {str(got)[:40]!r}, "
                               f"alone {str(want)[:40]!r} (greedy: the batch changed its numerics)")
    return KvvOutcome(name, "pass", f"{CONCURRENT} requests sent at once at temperature 0 each answered as alone")


def _tokens_vs_tokenize(name: str, c: Client, root: str, fields: dict, small: int) -> KvvOutcome:
    try:
        r = c.http.post(f"{root}/tokenize", json={"model": c.model, **fields})
    except httpx.HTTPError as e:
        return KvvOutcome(name, "skip", f"needs a /tokenize endpoint to compare with ({type(e).__name__})")
    if r.status_code in (404, 405):
        return KvvOutcome(name, "skip", "needs a /tokenize endpoint to compare with; this endpoint has none")
    count = read_json(r).get("count")
    status, body = c.chat(1, **fields)
    if status != 200:
        return expect_200(name, status, body, "the request")
    got = (body.get("usage") or {}).get("prompt_tokens")
    if got != count:
        return KvvOutcome(name, "fail", f"usage.prompt_tokens {got} != /tokenize count {count}")
    return KvvOutcome(name, "pass", f"usage.prompt_tokens {got} == /tokenize count")


def run_kvv(base_url: str, model_name: str, api_key: str | None = None, *, thinking: bool = False,
            think_mode: str = "none", max_tokens: int = 16, structured_max_tokens: int = 2048,
            only: list[str] | None = None, timeout_s: float = 300.0, on_response=None) -> dict:
    """Run the KVV contract checks against an OpenAI-compatible endpoint (base_url ends in /v1).

    only: name prefixes to run (e.g. ["params.reject", "stream"]); None runs everything.
    on_response: called with every httpx.Response (its headers: which stack served it).
    Returns {"endpoint", "model", "checks": [{name, status, reason}], "summary", "passed"}.
    """
    if think_mode not in ("none", "kimi", "opensource"):
        raise K3Error(f"think_mode must be 'none', 'kimi' or 'opensource', got {think_mode!r}")
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise K3Error(f"base_url must be an http(s) URL ending in /v1, got {base_url!r}")
    extra = {} if think_mode == "none" else (
        {"chat_template_kwargs": {"thinking": thinking}} if think_mode == "opensource"
        else {"thinking": {"type": "enabled" if thinking else "disabled"}})
    c = Client(base_url, model_name, api_key, timeout_s, extra, on_response)
    try:
        c.http.get("/models")
    except httpx.HTTPError as e:
        raise K3Error(f"cannot reach {base_url}: {type(e).__name__}: {e}") from None
    plan = _plan(c, thinking, max_tokens, structured_max_tokens)
    if only:
        unknown = [p for p in only if not any(n.startswith(p) for n, _ in plan)]
        if unknown:
            raise K3Error(f"no KVV check starts with {unknown}; names are like {plan[1][0]!r}")
        plan = [(n, fn) for n, fn in plan if any(n.startswith(p) for p in only)]
    results = []
    for name, thunk in plan:
        try:
            results.append(thunk())
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            results.append(KvvOutcome(name, "fail", f"request failed: {type(e).__name__}: {str(e)[:160]}"))
    c.http.close()
    summary = {s: sum(r.status == s for r in results) for s in STATUSES}
    return {"endpoint": base_url, "model": model_name, "checks": [asdict(r) for r in results],
            "summary": summary, "passed": summary["fail"] == 0}
