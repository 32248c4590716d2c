"""What a scenario is: requests with prompt ids, and what can be said about them without a
model (the reusable prefix, repeated n-grams).

Reusable fraction: requests are taken in arrival order (arrival_step, then their
position); a request's reusable tokens are its longest common prefix with any
earlier prompt, at token granularity (the engine keeps prefix entries inside a
block). The fraction is reusable tokens / total prompt tokens. A request with a
`parent` continues that request's prompt with the model's real answer (scenarios/
answers.py fills it in from the reference run); built without a model it carries a
stand-in of the same length, so sizes are known statically, and the fraction counts
the real answers once the scenario is realised. Block reuse counts the same prefix
rounded down to whole 64-token blocks (what block hashing alone can serve).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int = 0
    temperature: float = 0.0
    seed: int | None = None
    session: str | None = None
    turn: int = 0
    # multi-turn: this prompt = parent's prompt + parent's generated answer + `extend`
    parent: str | None = None
    extend: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        ids = tuple(self.prompt_ids)
        if not ids:
            raise ValueError(f"request {self.request_id}: prompt_ids must be non-empty")
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or i < 0]
        if bad:
            raise ValueError(f"request {self.request_id}: prompt ids must be ints >= 0, got {bad[0]!r}")
        object.__setattr__(self, "prompt_ids", ids)
        object.__setattr__(self, "extend", tuple(self.extend))
        for name in ("max_new_tokens", "arrival_step", "turn"):
            value, low = getattr(self, name), 1 if name == "max_new_tokens" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"request {self.request_id}: {name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"request {self.request_id}: temperature must be in [0, 2], got {self.temperature!r}")
        if self.temperature > 0 and self.seed is None:
            # An unseeded sampled request cannot be compared between two runs.
            raise ValueError(f"request {self.request_id}: temperature {self.temperature} needs a seed")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    tags: tuple[str, ...]
    requests: tuple[RequestSpec, ...]
    engine_hints: dict = field(default_factory=dict)
    reusable_fraction: float | None = None
    # What the builder guarantees, for tests and reports: fork points, lengths, sizes.
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tags", tuple(self.tags))
        object.__setattr__(self, "requests", tuple(self.requests))
        if not self.requests:
            raise ValueError(f"scenario {self.name}: needs at least one request")
        ids = [r.request_id for r in self.requests]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"scenario {self.name}: duplicate request ids {dupes}")
        if self.reusable_fraction is not None and not 0.0 <= self.reusable_fraction <= 1.0:
            raise ValueError(f"scenario {self.name}: reusable_fraction must be in [0, 1], got {self.reusable_fraction}")

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def new_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)

    @property
    def needs_answers(self) -> bool:
        """Whether prompts still carry answer stand-ins (realise with scenarios/answers.py)."""
        return any(r.parent for r in self.requests) and self.meta.get("answers") != "reference"

    @property
    def max_token_id(self) -> int:
        return max(max(r.prompt_ids) for r in self.requests)

    def request(self, request_id: str) -> RequestSpec:
        for r in self.requests:
            if r.request_id == request_id:
                return r
        raise KeyError(f"scenario {self.name} has no request {request_id!r}")

    def summary(self) -> dict[str, Any]:
        """JSON-ready description for reports (no token ids)."""
        return {
            "name": self.name, "description": self.description, "tags": list(self.tags),
            "requests": len(self.requests), "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens, "reusable_fraction": self.reusable_fraction,
            "engine_hints": dict(self.engine_hints),
        }


# ----------------------------------------------------------------- analysis helpers


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def arrival_order(requests: Sequence[RequestSpec]) -> list[RequestSpec]:
    """By arrival_step; ties keep their position (sorted is stable)."""
    return sorted(requests, key=lambda r: r.arrival_step)


def reusable_prefix_tokens(requests: Sequence[RequestSpec]) -> dict[str, int]:
    """request_id -> longest common prefix with any prompt that arrived before it."""
    seen: list[tuple[int, ...]] = []
    out: dict[str, int] = {}
    for r in arrival_order(requests):
        out[r.request_id] = max((common_prefix_len(p, r.prompt_ids) for p in seen), default=0)
        seen.append(r.prompt_ids)
    return out


def reusable_block_tokens(requests: Sequence[RequestSpec], block: int = 64) -> int:
    """Reusable prefix tokens rounded down to whole blocks per request (block hashing alone)."""
    return sum(n - n % block for n in reusable_prefix_tokens(requests).values())


def reusable_fraction(requests: Sequence[RequestSpec]) -> float:
    """Reusable prefix tokens / total prompt tokens (see the module docstring)."""
    total = sum(r.prompt_len for r in requests)
    if total == 0:
        raise ValueError("reusable_fraction needs at least one prompt token")
    return sum(reusable_prefix_tokens(requests).values()) / total


def repeated_ngram_fraction(ids: Sequence[int], n: int = 4) -> float:
    """Fraction of n-grams that already occurred earlier in ids: what prompt-lookup drafting can hit."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    if not grams:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for g in grams:
        hits += g in seen
        seen.add(g)
    return hits / len(grams)
