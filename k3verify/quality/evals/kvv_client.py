"""The KVV checks' HTTP side: a small client for one endpoint, and the helpers that read its
answers (errors, messages, streamed chunks reassembled, tool calls checked against schemas)."""
from __future__ import annotations

import json
from dataclasses import dataclass

import httpx

from k3verify.quality.evals.json_schema import schema_errors

STATUSES = ("pass", "fail", "skip")
USER = [{"role": "user", "content": "Say 'OK' and nothing else."}]


@dataclass(frozen=True)
class KvvOutcome:
    """One KVV check's outcome against the endpoint (quality/kvv_gate.py makes each a Result)."""

    name: str
    status: str
    reason: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


class Client:
    """Thin JSON/SSE client; every call returns (status, body or chunks), never raises for HTTP errors."""

    def __init__(self, base_url: str, model: str, api_key: str | None, timeout: float, extra: dict,
                 on_response=None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        hooks = {"response": [on_response]} if on_response is not None else None
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, event_hooks=hooks)
        self.model, self.extra = model, extra

    def chat(self, max_tokens: int, **fields) -> tuple[int, dict]:
        body = {"model": self.model, "messages": USER, "max_tokens": max_tokens, **self.extra, **fields}
        r = self.http.post("/chat/completions", json=body)
        return r.status_code, read_json(r)

    def chat_stream(self, max_tokens: int, **fields) -> tuple[int, list[dict] | dict, bool]:
        """-> (status, parsed chunks or the error body, whether [DONE] terminated the stream)."""
        body = {"model": self.model, "messages": USER, "max_tokens": max_tokens, "stream": True,
                **self.extra, **fields}
        chunks, done = [], False
        with self.http.stream("POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, read_json(r), False
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunks.append(json.loads(data))
        return 200, chunks, done

    def post(self, url: str, body: dict) -> tuple[int, dict]:
        r = self.http.post(url, json=body)
        return r.status_code, read_json(r)


def read_json(r: httpx.Response) -> dict:
    try:
        body = r.json()
    except ValueError:
        return {"raw": r.text[:200]}
    return body if isinstance(body, dict) else {"raw": body}


def error_line(body: dict) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    msg = err.get("message") if isinstance(err, dict) else None
    return (msg or json.dumps(body)[:160]).splitlines()[0][:200]


def expect_400(name: str, status: int, body: dict, what: str) -> KvvOutcome:
    if status == 400:
        return KvvOutcome(name, "pass", f"{what} rejected with 400: {error_line(body)}")
    if 200 <= status < 300:
        return KvvOutcome(name, "fail", f"{what} should be rejected with 400, but it was accepted")
    return KvvOutcome(name, "fail", f"{what} should be rejected with 400, got HTTP {status}: {error_line(body)}")


def expect_200(name: str, status: int, body: dict, what: str) -> KvvOutcome:
    if status == 200:
        return KvvOutcome(name, "pass", f"{what} accepted")
    return KvvOutcome(name, "fail", f"{what} should be accepted, got HTTP {status}: {error_line(body)}")


def json_reply(name: str, what: str, status: int, body: dict) -> tuple[object, KvvOutcome | None]:
    """(the JSON document a 200 reply's message content holds, None), or (None, the failing outcome)."""
    if status != 200:
        return None, expect_200(name, status, body, what)
    content = message_of(body).get("content") or ""
    try:
        return json.loads(content), None
    except ValueError:
        return None, KvvOutcome(name, "fail", f"content is not a JSON document: {content[:80]!r}")


def message_of(body: dict) -> dict:
    return ((body.get("choices") or [{}])[0]).get("message") or {}


def reassemble(chunks: list[dict]) -> tuple[str, list[dict], str | None, dict | None]:
    """Streamed chunks -> (content, tool calls with arguments concatenated, finish_reason, usage)."""
    content, calls, finish, usage = "", {}, None, None
    for ch in chunks:
        usage = ch.get("usage") or usage
        for c in ch.get("choices") or []:
            delta = c.get("delta") or {}
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                slot = calls.setdefault(tc.get("index", 0), {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            finish = c.get("finish_reason") or finish
    return content, [calls[i] for i in sorted(calls)], finish, usage


def set_fields(obj: dict | None) -> dict:
    return {k: v for k, v in (obj or {}).items() if v is not None}


def call_check(name: str, calls: list[dict], tools: list[dict], must_call: str | None) -> KvvOutcome:
    """At least one call, every call names a declared tool, arguments are JSON valid against its schema."""
    if not calls:
        return KvvOutcome(name, "fail", "expected a tool call, the response has none")
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    for call in calls:
        if call["name"] not in schemas:
            return KvvOutcome(name, "fail", f"call to undeclared function {call['name']!r}")
        if must_call and call["name"] != must_call:
            return KvvOutcome(name, "fail", f"tool_choice named {must_call!r}, the call is to {call['name']!r}")
        try:
            args = json.loads(call["arguments"])
        except (TypeError, ValueError):
            return KvvOutcome(name, "fail", f"arguments are not JSON: {str(call['arguments'])[:80]!r}")
        errors = schema_errors(args, schemas[call["name"]])
        if errors:
            return KvvOutcome(name, "fail", f"arguments break the schema: {errors[0]}")
    return KvvOutcome(name, "pass", f"{len(calls)} call(s) to {calls[0]['name']!r} with schema-valid arguments")


def calls_of(message: dict) -> list[dict]:
    return [{"id": c.get("id"), "name": (c.get("function") or {}).get("name"),
             "arguments": (c.get("function") or {}).get("arguments")} for c in message.get("tool_calls") or []]
