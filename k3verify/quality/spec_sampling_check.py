"""The distribution contract of sampled speculation, checked two ways.

1. The rule at scale (`rule_check`): a toy target model (a Markov chain over V tokens:
   p(. | previous token) = softmax(logits[prev] / T)) and a drafter (prompt-lookup-like: a
   deterministic next-token map, so q is a point mass; or a model drafter: its own Markov
   chain q(. | prev), drafts drawn from it). B sequences of the first m tokens are drawn
   (a) by plain ancestral sampling and (b) by repeated speculative verifications of k drafts
   through the engine's own rule (optimized_stack/engine/spec_sampling.py speculative_sample,
   batched over B), and the empirical distributions of the first token, the pairs and the
   m-tuples are compared by the chi-square test (quality/distribution.py). m = k + 1 covers
   accepted drafts, rejections and the bonus token.
2. End to end (`engine_check`): the engine with sampled speculation against the engine
   without speculation, on one repetitive prompt (prompt-lookup drafts exist), n seeds
   each; the first generated tokens compared the same way, with the path events that prove
   sampled verification ran.

A seeded fault (accept_power, resample_from_p / the engine faults) must fail the same test
at the same n: that is the check's negative control.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from optimized_stack.engine.spec_sampling import point_mass, speculative_sample

from .distribution import DistributionVerdict, same_counts


@dataclass(frozen=True)
class ToyChain:
    """A target Markov chain over V tokens and a drafter for it."""

    p: torch.Tensor              # [V, V] fp64: p[prev] = target distribution of the next token
    q: torch.Tensor              # [V, V] fp64: q[prev] = the drafter's (a point mass per row: ngram)
    deterministic: bool          # q is a point mass (the draft is q's argmax)

    @property
    def vocab(self) -> int:
        return self.p.shape[0]


def toy_chain(vocab: int = 6, temperature: float = 1.0, drafter: str = "ngram", seed: int = 0) -> ToyChain:
    """Seeded target logits N(0, 1.5^2) / T; drafter "ngram" (a random deterministic next-token
    map, so drafts are sometimes likely, sometimes not) or "model" (its own softmax chain)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(vocab, vocab, generator=g, dtype=torch.float64) * 1.5 / temperature, -1)
    if drafter == "ngram":
        nxt = torch.randint(0, vocab, (vocab,), generator=g)
        return ToyChain(p, point_mass(nxt.unsqueeze(-1), vocab).squeeze(1), True)
    if drafter == "model":
        # a drafter that is close to the target but not equal: the residual matters
        q = torch.softmax(torch.log(p) + torch.randn(vocab, vocab, generator=g, dtype=torch.float64), -1)
        return ToyChain(p, q, False)
    raise ValueError(f"drafter: expected 'ngram' or 'model', got {drafter!r}")


def plain_samples(chain: ToyChain, start: torch.Tensor, m: int, generator: torch.Generator) -> torch.Tensor:
    """start [B] -> the next m tokens [B, m] by ancestral sampling from p."""
    out, prev = [], start
    for _ in range(m):
        prev = torch.multinomial(chain.p[prev], 1, generator=generator).squeeze(-1)
        out.append(prev)
    return torch.stack(out, -1)


def speculative_samples(chain: ToyChain, start: torch.Tensor, m: int, k: int, generator: torch.Generator,
                        **fault: Any) -> tuple[torch.Tensor, dict[str, int]]:
    """start [B] -> the first m tokens [B, m] emitted by verifications of k drafts each, and the
    outcome counts (every draft accepted / some / none) over all verifications."""
    b = start.shape[0]
    out = torch.full((b, m + k + 1), -1, dtype=torch.long)
    length = torch.zeros(b, dtype=torch.long)
    last = start.clone()
    outcomes = {"accept_all": 0, "accept_partial": 0, "reject_all": 0}
    while bool((length < m).any()):
        rows = (length < m).nonzero().squeeze(-1)                                 # sequences still short
        prev = last[rows]
        drafts, ctx = [], prev
        for _ in range(k):                                                        # draft d_i ~ q(. | d_{i-1})
            ctx = (chain.q[ctx].argmax(-1) if chain.deterministic
                   else torch.multinomial(chain.q[ctx], 1, generator=generator).squeeze(-1))
            drafts.append(ctx)
        draft = torch.stack(drafts, -1)                                           # [R, K]
        context = torch.cat([prev.unsqueeze(-1), draft], -1)                      # [R, K+1]
        accepted, token = speculative_sample(chain.p[context], chain.q[context[:, :k]], draft, generator, **fault)
        outcomes["accept_all"] += int((accepted == k).sum())
        outcomes["reject_all"] += int((accepted == 0).sum())
        outcomes["accept_partial"] += int(((accepted > 0) & (accepted < k)).sum())
        emitted = torch.cat([draft, token.unsqueeze(-1)], -1)                     # [R, K+1]
        n_emit = accepted + 1
        emitted[torch.arange(k + 1).unsqueeze(0) == accepted.unsqueeze(-1)] = token   # token after the kept drafts
        for j in range(k + 1):
            sel = j < n_emit
            r = rows[sel]
            out[r, length[r] + j] = emitted[sel, j]
        last[rows] = token
        length[rows] += n_emit
    return out[:, :m], outcomes


@dataclass
class RuleReport:
    """Verdicts per statistic (first token, pairs, m-tuples), with what was run."""

    n: int
    k: int
    m: int
    vocab: int
    drafter: str
    fault: dict[str, Any]
    verdicts: dict[str, DistributionVerdict] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts.values())

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "k": self.k, "m": self.m, "vocab": self.vocab, "drafter": self.drafter,
                "fault": self.fault, "passed": self.passed, "outcomes": self.outcomes, "seconds": self.seconds,
                "verdicts": {name: v.to_dict() for name, v in self.verdicts.items()}}


def rule_check(n: int = 300_000, *, k: int = 2, m: int = 3, vocab: int = 6, temperature: float = 1.0,
               drafter: str = "ngram", alpha: float = 1e-3, seed: int = 0, **fault: Any) -> RuleReport:
    """Plain vs speculative sampling of the toy chain, n sequences each, judged per statistic."""
    t0 = time.perf_counter()
    chain = toy_chain(vocab, temperature, drafter, seed)
    g_plain = torch.Generator().manual_seed(2 * seed + 1)
    g_spec = torch.Generator().manual_seed(2 * seed + 2)
    start = torch.arange(n) % vocab                       # every context equally often, both arms
    plain = plain_samples(chain, start, m, g_plain)
    spec, outcomes = speculative_samples(chain, start, m, k, g_spec, **fault)
    # the outcome is (start, tokens): the test is of the conditional distribution given the context
    plain, spec = torch.cat([start.unsqueeze(-1), plain], -1), torch.cat([start.unsqueeze(-1), spec], -1)
    rep = RuleReport(n, k, m, vocab, drafter, dict(fault), outcomes=outcomes)
    rep.verdicts = judge_prefixes_with_context(plain, spec, alpha, vocab)
    rep.seconds = time.perf_counter() - t0
    return rep


def judge_prefixes_with_context(a: torch.Tensor, b: torch.Tensor, alpha: float, vocab: int
                                ) -> dict[str, DistributionVerdict]:
    """[N, 1 + m] (context, tokens) of two arms -> verdicts on (context, first token), (context,
    pair) and (context, m-tuple)."""
    m = a.shape[1] - 1
    widths = {"first": 1, "pairs": 2, f"tuples{m}": m} if m > 2 else {"first": 1, "pairs": m}
    return {name: same_counts(sequence_counts(a[:, :1 + w], vocab), sequence_counts(b[:, :1 + w], vocab), alpha)
            for name, w in widths.items()}


def sequence_counts(seqs: torch.Tensor, vocab: int) -> Counter:
    """[N, w] token sequences -> Counter of the tuples (counted as base-V integers, then decoded)."""
    w = seqs.shape[1]
    place = vocab ** torch.arange(w - 1, -1, -1)
    codes, counts = torch.unique((seqs * place).sum(-1), return_counts=True)
    return Counter({tuple(int(c) // vocab ** (w - 1 - j) % vocab for j in range(w)): int(n)
                    for c, n in zip(codes.tolist(), counts.tolist())})


# ---- end to end: the engine with sampled speculation against the engine without ------------

# a prompt whose tail recurs and which the trained k3-mini continues as it drafts ("y have"), so
# prompt lookup drafts at every decode step; at temperature 2.5 the drafts are kept with
# probability ~0.9 and every outcome occurs (measured: accept_all 21, partial 1 of 24 requests)
ENGINE_PROMPT = tuple(b"they have, they have, they have, the")
ENGINE_TEMPERATURE = 2.5
SAMPLED_EVENTS = ("spec_sampled_accept_all", "spec_sampled_accept_partial", "spec_sampled_reject_all")


@dataclass
class EngineReport:
    n: int
    max_new_tokens: int
    temperature: float
    faults: tuple[str, ...]
    verdicts: dict[str, DistributionVerdict] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)      # the speculative arm's sampled-verification counts
    seconds: float = 0.0

    @property
    def exercised(self) -> bool:
        return any(self.events.get(e) for e in SAMPLED_EVENTS)

    @property
    def passed(self) -> bool:
        return self.exercised and all(v.passed for v in self.verdicts.values())

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "faults": list(self.faults), "passed": self.passed, "exercised": self.exercised,
                "events": self.events, "seconds": self.seconds,
                "verdicts": {name: v.to_dict() for name, v in self.verdicts.items()}}


def engine_samples(model, n: int, *, speculative: str | None, max_new_tokens: int = 4,
                   temperature: float = ENGINE_TEMPERATURE,
                   faults: tuple[str, ...] = (), seed0: int = 0, prompt: tuple[int, ...] = ENGINE_PROMPT,
                   ) -> tuple[torch.Tensor, dict[str, int]]:
    """n requests (seeds seed0 .. seed0+n-1) of the same prompt -> their generated tokens
    [n, max_new_tokens] (ignore_eos, so every request runs to the length) and the engine's events."""
    from optimized_stack.engine import Engine, EngineOptions, SamplingParams

    spec = {"speculative": speculative, "spec_sampled": True, "num_draft_tokens": 3} if speculative else {}
    opts = EngineOptions(continuous_batching=True, prefix_cache=True, max_num_seqs=64, token_budget=4096,
                         faults=frozenset(faults), **spec)
    eng = Engine(model, opts)
    ids = [eng.add_request(list(prompt), SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                        seed=seed0 + i, ignore_eos=True)) for i in range(n)]
    results = eng.run()
    return torch.tensor([results[r].tokens for r in ids], dtype=torch.long), dict(eng.events)


def engine_check(model, n: int = 150, *, strategy: str = "copy_states", max_new_tokens: int = 4,
                 temperature: float = ENGINE_TEMPERATURE, alpha: float = 1e-3, faults: tuple[str, ...] = (), seed: int = 0
                 ) -> EngineReport:
    """The engine's first `max_new_tokens` generated tokens without speculation (seeds 0..n-1)
    and with sampled speculation (other seeds: independent streams), judged per statistic. The
    first token comes from the prefill in both arms; the speculative steps make the rest."""
    t0 = time.perf_counter()
    plain, _ = engine_samples(model, n, speculative=None, max_new_tokens=max_new_tokens,
                              temperature=temperature, seed0=seed)
    spec, events = engine_samples(model, n, speculative=strategy, max_new_tokens=max_new_tokens,
                                  temperature=temperature, faults=faults, seed0=seed + n)
    vocab = model.config.vocab_size
    widths = {"second": (1, 2), "first_two": (0, 2), f"first_{max_new_tokens}": (0, max_new_tokens)}
    rep = EngineReport(n, max_new_tokens, temperature, tuple(faults),
                       events={e: int(events.get(e, 0)) for e in SAMPLED_EVENTS})
    rep.verdicts = {name: same_counts(sequence_counts(plain[:, a:b], vocab), sequence_counts(spec[:, a:b], vocab), alpha)
                    for name, (a, b) in widths.items()}
    rep.seconds = time.perf_counter() - t0
    return rep
