"""Fuzzing the server's request validation (issue 29): no request may get a 5xx.

A fault campaign found 500s for lone surrogates, seeds >= 2**63, `"role": []` and malformed JSON
Schemas, and 200s for invalid schemas and bad message fields. Here several hundred requests are
mutated deterministically (seeded) from valid ones and sent to a server on loopback; each must be
answered below 500, and each mutation of a known-bad kind (surrogate, bad role, seed out of range,
invalid schema, nesting past the limit, not JSON) must get exactly 400 with a one-line OpenAI error.

The backend is the real embedded decode loop (seeding, sampling, constraints) over a stub model whose
logits favour <|eos|>, so a request that passes validation finishes in a few tokens and a fault
behind validation (a seed the RNG refuses, a schema the constraint program chokes on) still shows.
Negative controls: with one validator switched off, the same fuzz must report findings.
"""

from __future__ import annotations

import copy
import json
import random
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
import torch  # noqa: E402

from k3verify.serving import validation  # noqa: E402
from k3verify.serving.app import create_app  # noqa: E402
from k3verify.serving.backends.embedded import EmbeddedBackend  # noqa: E402
from k3verify.serving.lifecycle import ServerThread  # noqa: E402
from optimized_stack.tokenizer import ByteTokenizer  # noqa: E402

TOK = ByteTokenizer()
FUZZ_SEED = 29
FUZZ_N = 360
HI = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
CAT_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer"}},
              "required": ["name"]}

# (path, body): valid requests, each answered 200 (test_every_base_request_is_valid proves it).
BASES = [
    ("/chat/completions", {"model": "fake", "messages": [{"role": "system", "content": "be brief"}, *HI],
                           "max_tokens": 4, "temperature": 0, "seed": 7, "stop": ["\n"]}),
    ("/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                                               "function": {"name": "get_weather",
                                                                            "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}],
        "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 4, "temperature": 0.6, "seed": 1}),
    ("/chat/completions", {"messages": HI, "max_tokens": 64, "seed": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "cat", "schema": CAT_SCHEMA}}}),
    ("/chat/completions", {"messages": [*HI, {"role": "system", "tools": [WEATHER]}], "tool_choice": "required",
                           "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}),
    ("/completions", {"prompt": "Once", "max_tokens": 4, "stop": "x", "logprobs": 2, "seed": 3, "temperature": 1.0}),
    ("/completions", {"prompt": [65, 66], "max_tokens": 3, "stream": True, "seed": 4}),
    ("/tokenize", {"prompt": "abc"}),
    ("/tokenize", {"messages": HI}),
]
NASTY = [None, True, False, 0, -1, 1.5, -0.0, 1e308, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400, "", "x" * 2000,
         "\ud800", "\udfff", "é\u0000", [], [None], [[]], {}, {"": None}, {"type": "text"}, "<|im_end|>"]
BAD_ROLES = [[], {}, 1, None, True, "admin", "User", "", "\ud800", ["user"]]
BAD_SEEDS = [2**63, 2**64, 10**30, -1, -(2**63), 1.5, "7", True, [], {}]
BAD_SCHEMAS = [
    {"type": "object", "properties": [1, 2]},
    {"type": "object", "properties": {"a": {"type": "strin"}}},
    {"type": "object", "required": "a"},
    {"type": "object", "properties": {"a": {"minLength": -1}}},
    {"type": "object", "properties": {"a": {"pattern": "["}}},
    {"type": "object", "additionalProperties": 5},
    {"type": "object", "properties": {"a": {"enum": "x"}}},
    {"type": "object", "properties": {"a": {"items": [1]}}},
    {"type": "object", "properties": {"a": {"type": ["string", "string"]}}},
    {"type": "object", "properties": {"a": {"maxItems": "3"}}},
]


class EosModel:
    """A stand-in for k3-mini with the incremental API: every position's logits favour <|eos|>."""

    config = SimpleNamespace(vocab_size=TOK.vocab_size)

    def new_state(self):
        return None

    def forward(self, ids, state):
        logits = torch.zeros(len(ids), TOK.vocab_size)  # [T, V]
        logits[:, TOK.eos_id] = 20.0
        return logits


@pytest.fixture(scope="module")
def client():
    with ServerThread(create_app(EmbeddedBackend(EosModel(), TOK), TOK, "fake")) as server:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as c:
            yield c


# ---- the mutations ----------------------------------------------------------------------------------

def _slots(value, at=()):
    """Every (container, key, path) inside value, depth first; path is for reports."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield value, k, (*at, k)
            yield from _slots(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield value, i, (*at, i)
            yield from _slots(v, (*at, i))


def _deep(levels: int):
    value = 1
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 4 else 5)
    if kind == 0:
        return rng.choice(NASTY)
    if kind == 1:
        return rng.randint(-(2**70), 2**70)
    if kind == 2:
        return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0xA0, 0x3000), 0xD800]))
                       for _ in range(rng.randrange(6)))
    if kind == 3:
        return rng.random() * 10 ** rng.randrange(-5, 300)
    if kind == 4:
        return rng.choice(["user", "text", "function", "object", "json_schema", "auto", "none"])
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["role", "content", "type", "name", "x", "\ud800k"]): _random_json(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def _set(body: dict, rng: random.Random, key: str, values: list) -> bool:
    """Set `key` somewhere it matters: in a message (role), at the top (seed). False if not applicable."""
    if key == "role":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return False
        rng.choice(messages)["role"] = rng.choice(values)
        return True
    body[key] = rng.choice(values)
    return True


def mutate(rng: random.Random) -> tuple[str, str, bytes, bool]:
    """-> (what, path, raw body, must_be_400): one request derived from a base by one mutation."""
    path, base = rng.choice(BASES)
    body = copy.deepcopy(base)
    kind = rng.choice(["drop", "retype", "retype", "extra", "surrogate", "role", "seed", "schema", "nest",
                       "badjson", "random", "benign"])
    slots = list(_slots(body))
    must = False
    if kind == "drop" and slots:
        container, key, at = rng.choice(slots)
        del container[key]
        what = f"drop {at}"
    elif kind == "retype" and slots:
        container, key, at = rng.choice(slots)
        container[key] = rng.choice(NASTY) if rng.random() < 0.7 else _random_json(rng)
        what = f"retype {at} = {container[key]!r:.40}"
    elif kind == "extra":
        dicts = [body] + [v for c, k, _ in slots if isinstance(v := c[k], dict)]
        rng.choice(dicts)[rng.choice(["seed", "role", "tools", "name", "type", "zzz", "logprobs"])] = _random_json(rng)
        what = "extra key"
    elif kind == "surrogate":
        strings = [(c, k, at) for c, k, at in slots if isinstance(c[k], str)]
        container, key, at = rng.choice(strings) if strings else (body, "user", ("user",))
        text = container.get(key, "") if isinstance(container, dict) else container[key]
        cut = rng.randrange(len(text) + 1)
        container[key] = text[:cut] + rng.choice(["\ud800", "\udfff", "\udc80"]) + text[cut:]
        what, must = f"surrogate in {at}", True
    elif kind == "role" and _set(body, rng, "role", BAD_ROLES):
        what, must = "bad role", True
    elif kind == "seed" and path != "/tokenize" and _set(body, rng, "seed", BAD_SEEDS):
        what, must = f"seed = {body['seed']!r:.30}", True
    elif kind == "schema" and path == "/chat/completions":
        bad = copy.deepcopy(rng.choice(BAD_SCHEMAS))
        if rng.random() < 0.5:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}}
            body.pop("tool_choice", None)
        else:
            body["tools"] = [{"type": "function", "function": {"name": "bad_tool", "parameters": bad}}]
        what, must = f"bad schema {json.dumps(bad)}", True
    elif kind == "benign" and path != "/tokenize":  # valid values at their edges: must pass and generate
        body["seed"] = rng.choice([0, 2**63 - 1, rng.randrange(2**63)])
        body["temperature"] = rng.choice([0, 0.6, 1.0])
        body["max_tokens"] = rng.choice([1, rng.randrange(1, 64)])
        body["stream"] = rng.random() < 0.5
        body.pop("stream_options", None)
        what = f"benign seed={body['seed']} temperature={body['temperature']} stream={body['stream']}"
    elif kind == "nest":
        container, key, at = rng.choice(slots) if slots else (body, "metadata", ("metadata",))
        container[key] = _deep(rng.randrange(65, 400))
        what, must = f"nest 65+ levels at {at}", True
    elif kind == "badjson":
        raw = json.dumps(body).encode()
        raw = rng.choice([raw[: rng.randrange(len(raw))], b"\xff\xfe" + raw, raw.replace(b":", b"=", 1),
                          b"NaN", b"[1, 2]", b'"text"', b"", b"{'a': 1}", json.dumps({"seed": 1.0}).encode()[:-1],
                          raw[:-1] + b', "x": Infinity}'])
        return "invalid JSON", path, raw, True
    else:
        body = _random_json(rng, 1) if rng.random() < 0.3 else {
            rng.choice(["messages", "prompt", "seed", "tools", "response_format", "stop"]): _random_json(rng)}
        what = "random JSON"
    return what, path, json.dumps(body).encode(), must


def check_answer(r: httpx.Response, must_be_400: bool) -> str | None:
    """None if the answer is acceptable, else what is wrong with it (one line)."""
    if r.status_code >= 500:
        return f"HTTP {r.status_code}: {r.text[:120]!r}"
    if must_be_400 and r.status_code != 400:
        return f"a known-bad request got HTTP {r.status_code}, expected 400: {r.text[:120]!r}"
    if r.status_code == 400:
        try:
            error = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"HTTP 400 without an OpenAI error body: {r.text[:120]!r}"
        if not isinstance(error.get("message"), str) or "\n" in error["message"] \
                or error.get("type") != "invalid_request_error":
            return f"HTTP 400 with a malformed error: {error!r:.160}"
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream") \
            and "generation ended early" in r.text:  # a stream that failed behind validation: a 500 in disguise
        return f"stream ended in an error event: {r.text[-160:]!r}"
    return None


def run_fuzz(client: httpx.Client, seed: int, n: int) -> tuple[list[str], dict[int, int]]:
    """-> (findings, count per status). Deterministic in seed: the same n requests every run."""
    rng = random.Random(seed)
    findings, statuses = [], {}
    for i in range(n):
        what, path, raw, must = mutate(rng)
        url, headers = path if path == "/tokenize" else f"/v1{path}", {"content-type": "application/json"}
        try:
            try:
                r = client.post(url, content=raw, headers=headers)
            except httpx.TransportError:  # a 500 closes its keep-alive connection: the next request's
                r = client.post(url, content=raw, headers=headers)  # reset is not its own; retry it once
        except httpx.TransportError as e:  # twice: the server dropped this request itself
            findings.append(f"#{i} {path} {what}: no answer ({type(e).__name__})")
            continue
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        problem = check_answer(r, must)
        if problem:
            findings.append(f"#{i} {path} {what}: {problem}")
    return findings, statuses


def _report(findings: list[str], n: int) -> str:
    return f"{len(findings)} / {n} fuzzed requests answered wrongly; first: " + " | ".join(findings[:3])


# ---- the tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("index", range(len(BASES)), ids=[f"{p.strip('/')}-{i}" for i, (p, _) in enumerate(BASES)])
def test_every_base_request_is_valid(client, index):
    # The fuzz starts from these; a base that were refused would make every mutation trivially 400.
    path, body = BASES[index]
    r = client.post(path if path == "/tokenize" else f"/v1{path}", json=body)
    assert r.status_code == 200 and "generation ended early" not in r.text, r.text[:300]


def test_fuzzed_requests_get_no_5xx_and_known_bad_ones_get_400(client):
    findings, statuses = run_fuzz(client, FUZZ_SEED, FUZZ_N)
    assert sum(statuses.values()) + sum("no answer" in f for f in findings) == FUZZ_N
    assert not findings, _report(findings, FUZZ_N)
    # The fuzz must reach past validation too, or it only tests the parser.
    assert statuses.get(200, 0) >= FUZZ_N // 10 and statuses.get(400, 0) >= FUZZ_N // 3, statuses


# The fault-campaign cases, each by name: exactly 400, the message naming the field.
NAMED = {
    "content-surrogate": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]},
                          r"^messages\[0\]\.content: the string is not valid UTF-8 \(lone surrogate U\+D800"),
    "prompt-surrogate": ("/v1/completions", {"prompt": "\ud800"}, r"^prompt: the string is not valid UTF-8"),
    "stop-surrogate": ("/v1/completions", {"prompt": "a", "stop": ["ok", "\ud800"]},
                       r"^stop\[1\]: the string is not valid UTF-8"),
    "tool-description-surrogate": ("/v1/chat/completions", {"messages": HI, "tools": [
        {"type": "function", "function": {"name": "get_weather", "description": "\ud800"}}]},
        r"^tools\[0\]\.function\.description: the string is not valid UTF-8"),
    "tokenize-surrogate": ("/tokenize", {"prompt": "\ud800"}, r"^prompt: the string is not valid UTF-8"),
    "key-surrogate": ("/v1/completions", {"prompt": "a", "\ud800": 1}, r"^\\ud800: the key is not valid UTF-8"),
    "seed-2**63": ("/v1/completions", {"prompt": "a", "seed": 2**63},
                   r"^seed: expected an integer in \[0, 2\*\*63\); got 9223372036854775808$"),
    "seed-2**64-sampled": ("/v1/completions", {"prompt": "a", "seed": 2**64, "temperature": 1.0},
                           r"^seed: expected an integer in \[0, 2\*\*63\)"),
    "seed-negative": ("/v1/completions", {"prompt": "a", "seed": -1},
                      r"^seed: expected an integer in \[0, 2\*\*63\); got -1"),
    "seed-bool": ("/v1/completions", {"prompt": "a", "seed": True},
                  r"^seed: expected an integer in \[0, 2\*\*63\); got boolean"),
    "role-list": ("/v1/chat/completions", {"messages": [{"role": [], "content": "x"}]},
                  r"^messages\[0\]\.role: expected one of system, user, assistant, tool; got array$"),
    "role-unknown": ("/v1/chat/completions", {"messages": [{"role": "admin", "content": "x"}]},
                     r"^messages\[0\]\.role: expected one of system, user, assistant, tool; got 'admin'$"),
    "role-missing": ("/v1/chat/completions", {"messages": [{"content": "x"}]},
                     r"^messages\[0\]\.role: expected one of .*; got nothing \(no role key\)$"),
    "schema-properties-list": ("/v1/chat/completions", {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": [1, 2]}}}},
        r"^response_format\.json_schema\.schema\.properties: not a valid JSON Schema \(draft 2020-12\): "
        r"\[1, 2\] is not of type 'object'"),
    "schema-bad-type": ("/v1/chat/completions", {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"type": "strin"}}}}}},
        r"^response_format\.json_schema\.schema\.properties\.a\.type: not a valid JSON Schema"),
    "tool-parameters-bad-schema": ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"minLength": -1}}}}}]},
        r"^tools\[0\]\.function\.parameters\.properties\.city\.minLength: not a valid JSON Schema"),
    "message-name-number": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": 5}]},
                            r"^messages\[0\]\.name: expected a non-empty string; got number$"),
    "message-tool-call-id-list": ("/v1/chat/completions", {"messages": [
        {"role": "tool", "content": "x", "tool_call_id": []}]}, r"^messages\[0\]\.tool_call_id: expected a non-empty"),
    "message-content-number": ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
                               r"^messages\[0\]\.content: expected a string or a list of text parts; got number$"),
    "message-content-image": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, r"^messages\[0\]\.content\[0\]\.type: expected 'text'"),
    "message-tool-calls-dict": ("/v1/chat/completions", {"messages": [
        {"role": "assistant", "content": None, "tool_calls": {"id": "x"}}]},
        r"^messages\[0\]\.tool_calls: expected an array of tool calls; got object$"),
    "message-tool-calls-on-user": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x",
                                                                          "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
        r"^messages\[0\]\.tool_calls: only assistant messages carry tool_calls"),
    "message-unknown-field": ("/v1/chat/completions", {"messages": [{"role": "user", "contnet": "x"}]},
                              r"^messages\[0\]: unknown message field 'contnet'; did you mean 'content'\?$"),
    "temperature-huge-int": ("/v1/completions", {"prompt": "a", "temperature": 10**400},
                             r"^temperature must be a number of reasonable size"),
    "model-list": ("/v1/completions", {"prompt": "a", "model": []}, r"^model: expected a string; got array$"),
    "tool-unknown-key": ("/v1/chat/completions", {"messages": HI, "tools": [
        {"type": "function", "function": {"name": "get_weather", "strict": True, "paramters": {}}}]},
        r"^tools\[0\]\.function: unknown key 'paramters'; accepted: description, name, parameters, strict$"),
    "echo-zero": ("/v1/completions", {"prompt": "a", "echo": 0}, r"^echo is not supported by this server"),
    "best-of-true": ("/v1/completions", {"prompt": "a", "best_of": True}, r"^best_of must be 1"),
}


@pytest.mark.parametrize("name", list(NAMED))
def test_named_fault_case_gets_400_naming_the_field(client, name):
    path, body, match = NAMED[name]
    r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, f"{name}: HTTP {r.status_code}: {r.text[:300]}"
    message = r.json()["error"]["message"]
    assert "\n" not in message and re.search(match, message), f"{name}: {message!r} does not match {match!r}"


def test_the_deepest_schema_the_body_limit_admits_is_served(client):
    # 30 nested objects is 62 JSON levels in the body: past validation, into the constraint program
    schema = {"type": "string"}
    for _ in range(30):
        schema = {"type": "object", "properties": {"a": schema}}
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    r = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 400, "response_format": fmt})
    assert r.status_code == 200, r.text[:300]
    assert json.loads(r.json()["choices"][0]["message"]["content"])["a"]["a"]["a"], "the answer must follow the schema"


def test_not_json_nan_and_huge_numbers_get_400(client):
    for raw in (b'{"prompt": "a", "temperature": NaN}', b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", b"\xff"):
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "is not JSON" in r.json()["error"]["message"], r.text[:200]


# ---- negative controls: with one validator off, the fuzz must find something ----------------------------

OFF = {"check_utf8": lambda body: None, "check_seed": lambda seed: seed,
       "check_json_schema": lambda schema, at: None, "check_message_fields": lambda msg, at: None}


@pytest.mark.parametrize("validator", list(OFF))
def test_fuzz_finds_faults_when_a_validator_is_off(client, monkeypatch, validator):
    monkeypatch.setattr(validation, validator, OFF[validator])
    findings, _ = run_fuzz(client, FUZZ_SEED, FUZZ_N)
    assert findings, f"with {validator} off the fuzz found nothing: it cannot see what that validator guards"
