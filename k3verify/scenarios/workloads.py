"""Deterministic, seeded scenarios shaped to break caches, schedulers and speculation.

Every scenario is a tuple of RequestSpecs whose prompt ids are bytes of generated
English-like text (a built-in word list; no external text), so a byte-level model
sees something that looks like text. Ids are never >= vocab: when vocab < 256,
bytes are folded with `b % vocab`, and divergence points are fixed up after the
fold so forks still part exactly where claimed.

Sizes are for a 2-core CPU: at scale 1.0 every scenario holds at most
MAX_DEFAULT_TOKENS prompt + new tokens. `scale` stretches the free lengths
(prompt bodies, histories, request counts stay fixed); lengths that sit on
BLOCK_TOKENS boundaries or fork points do not move with scale, because they are
the point of the scenario.

The registry (SCENARIOS) holds each scenario's name, description and tags as static
metadata beside its builder, so choosing scenarios for a toggle (scenarios/chooser.py) never
builds one; `build` runs the builder.
"""

from __future__ import annotations

import difflib
import random
from dataclasses import dataclass
from typing import Callable, Sequence

from k3verify.errors import UsageError
from k3verify.scenarios.requests import RequestSpec, Scenario, reusable_fraction

BLOCK_TOKENS = 64  # cache block and prefill chunk size the boundary cases aim at
SUBBLOCK_TOKENS = 16  # granularity of prefix-cache entries inside a block
MAX_DEFAULT_TOKENS = 16384  # prompt + new tokens per scenario at scale 1.0

_WORDS = (
    "the a an this that every each some model cache block token state layer kernel request "
    "batch prefix answer question system tool agent file line value check step chunk tensor "
    "buffer queue result number table reader writer server client patch branch test build "
    "runs reads writes keeps moves finds returns stores sends holds builds checks fixes opens "
    "fast small exact new old first last next quiet careful simple long short clean "
    "after before with from into over under near and but so then when while because "
    "is was can must will should may often never always again"
).split()
_TOOLS = ("read_file", "write_file", "list_dir", "grep", "run_tests", "apply_patch", "search_web", "ask_user")


@dataclass(frozen=True)
class ScenarioEntry:
    """A registered scenario: static metadata, and the builder that makes its requests."""

    name: str
    description: str
    tags: tuple[str, ...]
    builder: Callable[["_Gen", float], dict]
    # path events (optimized_stack/events.py) the scenario is built to fire under the toggles
    # its tags exercise: the selftest's chooser prefers a scenario that claims all of a
    # toggle's events, and tests/test_events.py proves every claim it relies on
    fires: tuple[str, ...] = ()

    def build(self, *, seed: int = 0, scale: float = 1.0, vocab: int = 256) -> Scenario:
        return build(self.name, seed=seed, scale=scale, vocab=vocab)


SCENARIOS: dict[str, ScenarioEntry] = {}        # in definition order: the chooser's order


def scenario(name: str, *, tags: tuple[str, ...], description: str, fires: tuple[str, ...] = ()):
    """Register a builder (g, scale) -> {"requests", "engine_hints"?, "meta"?}; names are unique."""
    def register(builder):
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} is registered twice")
        SCENARIOS[name] = ScenarioEntry(name, description, tuple(tags), builder, tuple(fires))
        return builder
    return register


# ----------------------------------------------------------------- generation


class _Gen:
    """Seeded text and id generator; everything it returns is already folded into vocab."""

    def __init__(self, name: str, seed: int, vocab: int) -> None:
        # A string seed hashes with sha512 inside random, so it is stable across processes. The
        # string predates scenarios/ and fixes every prompt (golden hashes record them): keep it.
        self.rng = random.Random(f"k3verify.workloads/{name}/{seed}")
        self.vocab = vocab
        self.seed = seed

    def fold(self, data: bytes) -> list[int]:
        return [b % self.vocab for b in data]

    def sentence(self, min_words: int = 4, max_words: int = 11) -> str:
        words = [self.rng.choice(_WORDS) for _ in range(self.rng.randint(min_words, max_words))]
        if len(words) > 6 and self.rng.random() < 0.3:
            words[self.rng.randint(2, len(words) - 3)] += ","
        return " ".join(words).capitalize() + self.rng.choice(".....?") + " "

    def text(self, n_tokens: int, lead: str = "") -> list[int]:
        """Exactly n_tokens ids of text starting with `lead`."""
        out = lead
        while len(out.encode()) < n_tokens:
            out += self.sentence()
        return self.fold(out.encode()[:n_tokens])

    def random_ids(self, n_tokens: int) -> list[int]:
        return [self.rng.randrange(min(self.vocab, 256)) for _ in range(n_tokens)]

    def diverge(self, base: Sequence[int], at: int, suffix_tokens: int) -> list[int]:
        """base[:at] + fresh text whose first id differs from base[at], so the prompts part exactly at `at`."""
        suffix = self.text(suffix_tokens, lead=self.rng.choice(("But ", "Now ", "Then ", "Also ")))
        if at < len(base) and suffix[0] == base[at]:
            suffix[0] = (base[at] + 1) % self.vocab
        return list(base[:at]) + suffix

    def sub_seed(self) -> int:
        return self.rng.randrange(1 << 31)


def _n(x: float, scale: float) -> int:
    return max(1, round(x * scale))


_Parts = dict  # requests, engine_hints, meta


@scenario("single", tags=("basic",),
          description="one request, whole prompt then 8 greedy decode steps")
def _single(g: _Gen, scale: float) -> _Parts:
    req = RequestSpec("r0", tuple(g.text(_n(100, scale))), 8)
    return dict(requests=[req])


@scenario("multi_length", tags=("batching",),
          description="continuous batching: different lengths, staggered arrivals, one seeded sampled request")
def _multi_length(g: _Gen, scale: float) -> _Parts:
    lengths = [100, 17, 230, 64, 45, 150]
    new = [8, 12, 6, 10, 16, 8]
    arrivals = [0, 0, 2, 3, 5, 8]
    reqs = []
    for i, (length, m, a) in enumerate(zip(lengths, new, arrivals)):
        sampled = i == 4  # one seeded sampled request: the sampler must be deterministic per request
        reqs.append(RequestSpec(f"r{i}", tuple(g.text(_n(length, scale))), m, arrival_step=a,
                                temperature=0.7 if sampled else 0.0, seed=g.sub_seed() if sampled else None))
    return dict(requests=reqs)


# Prompt lengths on, just before and just after 64-token boundaries, plus a split inside a block.
BOUNDARY_LENGTHS = (63, 64, 65, 127, 128, 129, 80)


@scenario("boundaries", tags=("boundaries",),
          description="prompt lengths on and around 64-token chunk/block boundaries; decode across one")
def _boundaries(g: _Gen, scale: float) -> _Parts:
    reqs = [RequestSpec(f"len{n:03d}", tuple(g.text(n)), 4) for n in BOUNDARY_LENGTHS]
    # Decode crosses the 64 boundary: prompt 60, tokens 61..68 land on both sides of it.
    reqs.append(RequestSpec("len060-decode-cross", tuple(g.text(60)), 8))
    reqs.append(RequestSpec("len001", tuple(g.text(1)), 4))
    return dict(requests=reqs,
                meta={"block_tokens": BLOCK_TOKENS, "prompt_lengths": {r.request_id: r.prompt_len for r in reqs}})


# Where forks part from the base prompt (= common prefix length with it).
FORK_BLOCK_POINTS = (127, 128, 129, 191, 192, 193)
FORK_SUBBLOCK_POINTS = (112, 144, 150, 160, 176)
SYSTEM_PREFIX_TOKENS = 104  # shared by every request of shared_prefix_forks; ends mid-block
FORK_BASE_TOKENS = 256


@scenario("shared_prefix_forks", tags=("prefix",),
          description="shared system prefix; forks part at, just before and just after block boundaries and at "
                      "sub-block points; a full-prompt duplicate")
def _shared_prefix_forks(g: _Gen, scale: float) -> _Parts:
    system = g.text(SYSTEM_PREFIX_TOKENS, lead="System: You are a careful assistant. ")
    base = system + g.text(FORK_BASE_TOKENS - SYSTEM_PREFIX_TOKENS, lead="User: ")
    reqs = [RequestSpec("base", tuple(base), 6)]
    forks = {}
    points = sorted(FORK_BLOCK_POINTS + FORK_SUBBLOCK_POINTS)
    for i, at in enumerate(points):
        rid = f"fork{at:03d}"
        reqs.append(RequestSpec(rid, tuple(g.diverge(base, at, _n(24, scale))), 6, arrival_step=2 + i))
        forks[rid] = at
    # The same prompt again: a full hit that still has to produce the last position's logits.
    reqs.append(RequestSpec("dup256", tuple(base), 6, arrival_step=2 + len(points)))
    forks["dup256"] = FORK_BASE_TOKENS
    return dict(requests=reqs,
                meta={"system_prefix_tokens": SYSTEM_PREFIX_TOKENS, "fork_points": forks, "base": "base"})


def _conversation(g: _Gen, prefix: list[int], session: str, turns: int, user_tokens: int,
                  first_arrival: int, gap: int, max_new: int, first_user: list[int] | None = None,
                  fork_of: RequestSpec | None = None) -> list[RequestSpec]:
    """Turns that re-send the whole history (prefix, user, the model's answer, ...) plus a new
    user message. Each turn after the first names the previous one as `parent`: its prompt is
    the parent's prompt + the parent's real answer (scenarios/answers.py; a stand-in of
    max_new tokens until realised) + the new message. `fork_of`: the session starts from that
    request's history (a subagent forked from a mid-session point)."""
    reqs: list[RequestSpec] = []
    parent = fork_of
    for t in range(turns):
        user = first_user if (t == 0 and first_user is not None) else g.text(user_tokens, lead="\nUser: ")
        if parent is None:
            prompt, extend, parent_id = list(prefix) + user, (), None
        else:
            stand_in = g.text(parent.max_new_tokens, lead="\nAssistant: ")
            prompt, extend, parent_id = list(parent.prompt_ids) + stand_in + user, tuple(user), parent.request_id
        req = RequestSpec(f"{session}-t{t}", tuple(prompt), max_new, arrival_step=first_arrival + t * gap,
                          session=session, turn=t, parent=parent_id, extend=extend)
        reqs.append(req)
        parent = req
    return reqs


# multi_turn: turn 0 of session s0 is exactly two blocks, so its retry hits inside block 1 with
# the tail rows from the cached block; session s1's turn 0 ends 4 tokens before a block boundary,
# so its answer crosses it and the next turn hits a checkpoint that covers generated tokens.
MULTI_TURN_SYSTEM_TOKENS = 48
MULTI_TURN_FIRST_PROMPTS = {"s0": 2 * BLOCK_TOKENS, "s1": 2 * BLOCK_TOKENS - 4}


@scenario("multi_turn", tags=("prefix",),
          description="AgentX in small: 2 sessions re-sending their history with the model's real answers, a "
                      "retried turn, a 2-turn subagent forked from a mid-session point")
def _multi_turn(g: _Gen, scale: float) -> _Parts:
    system = g.text(MULTI_TURN_SYSTEM_TOKENS, lead="System: Answer briefly. ")
    user, new, gap = _n(32, scale), 12, 16
    reqs: list[RequestSpec] = []
    for s, first_len in MULTI_TURN_FIRST_PROMPTS.items():
        first = g.text(first_len - len(system), lead="\nUser: ")
        reqs += _conversation(g, system, s, turns=2, user_tokens=user, first_arrival=0 if s == "s0" else 1,
                              gap=gap, max_new=new, first_user=first)
    t0, t1 = reqs[0], reqs[1]
    # the harness retries turn 0 (a tool timeout): the very same prompt again
    reqs.append(RequestSpec("s0-t0-retry", t0.prompt_ids, new, arrival_step=2 * gap, session="s0"))
    # turn 1's tool call spawns a subagent on the parent's history (answer included), two turns
    task = g.text(user, lead="\nTask: ")
    reqs += _conversation(g, [], "s0-sub1", turns=2, user_tokens=user, first_arrival=t1.arrival_step + 20,
                          gap=gap, max_new=new, first_user=task, fork_of=t1)
    return dict(requests=reqs, meta={"system_prefix_tokens": len(system),
                                     "first_prompt_tokens": dict(MULTI_TURN_FIRST_PROMPTS)})


@scenario("long_prompt", tags=("long",),
          description="one long prompt through chunked prefill (not a multiple of the chunk size)")
def _long_prompt(g: _Gen, scale: float) -> _Parts:
    req = RequestSpec("long", tuple(g.text(_n(1500, scale), lead="Document: ")), 8)
    return dict(requests=[req])


# Where the engine cuts on the 64-token KDA grid (the GPU profile, kernels/kda/grid.py) it cuts a
# prompt below its aligned length only on the grid; an off-grid cut needs a budget (96) that ends
# inside the unaligned tail, i.e. a tail longer than 96 - 64 = 32 tokens. long_prompt's 1500 has a
# tail of 28: on the H200 chunked_prefill cut it 22 times, all on the grid, so neither
# chunk_cut_off_grid nor mut_chunk_resets_conv ran (golden/reports/gpu-2026-12-02-h200-release).
# This one keeps a 48-token tail at every scale (tests/test_engine_grid.py proves the cut).
@scenario("long_prompt_tail", tags=("long",), fires=("chunk_cut_on_grid", "chunk_cut_off_grid"),
          description="one long prompt with a 48-token unaligned tail, so a 96-token chunk budget cuts "
                      "off the 64-token KDA grid even where the engine cuts on it")
def _long_prompt_tail(g: _Gen, scale: float) -> _Parts:
    n = max(_n(1520, scale), 112)
    req = RequestSpec("long", tuple(g.text(n - n % 64 + 48, lead="Document: ")), 8)
    return dict(requests=[req])


@scenario("eviction", tags=("prefix", "eviction"),
          description="three prefix families cycled under a device cache smaller than two of them, so every "
                      "reuse is an evict-then-restore (or recompute)")
def _eviction(g: _Gen, scale: float) -> _Parts:
    families = {f: g.text(_n(160, scale), lead=f"Project {f}: ") for f in "ABC"}
    reqs = []
    for rnd in range(3):
        for f, prefix in families.items():
            i = len(reqs)
            # Spaced arrivals, so each family's prefix is cached and pushed out before it comes back.
            reqs.append(RequestSpec(f"{f}{rnd}", tuple(g.diverge(prefix, len(prefix), _n(24, scale))), 6,
                                    arrival_step=i * 12))
    return dict(requests=reqs, engine_hints={"device_cache_tokens": 256},
                meta={"family_prefix_tokens": {f: len(p) for f, p in families.items()}})


@scenario("preemption", tags=("preemption",),
          description="six concurrent requests (two sampled) over a 4-block MLA pool and four KDA state slots: "
                      "preempt, swap and resume")
def _preemption(g: _Gen, scale: float) -> _Parts:
    lengths = [40, 90, 65, 120, 30, 75]
    # r3 and r5 sample (seeded): r3 is the request the pool pressure preempts (the newest running
    # one, LIFO), so its resume must carry on the sampler's stream, not restart it
    reqs = [RequestSpec(f"r{i}", tuple(g.text(_n(n, scale))), 8 + 2 * i,
                        temperature=1.5 if i in (3, 5) else 0.0, seed=1000 + i if i in (3, 5) else None)
            for i, n in enumerate(lengths)]
    # A tight MLA pool is what forces preemption (a small KDA pool only caps concurrency):
    # 256 tokens = 4 blocks, while two of these requests together need up to 6.
    return dict(requests=reqs, engine_hints={"kda_pool_slots": 4, "device_cache_tokens": 256})


@scenario("agentic", tags=("prefix", "agentic"),
          description="AgentX shape: shared system/tools prefix, sessions re-sending their history with the "
                      "model's real answers, subagents forked from a parent's history")
def _agentic(g: _Gen, scale: float) -> _Parts:
    tools = "".join(f"tool {name}(path): {g.sentence(3, 6)}\n" for name in _TOOLS)
    prefix = g.text(_n(512, scale), lead="System: You are a coding agent.\nTools:\n" + tools)
    reqs: list[RequestSpec] = []
    for s in range(2):
        conv = _conversation(g, prefix, f"s{s}", turns=6, user_tokens=_n(20, scale),
                             first_arrival=s, gap=24, max_new=12)
        reqs += conv
        # Subagents fork the parent's history after turns 1 and 3 and run two turns each; they
        # arrive after the parent's next turn, as a tool call returns before the parent goes on.
        for fork_turn in (1, 3):
            task = g.text(_n(20, scale), lead="\nTask: ")
            reqs += _conversation(g, [], f"s{s}-sub{fork_turn}", turns=2, user_tokens=_n(20, scale),
                                  first_arrival=conv[fork_turn + 1].arrival_step + 4, gap=24, max_new=12,
                                  first_user=task, fork_of=conv[fork_turn])
    return dict(requests=reqs, meta={"system_prefix_tokens": len(prefix)})


# spec_repetitive: after its answer each request re-sends the last REQUOTE_TOKENS of its prompt
# (an agent re-reading a file it was shown): the drafter then proposes the model's own earlier
# answer, which the target accepts in full, in part, or not at all
REQUOTE_TOKENS = 96


@scenario("spec_repetitive", tags=("spec",),
          # spec_model_drafts: under the draft model's toggles (spec_model_*), whose selftest picks this one
          fires=("spec_accept_all", "spec_accept_partial", "spec_reject_all", "spec_model_drafts"),
          description="repeated sentences, then the model's real answer and the prompt's tail re-quoted: "
                      "prompt-lookup drafts accepted in full, in part and rejected")
def _spec_repetitive(g: _Gen, scale: float) -> _Parts:
    reqs = []
    for i in range(3):
        motifs = [g.sentence(3, 5) for _ in range(1 + i)]  # 1, 2, 3 short sentences cycled
        body = "".join(motifs[k % len(motifs)] for k in range(64))
        first = RequestSpec(f"rep{i}", tuple(g.fold(body.encode()[:_n(192, scale)])), 24, arrival_step=i)
        requote = first.prompt_ids[-REQUOTE_TOKENS:]
        stand_in = g.text(first.max_new_tokens)
        reqs += [first, RequestSpec(f"rep{i}-requote", first.prompt_ids + tuple(stand_in) + requote, 24,
                                    arrival_step=40 + i, parent=first.request_id, extend=requote)]
    return dict(requests=reqs)


@scenario("spec_random", tags=("spec",),
          description="random bytes: few repeated n-grams, drafts mostly rejected")
def _spec_random(g: _Gen, scale: float) -> _Parts:
    reqs = [RequestSpec(f"rnd{i}", tuple(g.random_ids(_n(192, scale))), 24) for i in range(3)]
    return dict(requests=reqs)


def build(name: str, *, seed: int = 0, scale: float = 1.0, vocab: int = 256) -> Scenario:
    """The named scenario; the same (name, seed, scale, vocab) always gives the same requests."""
    if name not in SCENARIOS:
        close = difflib.get_close_matches(str(name), list(SCENARIOS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"unknown scenario {name!r}{hint} (known: {', '.join(SCENARIOS)})")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UsageError(f"scenario seed must be an integer, got {seed!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0.0 < scale <= 64.0:
        raise UsageError(f"scenario scale must be a number in (0, 64], got {scale!r}")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2:
        raise UsageError(f"vocab must be an integer >= 2, got {vocab!r}")
    entry = SCENARIOS[name]
    parts = entry.builder(_Gen(name, seed, vocab), float(scale))
    requests = tuple(parts["requests"])
    meta = {"seed": seed, "scale": float(scale), "vocab": vocab, **parts.get("meta", {})}
    return Scenario(name=name, description=entry.description, tags=entry.tags, requests=requests,
                    engine_hints=dict(parts.get("engine_hints", {})),
                    reusable_fraction=reusable_fraction(requests), meta=meta)


def list_scenarios(tag: str | None = None) -> list[str]:
    """Scenario names in definition order; with `tag`, only those carrying it (static tags: nothing is built)."""
    return [name for name, entry in SCENARIOS.items() if tag is None or tag in entry.tags]
