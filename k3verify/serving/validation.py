"""The request rules of K3's API contract, as the Kimi Vendor Verifier checks them.

Each check_* takes the raw JSON body (or one field of it) and either returns the
parsed value or raises RequestError, which the server (serving/app.py) turns into
HTTP 400 with a one-line reason. Kept apart from app.py because these rules
are the contract itself: they can be read, changed and reviewed without the
FastAPI app, the generation loop or SSE streaming around them.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass

from k3verify.serving.backends.base import CompletionParams
# RequestError and _fail live in fields.py (the layer below) and are re-exported from here.
from k3verify.serving.fields import (RequestError, _fail, check_json_schema, check_message_fields,  # noqa: F401
                                     check_seed, check_utf8, type_name)
from optimized_stack.errors import K3Error

# K3's immutable sampling values (KVV tests/params: temperature 1.0 thinking / 0.6 non-thinking,
# top_p 0.95, penalties 0, n 1). Two k3verify extensions, both documented: temperature 0 (greedy,
# needed for bitwise verification) and top_p 1.0 (no truncation, what OpenAI clients send by default).
ALLOWED_TEMPERATURES = (0.0, 0.6, 1.0)
ALLOWED_TOP_P = (0.95, 1.0)
MAX_NEW_TOKENS = 4096
MAX_TOOLS = 128
MAX_STOP = 5           # K3: at most 5 stop sequences ...
MAX_STOP_BYTES = 32    # ... each at most 32 bytes
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})  # OpenAI's function object
TOOL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_-]{2,63}$")  # K3's tool-name rule
DEFAULT_MAX_TOKENS = 256


# ---------------------------------------------------------------------------
# What the server accepts at all: sizes, depth, parameter names
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ServeLimits:
    """The server's limits; each has a `k3verify serve` flag of the same name."""

    max_body_bytes: int = 1 << 20       # request body, bytes (413 past it)
    max_json_depth: int = 64            # nesting of arrays/objects in the body (400 past it)
    # A prompt's prefill is one forward and cannot be cancelled midway: on 2 busy cores k3-mini's
    # reference path prefills ~60 tokens/s (4096 tokens: 70 s), so this limit also bounds how long
    # a cancelled request can still hold the worker. 8192 fits GSM8K 5-shot (~3.5K) with room.
    max_prompt_tokens: int = 8192       # prompt after the chat template, tokens (400 past it)
    max_model_len: int = 12288          # prompt + max_tokens, tokens (400 past it); 8192 + 4096 new
    max_queue: int = 32                 # requests waiting behind the one generating (429 past it)
    stall_s: float = 300.0              # busy without a token this long = wedged (/health 503); > longest prefill
    probe_timeout_s: float = 10.0       # /health on an idle server: a 1-token generation must finish this fast
    drain_s: float = 10.0               # on SIGTERM: wait this long for in-flight work, then cancel it

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "max_prompt_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise K3Error(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise K3Error(f"max_queue must be an integer >= 0, got {self.max_queue!r}")
        for name in ("stall_s", "probe_timeout_s", "drain_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise K3Error(f"{name} must be a number of seconds > 0, got {value!r}")
        if self.max_prompt_tokens >= self.max_model_len:
            raise K3Error(f"max_prompt_tokens ({self.max_prompt_tokens}) must be below max_model_len "
                          f"({self.max_model_len}): a prompt needs room for at least one new token")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_json_object(raw: bytes, max_depth: int) -> dict:
    """The body as a JSON object; 400 for non-JSON (NaN and Infinity included: Python's json takes them,
    JSON does not), a non-object, nesting past max_depth, or a string that is not valid UTF-8."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:  # the C scanner recurses per level: 100k nested arrays end here, not in a 500
        _fail(f"the request body nests arrays/objects deeper than Python can parse; at most {max_depth} "
              "levels are accepted")
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity, ints past 4300 digits
        reason = " ".join(str(e).split())[:200]
        _fail(f"the request body must be a JSON object, got something that is not JSON ({reason})")
    if not isinstance(body, dict):
        _fail(f"the request body must be a JSON object, got {type(body).__name__}")
    # Iterative, so the check itself cannot recurse too deep; later code (schemas, programs) may recurse.
    level, depth = [body], 1
    while level:
        if depth > max_depth:
            _fail(f"the request body nests arrays/objects more than {max_depth} levels deep")
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, (dict, list))]
        depth += 1
    check_utf8(body)
    return body


# Top-level fields each endpoint takes: what K3 implements, what the OpenAI API and its clients
# (KVV: thinking / chat_template_kwargs; lm-eval local-completions: prompt, max_tokens, temperature,
# stop, seed) legitimately send. Fields we cannot honour are accepted only at their neutral value
# (check_neutral); anything else is a typo or a feature this server lacks, refused by name.
CHAT_PARAMS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "stop", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "seed",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "logit_bias", "user", "metadata", "store",
    "thinking", "chat_template_kwargs"})
COMPLETION_PARAMS = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "presence_penalty", "frequency_penalty", "logprobs", "echo", "seed", "best_of", "logit_bias", "suffix", "user"})


def check_known_params(body: dict, allowed: frozenset, endpoint: str) -> None:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        name = unknown[0]
        near = difflib.get_close_matches(name, allowed, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else f"; accepted: {', '.join(sorted(allowed))}"
        _fail(f"unknown parameter {name!r} for {endpoint}{hint}", name)
    check_neutral(body)


def check_neutral(body: dict) -> None:
    """Accepted fields this server does not act on: only values that ask for nothing pass."""
    if body.get("logit_bias") not in (None, {}):
        _fail("logit_bias is not supported by this server; send null or {}", "logit_bias")
    if body.get("best_of") is not None and (type(body["best_of"]) is not int or body["best_of"] != 1):
        _fail(f"best_of must be 1 (one sample per request), got {body['best_of']!r}", "best_of")
    if body.get("suffix") not in (None, ""):
        _fail("suffix (insertion) is not supported by this server", "suffix")
    for key in ("parallel_tool_calls", "store"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            _fail(f"{key} must be a boolean, got {body[key]!r}", key)
    for key in ("metadata", "chat_template_kwargs"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            _fail(f"{key} must be an object, got {body[key]!r}", key)
    if body.get("user") is not None and not isinstance(body["user"], str):
        _fail(f"user must be a string, got {body['user']!r}", "user")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled")):
        _fail(f"thinking must be {{'type': 'enabled' | 'disabled'}}, got {thinking!r}", "thinking")


def check_context(prompt_tokens: int, max_tokens: int, limits: ServeLimits, prompt_param: str) -> None:
    if prompt_tokens > limits.max_prompt_tokens:
        _fail(f"the prompt is {prompt_tokens} tokens; this server accepts at most {limits.max_prompt_tokens} "
              "(--max-prompt-tokens)", prompt_param)
    if prompt_tokens + max_tokens > limits.max_model_len:
        _fail(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {prompt_tokens + max_tokens} "
              f"exceeds this server's context of {limits.max_model_len} tokens (--max-model-len)", "max_tokens")


# ---------------------------------------------------------------------------
# Request checks
# ---------------------------------------------------------------------------

def _number(body: dict, key: str, default: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(f"{key} must be a number, got {type_name(value)}", key)
    if isinstance(value, int) and abs(value) > 1 << 64:  # float() of a huge int overflows; no valid value is near
        _fail(f"{key} must be a number of reasonable size, got an integer of {value.bit_length()} bits", key)
    return float(value)


def check_sampling(body: dict, enforce: bool, logprobs: int | None, stop_ids: tuple[int, ...]) -> CompletionParams:
    """Sampling fields -> CompletionParams; K3's fixed values are enforced unless enforce is False."""
    temperature = _number(body, "temperature", 0.0)
    top_p = _number(body, "top_p", 1.0)
    n = body.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int):
        _fail(f"n must be an integer, got {n!r}", "n")
    penalties = {k: _number(body, k, 0.0) for k in ("presence_penalty", "frequency_penalty")}
    if enforce:
        if temperature not in ALLOWED_TEMPERATURES:
            _fail(f"temperature must be one of {list(ALLOWED_TEMPERATURES)} (0.6 non-thinking, 1.0 thinking, "
                  f"0 greedy for verification), got {temperature:g}", "temperature")
        if top_p not in ALLOWED_TOP_P:
            _fail(f"top_p must be one of {list(ALLOWED_TOP_P)}, got {top_p:g}", "top_p")
        for key, value in penalties.items():
            if value != 0:
                _fail(f"{key} must be 0 (fixed for K3), got {value:g}", key)
        if n != 1:
            _fail(f"n must be 1, got {n}", "n")
    else:  # negative control: accept anything the sampler can run
        temperature = min(max(temperature, 0.0), 2.0)
        top_p = min(max(top_p, 1e-6), 1.0)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_NEW_TOKENS:
        _fail(f"max_tokens must be an integer in [1, {MAX_NEW_TOKENS}], got {max_tokens!r}", "max_tokens")
    seed = check_seed(body.get("seed"))
    return CompletionParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                          stop_token_ids=stop_ids, logprobs=logprobs)


def check_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        _fail(f"stop must be a non-empty string or a list of them, got {stop!r}", "stop")
    if len(stops) > MAX_STOP or any(len(s.encode()) > MAX_STOP_BYTES for s in stops):
        _fail(f"stop allows at most {MAX_STOP} entries of at most {MAX_STOP_BYTES} bytes, got {stops!r}", "stop")
    return stops


def check_stream(body: dict) -> tuple[bool, bool]:
    """-> (stream, include_usage)."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        _fail(f"stream must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        _fail("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        _fail(f"stream_options must be {{'include_usage': bool}}, got {options!r}", "stream_options")
    return stream, options.get("include_usage", False)


def check_tools(tools, where: str) -> list[dict]:
    """OpenAI function tools, each name unique and K3-legal, parameters a JSON Schema object."""
    if not isinstance(tools, list) or not tools:
        _fail(f"{where} must be a non-empty list of tools, got {tools!r}", where)
    if len(tools) > MAX_TOOLS:
        _fail(f"{where} allows at most {MAX_TOOLS} tools, got {len(tools)}", where)
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            _fail(f"{at} must be {{'type': 'function', 'function': {{...}}}}, got {tool!r}", at)
        extra = sorted(set(tool) - {"type", "function"}) or sorted(set(tool["function"]) - FUNCTION_KEYS)
        if extra:
            where = at if extra[0] in tool else f"{at}.function"
            _fail(f"{where}: unknown key {extra[0]!r}; accepted: "
                  f"{'type, function' if where == at else ', '.join(sorted(FUNCTION_KEYS))}", f"{where}.{extra[0]}")
        fn = tool["function"]
        if "strict" in fn and not isinstance(fn["strict"], bool):
            _fail(f"{at}.function.strict: expected a boolean; got {type_name(fn['strict'])}", f"{at}.function.strict")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
            _fail(f"{at}.function.name must match {TOOL_NAME_RE.pattern}, got {name!r}", at)
        if "description" in fn and not isinstance(fn["description"], str):
            _fail(f"{at}.function.description must be a string, got {type_name(fn['description'])}",
                  f"{at}.function.description")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict) or params.get("type", "object") != "object":
                _fail(f"{at}.function.parameters must be a JSON Schema with type 'object', got {params!r}", at)
            if not isinstance(params.get("properties", {}), dict):
                _fail(f"{at}.function.parameters.properties must be an object", at)
            required = params.get("required", [])
            if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                _fail(f"{at}.function.parameters.required must be a list of strings, got {required!r}", at)
            check_json_schema(params, f"{at}.function.parameters")
    return tools


def check_messages(messages) -> tuple[list[dict], list[dict]]:
    """-> (messages as the chat template takes them, dynamically declared tools).

    A dynamic declaration (K3's messages[].tools extension) is a system message with a
    non-empty tools list and no content key at all; it renders as a tool_declare turn in place.
    """
    if not isinstance(messages, list) or not messages:
        _fail(f"messages must be a non-empty list, got {messages!r}", "messages")
    rendered, dynamic = [], []
    for i, msg in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(msg, dict):
            _fail(f"{at}: expected a message object; got {type_name(msg)}", at)
        check_message_fields(msg, at)
        if "tools" in msg:
            if msg.get("role") != "system":
                _fail(f"{at}: tools may only be declared on a system message, got role {msg.get('role')!r}", at)
            if "content" in msg:
                _fail(f"{at}: a dynamic tool declaration must omit the content key, got content={msg['content']!r}", at)
            dynamic += check_tools(msg["tools"], f"{at}.tools")
            rendered.append({"role": "system", "name": "tool_declare",
                             "content": json.dumps(msg["tools"], ensure_ascii=False, separators=(",", ":"))})
        else:
            rendered.append(msg)
    return rendered, dynamic


def check_tool_choice(choice_, tools: list[dict]) -> str | None:
    """-> None (no forcing), 'none', or the name of the function that must be called ('*' = any)."""
    if choice_ is None or choice_ == "auto":
        return None
    if choice_ == "none":
        return "none"
    names = [t["function"]["name"] for t in tools]
    if choice_ == "required":
        if not names:
            _fail("tool_choice 'required' needs at least one declared tool, got none", "tool_choice")
        return "*"
    if isinstance(choice_, dict):
        fn = choice_.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice_.get("type") != "function" or not isinstance(name, str):
            _fail(f"tool_choice must be {{'type': 'function', 'function': {{'name': ...}}}}, got {choice_!r}", "tool_choice")
        if name not in names:
            _fail(f"tool_choice names function {name!r}, which is not declared (declared: {names})", "tool_choice")
        return name
    _fail(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice_!r}", "tool_choice")


def check_response_format(fmt) -> tuple[str, dict | None]:
    """-> (kind, schema) with kind in text / json_object / json_schema."""
    if fmt is None:
        return "text", None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        _fail(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {fmt!r}", "response_format")
    kind = fmt["type"]
    if kind != "json_schema":
        return kind, None
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        _fail("response_format json_schema needs a json_schema object with name and schema", "response_format")
    extra = sorted(set(spec) - {"name", "description", "schema", "strict"})
    if extra:
        _fail(f"response_format.json_schema: unknown key {extra[0]!r}; accepted: description, name, schema, strict",
              f"response_format.json_schema.{extra[0]}")
    if not isinstance(spec.get("strict", False), bool) or not isinstance(spec.get("description", ""), str):
        _fail("response_format.json_schema: strict must be a boolean and description a string", "response_format")
    if not isinstance(spec.get("name"), str) or not re.match(r"^[a-zA-Z0-9_-]{1,64}$", spec["name"]):
        _fail(f"response_format.json_schema.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {spec.get('name')!r}",
              "response_format")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        _fail(f"response_format.json_schema.schema must be a JSON Schema object, got {schema!r}", "response_format")
    if schema.get("type", "object") != "object":
        _fail(f"response_format.json_schema.schema must have type 'object' at the root, got {schema.get('type')!r}",
              "response_format")
    check_json_schema(schema, "response_format.json_schema.schema")
    return kind, schema
