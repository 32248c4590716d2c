"""Engine counters, and the theoretical reusable prefix a perfect cache could serve.

`reusable_tokens` is measured against every token sequence the engine has seen before a
request starts (prompts at admission, prompt + generated at finish), capped at
prompt_len - 1 because the last prompt token must be computed for its logits row.
`hit_rate` = prefix_hit_tokens / reusable_tokens: how much of the reusable prefix the
cache actually served (vLLM's K3 run: 80.1% against more than 96% reusable).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineMetrics:
    steps: int = 0
    requests_finished: int = 0
    prompt_tokens: int = 0                 # over first admissions
    generated_tokens: int = 0
    tokens_computed: int = 0               # rows run through the model
    tokens_recomputed: int = 0             # rows a request had computed before (preemption)
    prefix_hit_tokens: int = 0             # prompt tokens served from the cache (first admissions)
    reusable_tokens: int = 0               # theoretical, see module docstring
    cache_capacity_tokens: int = 0         # MLA pool capacity (0: no pool)
    checkpoints_saved: int = 0
    evictions: int = 0                     # device blocks + checkpoints evicted
    restores: int = 0                      # host -> device blocks + checkpoints
    preemptions: int = 0
    swap_ins: int = 0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.reusable_tokens if self.reusable_tokens else 0.0

    @property
    def reusable_fraction(self) -> float:
        return self.reusable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, float]:
        d: dict[str, float] = dict(asdict(self))
        d["hit_rate"] = self.hit_rate
        d["reusable_fraction"] = self.reusable_fraction
        return d


class PrefixTrie:
    """Token sequences seen so far, for the longest-common-prefix oracle."""

    def __init__(self) -> None:
        self.root: dict[int, dict] = {}

    def insert(self, tokens: list[int]) -> None:
        node = self.root
        for t in tokens:
            node = node.setdefault(t, {})

    def longest_prefix(self, tokens: list[int]) -> int:
        node, n = self.root, 0
        for t in tokens:
            if t not in node:
                break
            node, n = node[t], n + 1
        return n
