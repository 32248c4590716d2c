"""Bounded JSON and TOML reading: every file this project reads goes through here.

Python's parsers fail on hostile input with a traceback, not a message: nesting ~1,000
deep is a RecursionError (json's C scanner and tomllib both recurse), an integer over
4,300 digits is a ValueError from the int-string limit, and bytes that are not UTF-8
are a UnicodeDecodeError. Here each is refused before the parser sees it, in one line
that names the file and what was wrong:

    config.json: nested deeper than 64 levels at $.a.b.c[0]...
    plan.json: an integer of 5,000 digits at $.units[3].seed (more than 300)
    golden.json: not UTF-8 text; byte 0xff at offset 12 is not UTF-8

The bounds are far above anything this project writes (its deepest file nests 8 levels;
its largest integers are 64-bit seeds, 20 digits) and far below where the parsers break.
Syntax errors are not this module's business: json.JSONDecodeError and
tomllib.TOMLDecodeError pass through, so each caller keeps its own message for them.

The error class is the caller's (`error=`): optimized_stack's readers raise ConfigError /
CheckpointError, k3verify's a UsageError. The default LoadError is a K3Error (exit 2).
This module imports nothing from k3verify (optimized_stack never does); k3verify.io
re-exports it.
"""
from __future__ import annotations

import json
import os
import re
import tomllib
from itertools import accumulate
from pathlib import Path
from typing import Any

from .errors import K3Error

MAX_DEPTH = 64            # levels of [] / {} (a top-level object is level 1)
MAX_INT_DIGITS = 300      # decimal digits of one integer; Python's own limit is 4,300


class LoadError(K3Error):
    """A file outside the reader's bounds (too deep, a huge integer, not UTF-8)."""


def decode_utf8(data: bytes, source: str, error: type[Exception] = LoadError) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{source}: not UTF-8 text; byte 0x{data[exc.start]:02x} at offset {exc.start} "
                    f"is not UTF-8") from None


def read_json(path: str | os.PathLike, source: str | None = None, error: type[Exception] = LoadError) -> Any:
    """The JSON document in a file, bounded. OSError (missing, unreadable) passes through."""
    p = Path(path)
    return loads_json(p.read_bytes(), str(p) if source is None else source, error)


def loads_json(data: bytes | str, source: str, error: type[Exception] = LoadError) -> Any:
    text = decode_utf8(bytes(data), source, error) if isinstance(data, (bytes, bytearray)) else data
    problem = _json_problem(text)
    if problem:
        raise error(f"{source}: {problem}")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except (RecursionError, ValueError) as exc:          # not reached when the scan above is right
        raise error(f"{source}: not readable JSON ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None


def read_toml(path: str | os.PathLike, source: str | None = None, error: type[Exception] = LoadError) -> dict:
    p = Path(path)
    return loads_toml(decode_utf8(p.read_bytes(), str(p) if source is None else source, error),
                      str(p) if source is None else source, error)


def loads_toml(text: str, source: str, error: type[Exception] = LoadError) -> dict[str, Any]:
    """tomllib.loads, bounded. Dotted keys (a.b.c = 1) nest without brackets and hex integers
    have no digit limit, so the parsed value is walked as well as the text scanned."""
    problem = _toml_problem(text)
    if problem:
        raise error(f"{source}: {problem}")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        raise
    except (RecursionError, ValueError) as exc:
        raise error(f"{source}: not readable TOML ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
    problem = _value_problem(data)
    if problem:
        raise error(f"{source}: {problem}")
    return data


# ---- JSON: a scan of the text, before parsing ------------------------------------------------
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
# an integer (no fraction, no exponent) of too many digits; in the text with strings blanked
_BIG_INT = re.compile(r"(?<![\d.eE+\-])-?\d{%d,}(?![\d.eE])" % (MAX_INT_DIGITS + 1))
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:,]|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?', re.S)


def _json_problem(text: str) -> str | None:
    """None when the text is within bounds; else what is wrong and where (a $-path)."""
    skeleton = _JSON_STRING.sub('""', text)                    # brackets and digits in strings do not count
    brackets = _NOT_BRACKET.sub("", skeleton)
    depth = max(accumulate(1 if c in "[{" else -1 for c in brackets), default=0)
    if depth <= MAX_DEPTH and not _BIG_INT.search(skeleton):
        return None
    return _json_locate(text)


def _json_locate(text: str) -> str:
    """The slow walk, only for a file already known to be out of bounds: the path of the problem."""
    stack: list[list] = []               # per open container: ["[", index] or ["{", key]
    last_string = None
    for m in _JSON_TOKEN.finditer(text):
        tok = m.group()
        c = tok[0]
        if c == '"':
            last_string = tok
        elif c in "[{":
            stack.append([c, 0 if c == "[" else None])
            if len(stack) > MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels at {_path(stack[:-1])}"
        elif c in "]}":
            if stack:
                stack.pop()
        elif c == ":":
            if stack and stack[-1][0] == "{" and last_string is not None:
                stack[-1][1] = _key(last_string)
        elif c == ",":
            if stack and stack[-1][0] == "[":
                stack[-1][1] += 1
        else:                                                    # a number
            digits = len(tok.lstrip("-"))
            if digits > MAX_INT_DIGITS and tok.lstrip("-").isdigit():
                return f"an integer of {digits:,} digits at {_path(stack)} (more than {MAX_INT_DIGITS})"
    # The fast scan saw a problem the walk did not (an unterminated string shifts the two):
    return f"nested deeper than {MAX_DEPTH} levels or an integer over {MAX_INT_DIGITS} digits"


def _key(string_token: str) -> str:
    try:
        return json.loads(string_token)
    except ValueError:
        return string_token.strip('"')


def _path(stack: list) -> str:
    parts = []
    for kind, at in stack:
        if kind == "[":
            parts.append(f"[{at}]")
        elif at is None:
            parts.append(".?")
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", at):
            parts.append(f".{at[:40]}")
        else:
            parts.append(f"[{json.dumps(at[:40])}]")
    shown = parts if len(parts) <= 10 else parts[:8] + ["..."]
    return "$" + "".join(shown)


# ---- TOML: a scan of the text (brackets, digit runs), then a walk of the value -------------
_TOML_TOKEN = re.compile(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|"(?:[^"\\\n]|\\.)*"|\'[^\'\n]*\'|#[^\n]*'
                         r"|[\[\]{}]|[0-9][0-9_]*")


def _toml_problem(text: str) -> str | None:
    depth = 0
    for m in _TOML_TOKEN.finditer(text):
        tok = m.group()
        c = tok[0]
        if c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels at line {text.count(chr(10), 0, m.start()) + 1}"
        elif c in "]}":
            depth -= 1
        elif c.isdigit():
            digits = len(tok.replace("_", ""))
            if digits > MAX_INT_DIGITS:
                return (f"a number of {digits:,} digits at line {text.count(chr(10), 0, m.start()) + 1} "
                        f"(more than {MAX_INT_DIGITS})")
    return None


_MAX_INT_BITS = int(MAX_INT_DIGITS * 3.3219280948873626)      # log2(10) bits per digit


def _value_problem(value: Any) -> str | None:
    """Walk a parsed value (no recursion): depth and integer size, with the $-path of a problem."""
    todo: list[tuple[Any, tuple]] = [(value, ())]
    while todo:
        v, path = todo.pop()
        if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > _MAX_INT_BITS:
            return f"an integer of about {int(v.bit_length() * 0.30103):,} digits at {_value_path(path)} (more than {MAX_INT_DIGITS})"
        if isinstance(v, (dict, list)):
            if len(path) >= MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels at {_value_path(path)}"
            items = v.items() if isinstance(v, dict) else enumerate(v)
            todo.extend((child, path + (k,)) for k, child in items)
    return None


def _value_path(path: tuple) -> str:
    return _path([["[", k] if isinstance(k, int) else ["{", k] for k in path])
