"""What every text backend speaks: sampling parameters in, token events out.

A backend turns prompt token ids into a stream of TokenEvents. The server and the
evals only see this interface, so the embedded engine, vLLM or a remote endpoint
can stand behind it. An optional `constraint` restricts which token ids may come
next (JSON output, forced tool calls); a backend that cannot mask logits must
refuse a constraint rather than ignore it.
"""

from __future__ import annotations

import json
import string as _string_mod
from dataclasses import dataclass, field
from typing import Generator, Iterator, Protocol, runtime_checkable

from optimized_stack.errors import K3Error

MAX_TOP_LOGPROBS = 20  # the OpenAI API's ceiling for top_logprobs


@dataclass(frozen=True)
class CompletionParams:
    """How to pick each next token of one completion request, as the OpenAI API spells it
    (max_tokens, top_p, logprobs). temperature 0 means greedy (argmax, ties to the lowest id).
    Not the engine's optimized_stack.engine.options.SamplingParams (max_new_tokens, stop_ids):
    the embedded backend maps one onto the other."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: no logprobs; n >= 0: the sampled token's plus the top n

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise K3Error(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not 0.0 <= float(self.temperature) <= 2.0:
            raise K3Error(f"temperature must be a number in [0, 2], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) \
                or not 0.0 < float(self.top_p) <= 1.0:
            raise K3Error(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise K3Error(f"seed must be an integer or None, got {self.seed!r}")
        ids = tuple(self.stop_token_ids)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise K3Error(f"stop_token_ids must be non-negative integers, got {list(ids)!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise K3Error(f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id, its log-probability under the model's raw (fp32, untempered,
    unmasked) next-token distribution, and the top alternatives as (token_id, logprob) pairs."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = field(default=())


class TokenConstraint(Protocol):
    """Restricts the next token. allowed() -> None: anything; [] : output complete; else the ids."""

    def allowed(self) -> list[int] | None: ...

    def advance(self, token_id: int) -> None: ...


@runtime_checkable
class TextBackend(Protocol):
    """Anything that can continue a prompt of token ids.

    Cancellation is close(): the server closes the returned iterator between tokens when its
    client goes away or it shuts down, and the backend must then stop producing and free the
    request's resources (a generator's finally does both)."""

    def generate(self, prompt_ids: list[int], params: CompletionParams,
                 constraint: TokenConstraint | None = None) -> Iterator[TokenEvent]: ...


def check_prompt_ids(prompt_ids: list[int], vocab_size: int) -> None:
    """What every backend refuses before it generates: an empty prompt, an id outside the vocabulary."""
    if not prompt_ids:
        raise K3Error("the prompt must have at least one token, got an empty prompt")
    bad = [i for i in prompt_ids if not 0 <= int(i) < vocab_size]
    if bad:
        raise K3Error(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")


# ---------------------------------------------------------------------------
# Constrained output: a program that names the allowed next units.
#
# A program is a Python generator: it yields a tuple of allowed units (one ASCII
# character, or the text of a special token) and is sent back the unit the
# backend picked. The model still chooses among the allowed units by its own
# logits, so the output is the model's, only kept inside the grammar. Sizes are
# bounded (strings <= 12 characters, depth <= 2, <= 3 members) so every program
# finishes in a few hundred tokens.
# ---------------------------------------------------------------------------

Program = Generator[tuple, str, object]

STRING_CHARS = _string_mod.ascii_letters + _string_mod.digits + " _-."  # no quote or backslash: no escapes
DIGITS = "0123456789"
MAX_STRING = 12
MAX_DEPTH = 2
MAX_MEMBERS = 3


class ProgramConstraint:
    """Adapts a unit program to TokenConstraint; `unit_ids` maps each unit to its token id."""

    def __init__(self, program: Program, unit_ids: dict[str, int]):
        self._program = program
        self._ids = unit_ids
        self._units = {v: k for k, v in unit_ids.items()}
        self.emitted: list[str] = []
        self._allowed: tuple | None = None
        self._step(None)

    def _step(self, unit: str | None) -> None:
        try:
            allowed = next(self._program) if unit is None else self._program.send(unit)
        except StopIteration:
            self._allowed = ()
            return
        if not allowed:
            raise RuntimeError("a constraint program yielded no allowed unit before finishing")
        missing = [u for u in allowed if u not in self._ids]
        if missing:
            raise K3Error(f"constrained output needs units the tokenizer cannot emit: {missing[:5]!r}")
        self._allowed = tuple(allowed)

    def allowed(self) -> list[int] | None:
        return [self._ids[u] for u in self._allowed]

    def advance(self, token_id: int) -> None:
        unit = self._units.get(token_id)
        if unit is None or unit not in self._allowed:
            raise RuntimeError(f"token {token_id} is outside the constraint's allowed set")
        self.emitted.append(unit)
        self._step(unit)

    @property
    def done(self) -> bool:
        return self._allowed == ()


def literal(text) -> Program:
    """Force a fixed sequence of units (a str is split into characters)."""
    for unit in text:
        yield (unit,)


def choice(options: list[str], follow: str = "") -> Program:
    """Pick one of several literal strings, unit by unit; returns the follow char it consumed, if any."""
    prefix = ""
    while True:
        nexts = sorted({o[len(prefix)] for o in options if o.startswith(prefix) and len(o) > len(prefix)})
        complete = prefix in options
        if complete and not nexts:
            return None
        unit = yield tuple(nexts + ([c for c in follow if c not in nexts] if complete else []))
        if complete and unit not in nexts:
            return unit
        prefix += unit


def _string_body(min_len: int = 0, max_len: int = MAX_STRING) -> Program:
    """After the opening quote: characters, then the closing quote."""
    n = 0
    while True:
        allowed = (STRING_CHARS if n < max_len else "") + ('"' if n >= min_len else "")
        unit = yield tuple(allowed)
        if unit == '"':
            return None
        n += 1


def _number_after(first: str, integer: bool, follow: str) -> Program:
    """A JSON number whose first character was already chosen; returns the follow char consumed."""
    unit = first
    if unit == "-":
        unit = yield tuple(DIGITS)
    if unit != "0":
        for _ in range(5):
            unit = yield tuple(DIGITS + follow)
            if unit in follow:
                return unit
    if not integer:
        unit = yield tuple("." + follow)
        if unit in follow:
            return unit
        yield tuple(DIGITS)
        for _ in range(2):
            unit = yield tuple(DIGITS + follow)
            if unit in follow:
                return unit
    return (yield tuple(follow))


def _close(consumed, sep_options: str) -> Program:
    """After a value: the separator the value already consumed, or let the model pick one now."""
    if consumed is not None:
        return consumed
    return (yield tuple(sep_options))


def json_value(schema: dict | None, follow: str, depth: int = 0) -> Program:
    """Any JSON value allowed by a (subset of) JSON Schema; returns the follow char it consumed."""
    schema = schema if isinstance(schema, dict) else {}
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return (yield from json_value(schema[key][0], follow, depth))
    if "const" in schema:
        return (yield from choice([json.dumps(schema["const"])], follow))
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return (yield from choice([json.dumps(v) for v in schema["enum"]], follow))
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else None
    if kind == "object":
        yield ("{",)
        return (yield from _object_body(schema, depth))
    if kind == "array":
        yield ("[",)
        return (yield from _array_body(schema, depth))
    if kind == "string":
        lo = int(schema.get("minLength", 0))
        hi = max(min(int(schema.get("maxLength", MAX_STRING)), MAX_STRING), lo)
        yield ('"',)
        return (yield from _string_body(lo, hi))
    if kind in ("integer", "number"):
        first = yield tuple("-" + DIGITS)
        return (yield from _number_after(first, kind == "integer", follow))
    if kind == "boolean":
        return (yield from choice(["true", "false"], follow))
    if kind == "null":
        return (yield from choice(["null"], follow))
    # No type: any value, containers only while shallow.
    first = yield tuple(('{["' if depth < MAX_DEPTH else '"') + "-" + DIGITS + "tfn")
    if first == "{":
        return (yield from _object_body(None, depth))
    if first == "[":
        return (yield from _array_body(None, depth))
    if first == '"':
        return (yield from _string_body())
    if first in "tfn":
        yield from literal({"t": "rue", "f": "alse", "n": "ull"}[first])
        return None
    return (yield from _number_after(first, False, follow))


def _object_body(schema: dict | None, depth: int) -> Program:
    """After '{': the declared properties in order (all of them), or up to MAX_MEMBERS free members."""
    props = dict(schema.get("properties") or {}) if schema else {}
    for name in (schema or {}).get("required", []) or []:
        props.setdefault(name, {})
    if props:
        names = list(props)
        for i, name in enumerate(names):
            yield from literal(json.dumps(name) + ":")
            sep = "}" if i == len(names) - 1 else ","
            consumed = yield from json_value(props[name], sep, depth + 1)
            yield from _close(consumed, sep)
        return None
    unit = yield ('"', "}")
    members = 0
    while unit != "}":
        members += 1
        yield from _string_body(1, MAX_STRING)
        yield (":",)
        seps = ",}" if members < MAX_MEMBERS else "}"
        consumed = yield from json_value(None, seps, depth + 1)
        unit = yield from _close(consumed, seps)
        if unit == ",":
            yield ('"',)
    return None


def _array_body(schema: dict | None, depth: int) -> Program:
    """After '[': at least one item (minItems honoured), at most max(minItems, 3)."""
    schema = schema or {}
    lo = int(schema.get("minItems", 0))
    hi = min(max(lo, MAX_MEMBERS), int(schema.get("maxItems", 10**9)))
    if hi == 0:
        yield ("]",)
        return None
    count = 0
    while True:
        count += 1
        seps = ("," if count < hi else "") + ("]" if count >= max(lo, 1) else "")
        consumed = yield from json_value(schema.get("items"), seps, depth + 1)
        unit = yield from _close(consumed, seps)
        if unit == "]":
            return None


def json_object_program(schema: dict | None = None) -> Program:
    """A whole JSON document whose root is an object; schema None means any object."""
    if schema is None:
        yield ("{",)
        yield from _object_body(None, 0)
    else:
        yield from json_value(schema, "", 0)


class BanConstraint:
    """Every token except the banned ones (tool_choice 'none' bans the tool-call section)."""

    def __init__(self, vocab_size: int, banned: set[int]):
        self._ids = [i for i in range(vocab_size) if i not in banned]

    def allowed(self) -> list[int]:
        return self._ids

    def advance(self, token_id: int) -> None:
        pass


def tool_call_program(tools: list[dict], name: str, call_index: int):
    """Exactly one call in the chat template's syntax: the function (the named one, or the model's
    pick among all) and arguments that follow its parameters schema."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    names = list(by_name) if name == "*" else [name]
    yield from literal(["<|tool_calls_section_begin|>", "<|tool_call_begin|>"])
    yield from literal("functions.")
    picked = ""
    for unit in (yield from _tracked(choice([n + ":" for n in names]))):
        picked += unit
    yield from literal(str(call_index))
    yield ("<|tool_call_argument_begin|>",)
    yield from json_object_program(by_name[picked[:-1]].get("parameters"))
    yield from literal(["<|tool_call_end|>", "<|tool_calls_section_end|>"])


def _tracked(program):
    """Run a sub-program and return the units it was sent."""
    sent = []
    allowed = next(program)
    while True:
        unit = yield allowed
        sent.append(unit)
        try:
            allowed = program.send(unit)
        except StopIteration:
            return sent
