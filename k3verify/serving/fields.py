"""Field-level request rules under validation.py's contract checks (issue 29): every string encodes
as UTF-8, every message field has its type, every JSON Schema is a schema.

Why apart from validation.py: these are generic shape rules, not K3's contract. A fault campaign
found each one missing as an HTTP 500 (a lone surrogate reached the tokenizer, `"role": []` reached a
dict lookup, `"properties": [1, 2]` reached the constrained-output program); each is now a 400 whose
message starts with the field's path, e.g. "messages[0].role: expected one of system, user,
assistant, tool; got list".
"""

from __future__ import annotations

import difflib




class RequestError(Exception):
    """A request the server refuses -> HTTP `status` (400 unless said) with this one-line message,
    an OpenAI-style error body, and `headers` (Retry-After on 429/503)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code
        self.headers = headers or {}


def _fail(message: str, param: str | None = None):
    raise RequestError(message, param)

ROLES = ("system", "user", "assistant", "tool")
SEED_BOUND = 1 << 63  # seeds are in [0, 2**63): a signed 64-bit range every backend's RNG takes
# Keys an OpenAI client may send back in a message it got from us (the SDK's model_dump() of an
# assistant message): accepted only at their empty value, since nothing here acts on them.
NEUTRAL_MESSAGE_KEYS = ("refusal", "audio", "function_call", "annotations")
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "tools", "reasoning_content",
                          *NEUTRAL_MESSAGE_KEYS})
MAX_SCHEMA_ERROR_CHARS = 200  # jsonschema quotes the offending value; a long one is cut here


def type_name(value) -> str:
    """JSON's name for a decoded value's type, for 'expected X; got Y' messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _key(key: str) -> str:
    """A key as it may appear in a message: surrogates escaped, so the error body itself encodes."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def check_utf8(body: dict) -> None:
    """Every string in the body, keys included, must encode as UTF-8. JSON's "\\ud800" escape decodes
    to a lone surrogate, which no tokenizer (and no UTF-8 response) can carry. Iterative: the body's
    depth is bounded by parse_json_object, the walk needs no recursion anyway."""
    stack = [(body, "")]
    while stack:
        value, at = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                _fail(f"{at or 'the body'}: the string is not valid UTF-8 (lone surrogate "
                      f"U+{ord(value[e.start]):04X} at character {e.start})", at or None)
        elif isinstance(value, dict):
            for k, v in value.items():
                path = f"{at}.{_key(k)}" if at else _key(k)
                if _key(k) != k:
                    _fail(f"{path}: the key is not valid UTF-8 (it holds a lone surrogate)", path)
                stack.append((v, path))
        elif isinstance(value, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(value))


def check_seed(seed) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        _fail(f"seed: expected an integer in [0, 2**63); got {type_name(seed)}", "seed")
    if not 0 <= seed < SEED_BOUND:
        shown = seed if seed.bit_length() <= 128 else f"an integer of {seed.bit_length()} bits"
        _fail(f"seed: expected an integer in [0, 2**63); got {shown}", "seed")
    return seed


def check_json_schema(schema, at: str) -> None:
    """A real JSON Schema (draft 2020-12 meta-schema, formats such as regex patterns included).
    jsonschema is imported here, not at module level: the CLI imports the server's modules, and
    a machine that only runs checks (the GPU image) need not have it."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
        detail = " ".join(e.message.split())
        if len(detail) > MAX_SCHEMA_ERROR_CHARS:
            detail = detail[:MAX_SCHEMA_ERROR_CHARS] + "..."
        _fail(f"{at}{where}: not a valid JSON Schema (draft 2020-12): {detail}", at)
    except RecursionError:  # nesting is bounded by --max-json-depth; this is a guard, not a path
        _fail(f"{at}: the JSON Schema nests too deeply to check", at)


def _string(msg: dict, key: str, at: str, non_empty: bool = True) -> None:
    value = msg[key]
    if not isinstance(value, str) or (non_empty and not value):
        got = "an empty string" if isinstance(value, str) else type_name(value)
        _fail(f"{at}.{key}: expected a {'non-empty ' if non_empty else ''}string; got {got}", f"{at}.{key}")


def check_content(content, role: str, at: str) -> None:
    """A string, or a list of {'type': 'text', 'text': str} parts; null only for an assistant turn."""
    where = f"{at}.content"
    if content is None:
        if role != "assistant":
            _fail(f"{where}: expected a string or a list of text parts for role {role}; got null", where)
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        _fail(f"{where}: expected a string or a list of text parts; got {type_name(content)}", where)
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        if not isinstance(part, dict):
            _fail(f"{here}: expected an object {{'type': 'text', 'text': str}}; got {type_name(part)}", here)
        kind = part.get("type")
        if kind != "text":
            got = repr(kind) if isinstance(kind, str) else type_name(kind)
            _fail(f"{here}.type: expected 'text' (the byte tokenizer has no image or audio input); got {got}",
                  f"{here}.type")
        if not isinstance(part.get("text"), str):
            _fail(f"{here}.text: expected a string; got {type_name(part.get('text'))}", f"{here}.text")
        extra = sorted(k for k in part if k not in ("type", "text"))
        if extra:
            _fail(f"{here}: unknown key {extra[0]!r} in a text part; accepted: type, text", here)


def check_tool_calls(calls, role: str, at: str) -> None:
    """OpenAI's shape: [{'id': str, 'type': 'function', 'function': {'name': str, 'arguments': str}}]."""
    where = f"{at}.tool_calls"
    if role != "assistant":
        _fail(f"{where}: only assistant messages carry tool_calls; this one has role {role}", where)
    if not isinstance(calls, list):
        _fail(f"{where}: expected an array of tool calls; got {type_name(calls)}", where)
    for j, call in enumerate(calls):
        here = f"{where}[{j}]"
        if not isinstance(call, dict):
            _fail(f"{here}: expected an object; got {type_name(call)}", here)
        extra = sorted(k for k in call if k not in ("id", "type", "function", "index"))
        if extra:
            _fail(f"{here}: unknown key {extra[0]!r}; accepted: id, type, function", here)
        if "id" in call and not isinstance(call["id"], str):
            _fail(f"{here}.id: expected a string; got {type_name(call['id'])}", f"{here}.id")
        kind = call.get("type", "function")
        if kind != "function":
            got = repr(kind) if isinstance(kind, str) else type_name(kind)
            _fail(f"{here}.type: expected 'function'; got {got}", f"{here}.type")
        fn = call.get("function")
        if not isinstance(fn, dict):
            _fail(f"{here}.function: expected an object with name and arguments; got {type_name(fn)}",
                  f"{here}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            _fail(f"{here}.function.name: expected a non-empty string; got {type_name(name)}", f"{here}.function.name")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, (str, dict)):  # OpenAI sends JSON text; an object is rendered compactly
            _fail(f"{here}.function.arguments: expected a string of JSON; got {type_name(arguments)}",
                  f"{here}.function.arguments")


def check_message_fields(msg: dict, at: str) -> None:
    """One message's fields, each by type (a dynamic tool declaration's tools are check_tools' job)."""
    unknown = sorted(k for k in msg if k not in MESSAGE_KEYS)
    if unknown:
        near = difflib.get_close_matches(unknown[0], MESSAGE_KEYS, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else f"; accepted: {', '.join(sorted(MESSAGE_KEYS))}"
        _fail(f"{at}: unknown message field {unknown[0]!r}{hint}", f"{at}.{unknown[0]}")
    role = msg.get("role")
    if not (isinstance(role, str) and role in ROLES):  # a list or dict role is unhashable: test the type first
        got = repr(role) if isinstance(role, str) else type_name(role) if "role" in msg else "nothing (no role key)"
        _fail(f"{at}.role: expected one of {', '.join(ROLES)}; got {got}", f"{at}.role")
    for key in NEUTRAL_MESSAGE_KEYS:
        if msg.get(key) not in (None, []):
            _fail(f"{at}.{key}: this server does not act on {key}; send null or omit it", f"{at}.{key}")
    if "tools" in msg:
        return  # a dynamic declaration: check_messages holds its rules (system role, no content key)
    check_content(msg.get("content"), role, at)
    if "name" in msg and msg["name"] is not None:
        _string(msg, "name", at)
    if "reasoning_content" in msg and msg["reasoning_content"] is not None:
        _string(msg, "reasoning_content", at, non_empty=False)
    if msg.get("tool_call_id") is not None:
        if role != "tool":
            _fail(f"{at}.tool_call_id: only tool messages carry a tool_call_id; this one has role {role}",
                  f"{at}.tool_call_id")
        _string(msg, "tool_call_id", at)
    if msg.get("tool_calls") is not None:
        check_tool_calls(msg["tool_calls"], role, at)
