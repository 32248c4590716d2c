"""Byte-level tokenizer with Kimi-style chat and tool-call markers.

Ids 0..255 are raw UTF-8 bytes, ids 256..271 are the 16 special tokens below.
Every string round-trips exactly, no download is ever needed, and the vocab
(272) matches the shipped k3-mini model. Special-token strings inside user text
are encoded as plain bytes unless the caller opts in, so a prompt cannot forge
a turn boundary or a tool call.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

from optimized_stack.errors import K3Error

NUM_BYTES = 256
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|reserved_0|>",
    "<|reserved_1|>",
    "<|reserved_2|>",
)
VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)  # 272
SPECIAL_IDS: dict[str, int] = {s: NUM_BYTES + i for i, s in enumerate(SPECIAL_TOKENS)}

CONFIG_FILE = "tokenizer_config.json"
CONFIG_TYPE = "byte"
CONFIG_VERSION = 1
CHAT_TEMPLATE = "kimi-byte-v1"

# Which turn marker opens each role; "tool" results travel as a system turn named "tool".
ROLE_MARKERS = {
    "system": "<|im_system|>",
    "user": "<|im_user|>",
    "assistant": "<|im_assistant|>",
    "tool": "<|im_system|>",
}
# Longest first, so no special is matched as a prefix of a longer one.
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in sorted(SPECIAL_TOKENS, key=len, reverse=True)))
_CALL_HEADER_RE = re.compile(r"^functions\.(?P<name>.+):(?P<idx>\d+)$")


class ByteTokenizer:
    """UTF-8 bytes plus 16 specials; stateless, so one instance can be shared."""

    vocab_size = VOCAB_SIZE
    specials = SPECIAL_TOKENS
    chat_template = CHAT_TEMPLATE

    pad_id = SPECIAL_IDS["<|pad|>"]
    bos_id = SPECIAL_IDS["<|bos|>"]
    eos_id = SPECIAL_IDS["<|eos|>"]
    im_end_id = SPECIAL_IDS["<|im_end|>"]

    # ---- ids <-> text -------------------------------------------------

    def token_id(self, special: str) -> int:
        if special not in SPECIAL_IDS:
            raise K3Error(f"unknown special token {special!r}; expected one of {', '.join(SPECIAL_TOKENS)}")
        return SPECIAL_IDS[special]

    def is_special(self, token_id: int) -> bool:
        return NUM_BYTES <= token_id < VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = False, allow_special: bool = False) -> list[int]:
        """Text -> ids. Special strings are parsed as specials only with allow_special=True."""
        if not isinstance(text, str):
            raise K3Error(f"encode expects str, got {type(text).__name__}")
        ids = [self.bos_id] if add_bos else []
        if not allow_special:
            ids.extend(text.encode("utf-8"))
            return ids
        pos = 0
        for m in _SPECIAL_RE.finditer(text):
            ids.extend(text[pos : m.start()].encode("utf-8"))
            ids.append(SPECIAL_IDS[m.group(0)])
            pos = m.end()
        ids.extend(text[pos:].encode("utf-8"))
        return ids

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """Ids -> exact bytes; specials render as their UTF-8 name unless skipped."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < NUM_BYTES:
                out.append(i)
            elif NUM_BYTES <= i < VOCAB_SIZE:
                if not skip_special:
                    out += SPECIAL_TOKENS[i - NUM_BYTES].encode("ascii")
            else:
                raise K3Error(f"token id must be in [0, {VOCAB_SIZE}), got {i}")
        return bytes(out)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Ids -> text; invalid UTF-8 becomes U+FFFD (use decode_bytes for exact bytes)."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special)

    # ---- chat ---------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Kimi-style chat rendering; message text never becomes special tokens."""
        ids: list[int] = []
        if tools:
            ids += self._turn("<|im_system|>", "tool_declare", _compact_json(list(tools)))
        call_idx = 0  # Kimi numbers tool calls across the whole conversation
        for n, msg in enumerate(messages):
            if not isinstance(msg, dict):
                raise K3Error(f"messages[{n}] must be a dict, got {type(msg).__name__}")
            role = msg.get("role")
            if role not in ROLE_MARKERS:
                raise K3Error(f"messages[{n}].role must be one of {', '.join(ROLE_MARKERS)}, got {role!r}")
            content = _content_text(msg.get("content"), n)
            if role == "tool":
                name = "tool"
                if msg.get("tool_call_id"):
                    content = f"## Return of {msg['tool_call_id']}\n{content}"
            else:
                name = msg.get("name") or role
            tail: list[int] = []
            calls = msg.get("tool_calls") or []
            if calls and role != "assistant":
                raise K3Error(f"messages[{n}] has tool_calls but role {role!r}; only assistant messages carry them")
            if calls:
                tail.append(SPECIAL_IDS["<|tool_calls_section_begin|>"])
                for c in calls:
                    call_id, fn_name, arguments = _call_parts(c, call_idx, n)
                    call_idx += 1
                    tail.append(SPECIAL_IDS["<|tool_call_begin|>"])
                    tail += self.encode(call_id)
                    tail.append(SPECIAL_IDS["<|tool_call_argument_begin|>"])
                    tail += self.encode(arguments)
                    tail.append(SPECIAL_IDS["<|tool_call_end|>"])
                tail.append(SPECIAL_IDS["<|tool_calls_section_end|>"])
            ids += self._turn(ROLE_MARKERS[role], name, content, tail)
        if add_generation_prompt:
            ids.append(SPECIAL_IDS["<|im_assistant|>"])
            ids += self.encode("assistant")
            ids.append(SPECIAL_IDS["<|im_middle|>"])
        return ids

    def _turn(self, marker: str, name: str, content: str, tail: Sequence[int] = ()) -> list[int]:
        ids = [SPECIAL_IDS[marker]] + self.encode(name) + [SPECIAL_IDS["<|im_middle|>"]]
        ids += self.encode(content)
        ids += list(tail)
        ids.append(SPECIAL_IDS["<|im_end|>"])
        return ids

    def parse_tool_calls(self, output: str | Sequence[int], strict: bool = True) -> tuple[str, list[dict]]:
        """Model output (ids, or text with special strings) -> (content, [{id, name, arguments}]).

        Content is the text before the tool section, up to <|im_end|>/<|eos|>.
        strict=False drops a truncated trailing call instead of raising.
        """
        ids = self.encode(output, allow_special=True) if isinstance(output, str) else [int(i) for i in output]
        stops = {self.im_end_id, self.eos_id}
        begin = SPECIAL_IDS["<|tool_calls_section_begin|>"]
        content_ids: list[int] = []
        pos = 0
        while pos < len(ids) and ids[pos] not in stops and ids[pos] != begin:
            content_ids.append(ids[pos])
            pos += 1
        content = self.decode(content_ids, skip_special=True)
        calls: list[dict] = []
        if pos < len(ids) and ids[pos] == begin:
            calls = self._parse_section(ids, pos + 1, strict)
        return content, calls

    def _parse_section(self, ids: list[int], pos: int, strict: bool) -> list[dict]:
        call_begin = SPECIAL_IDS["<|tool_call_begin|>"]
        arg_begin = SPECIAL_IDS["<|tool_call_argument_begin|>"]
        call_end = SPECIAL_IDS["<|tool_call_end|>"]
        section_end = SPECIAL_IDS["<|tool_calls_section_end|>"]
        calls: list[dict] = []
        while pos < len(ids) and ids[pos] != section_end:
            if ids[pos] != call_begin:
                pos += 1  # whitespace or stray tokens between calls carry no meaning
                continue
            try:
                a = ids.index(arg_begin, pos + 1)
                e = ids.index(call_end, a + 1)
            except ValueError:
                if strict:
                    raise K3Error(
                        f"tool call starting at token {pos} is not terminated "
                        "(expected <|tool_call_argument_begin|> ... <|tool_call_end|>)"
                    ) from None
                break
            header = self.decode(ids[pos + 1 : a], skip_special=True).strip()
            m = _CALL_HEADER_RE.match(header)
            name = m.group("name") if m else header
            calls.append({"id": header, "name": name, "arguments": self.decode(ids[a + 1 : e], skip_special=True)})
            pos = e + 1
        else:
            if pos >= len(ids) and strict:
                raise K3Error("tool call section is not terminated (expected <|tool_calls_section_end|>)")
        return calls

    # ---- files --------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> Path:
        """Write tokenizer_config.json into directory (atomically) and return its path."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        path = d / CONFIG_FILE
        cfg = {"type": CONFIG_TYPE, "version": CONFIG_VERSION, "specials": list(SPECIAL_TOKENS), "chat_template": CHAT_TEMPLATE}
        # optimized_stack never imports k3verify, so the temp-file + replace is spelled out here.
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{CONFIG_FILE}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(cfg, f, indent=2)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


class IncrementalDecoder:
    """Streams text from ids one piece at a time, holding back incomplete UTF-8 sequences.

    The concatenation of every feed() result and flush() equals tokenizer.decode(all ids).
    """

    def __init__(self, tokenizer: ByteTokenizer | None = None, skip_special: bool = False):
        self.tokenizer = tokenizer or ByteTokenizer()
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: int | Iterable[int]) -> str:
        if isinstance(ids, int) or getattr(ids, "ndim", None) == 0:  # a bare id or a 0-d tensor
            ids = [int(ids)]
        return self._utf8.decode(self.tokenizer.decode_bytes(ids, self.skip_special))

    def flush(self) -> str:
        """End of stream: a dangling partial sequence becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)


def load_tokenizer(path_or_preset: str | os.PathLike | None = None) -> ByteTokenizer:
    """None or a byte-vocab preset name -> the byte tokenizer; a dir or tokenizer_config.json -> checked, loaded."""
    if path_or_preset is None:
        return ByteTokenizer()
    p = Path(path_or_preset)
    if not p.exists():
        vocab = _preset_vocab(str(path_or_preset))
        if vocab == VOCAB_SIZE:
            return ByteTokenizer()
        if vocab is not None:
            raise K3Error(f"tokenizer for preset {str(path_or_preset)!r}: the byte tokenizer has vocab {VOCAB_SIZE}, the preset has {vocab}")
    if p.is_dir():
        p = p / CONFIG_FILE
    if not p.is_file():
        raise K3Error(f"tokenizer: expected a directory with {CONFIG_FILE}, the file itself or a preset name, got {str(path_or_preset)!r}")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise K3Error(f"{p}: expected a JSON tokenizer config, could not read it ({e})") from None
    _check_config(cfg, p)
    return ByteTokenizer()


def _check_config(cfg: object, p: Path) -> None:
    expected = {"type": CONFIG_TYPE, "version": CONFIG_VERSION, "specials": list(SPECIAL_TOKENS), "chat_template": CHAT_TEMPLATE}
    if not isinstance(cfg, dict):
        raise K3Error(f"{p}: expected a JSON object, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(expected))
    if unknown:
        raise K3Error(f"{p}: unknown keys {unknown}; expected {sorted(expected)}")
    for key, want in expected.items():
        if key not in cfg:
            raise K3Error(f"{p}: missing key {key!r}")
        got = cfg[key]
        if got == want:
            continue
        if key == "specials" and isinstance(got, list) and len(got) == len(want):
            i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
            raise K3Error(f"{p}: specials[{i}] must be {want[i]!r}, got {got[i]!r}")
        if key == "specials":
            shown = f"{len(got)} entries" if isinstance(got, list) else repr(got)
            raise K3Error(f"{p}: specials must be the {len(want)} byte-tokenizer specials in order, got {shown}")
        raise K3Error(f"{p}: {key} must be {want!r}, got {got!r}")


def _preset_vocab(name: str) -> int | None:
    """The vocab size of a model preset, or None when no preset has that name."""
    from optimized_stack.presets import PRESETS  # lazy: presets pulls in torch and the model

    return PRESETS[name].vocab_size if name in PRESETS else None


def _compact_json(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _content_text(content: object, n: int) -> str:
    """String content, or OpenAI-style text parts joined; anything else is refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise K3Error(f"messages[{n}].content[{j}] must be {{'type': 'text', 'text': str}}; the byte tokenizer has no image or audio input")
            parts.append(part["text"])
        return "".join(parts)
    raise K3Error(f"messages[{n}].content must be str, list of text parts or None, got {type(content).__name__}")


def _call_parts(call: object, idx: int, n: int) -> tuple[str, str, str]:
    """OpenAI tool call -> (Kimi call id, function name, arguments JSON text)."""
    if not isinstance(call, dict):
        raise K3Error(f"messages[{n}].tool_calls entries must be dicts, got {type(call).__name__}")
    fn = call.get("function", call)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise K3Error(f"messages[{n}].tool_calls[].function.name must be a non-empty str, got {name!r}")
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = _compact_json(arguments)
    call_id = call.get("id")
    # Keep ids that are already Kimi-shaped so a parsed call renders back identically.
    if not (isinstance(call_id, str) and _CALL_HEADER_RE.match(call_id)):
        call_id = f"functions.{name}:{idx}"
    return call_id, name, arguments
