"""Speculative sampling at temperature > 0: the accept / resample rule that keeps the output
distribution equal to the target's (Leviathan et al. 2023, Chen et al. 2023).

For one verification of k drafts d_1..d_k with target distributions p_1..p_{k+1} (the rows of
the verify forward, temperature-adjusted exactly as the plain Sampler does) and drafter
distributions q_1..q_k (the distribution each draft was drawn from):

- draft d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order, stopping at
  the first rejection;
- at a rejection at position i the emitted token is drawn from the residual
  norm(max(0, p_i - q_i));
- when all k are accepted a bonus token is drawn from p_{k+1}.

Why it is exact: at one position P(out = y) = q(y) min(1, p(y)/q(y)) + beta * r(y) with
beta = 1 - sum min(p, q) = sum max(0, p - q) and r = max(0, p - q) / beta, so
P(out = y) = min(p, q)(y) + max(0, p - q)(y) = p(y) (`rule_output_distribution` computes it).

q is an explicit argument so a model drafter's probabilities plug in; the prompt-lookup
drafter is deterministic, its q a point mass on the draft (`point_mass`): accept d with
probability p(d), and on rejection draw from p with d removed and renormalised.

Everything is batched over B independent sequences ([B, ...]) so that one code path serves
the engine (B = 1, the request's own generator) and the statistical test (B = 1e5 at once).
Shape letters: B sequences, K drafts, V vocabulary. Probabilities are fp64 throughout, as in
the Sampler, so that no small probability rounds to zero.

Seeded faults (negative controls for the distribution check): `accept_power` != 1 accepts
with min(1, p/q) ** accept_power (a biased acceptance), `resample_from_p` draws the
replacement from p instead of the residual (the most common bug of this rule).
"""
from __future__ import annotations

import torch

from .sampler import target_probs

# a residual this small is rounding of p - q where p == q: a rejection there has probability 0
# in exact arithmetic, and the right replacement distribution is p itself
RESIDUAL_FLOOR = 1e-15

# engine faults (options.FAULTS) that this module implements
FAULT_ACCEPT_SQRT = "mut_spec_sampled_accept_sqrt"
FAULT_RESAMPLE_FROM_P = "mut_spec_sampled_resample_from_p"


def point_mass(draft: torch.Tensor, vocab: int) -> torch.Tensor:
    """The drafter distribution of a deterministic drafter: draft [B, K] -> q [B, K, V] fp64."""
    q = torch.zeros(*draft.shape, vocab, dtype=torch.float64)
    return q.scatter_(-1, draft.unsqueeze(-1), 1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis; p where the residual vanishes (p == q)."""
    r = (p - q).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > RESIDUAL_FLOOR, r / mass.clamp_min(RESIDUAL_FLOOR), p)


def acceptance_probability(p_draft: torch.Tensor, q_draft: torch.Tensor, accept_power: float = 1.0) -> torch.Tensor:
    """min(1, p(d) / q(d)) for the drafted tokens (q(d) > 0: d was drawn from q)."""
    return (p_draft / q_draft).clamp(max=1.0) ** accept_power


def speculative_sample(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, generator: torch.Generator | None,
                       *, accept_power: float = 1.0, resample_from_p: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One verification of K drafts for B sequences.

    p [B, K+1, V] target probabilities, q [B, K, V] drafter probabilities, draft [B, K] token ids.
    Returns (accepted [B]: drafts kept, in 0..K; token [B]: the token emitted after them, drawn
    from the residual at the first rejection or from p[:, K] when all K were accepted). The
    sequence's emitted tokens are draft[b, :accepted[b]] + [token[b]].

    Random draws, in this order: B*K uniforms, then B multinomial draws (one stream per call)."""
    b, k, v = q.shape
    if p.shape != (b, k + 1, v) or draft.shape != (b, k):
        raise ValueError(f"speculative_sample: expected p [B, K+1, V], q [B, K, V], draft [B, K] with "
                         f"B={b}, K={k}, V={v}; got p {tuple(p.shape)}, draft {tuple(draft.shape)}")
    u = torch.rand(b, k, dtype=torch.float64, generator=generator)                       # [B, K]
    idx = draft.unsqueeze(-1)
    ok = u < acceptance_probability(p[:, :k].gather(-1, idx).squeeze(-1), q.gather(-1, idx).squeeze(-1),
                                    accept_power)                                       # [B, K]
    # drafts kept: the length of the leading run of acceptances
    accepted = ok.to(torch.int64).cumprod(-1).sum(-1)                                   # [B]
    at = accepted.clamp(max=max(k - 1, 0))
    rows = torch.arange(b)
    p_at = p[rows, accepted]                                                            # [B, V]
    if k:
        repl = p[rows, at] if resample_from_p else residual(p[rows, at], q[rows, at])
        dist = torch.where((accepted < k).unsqueeze(-1), repl, p_at)
    else:
        dist = p_at
    token = torch.multinomial(dist, 1, generator=generator).squeeze(-1)                 # [B]
    return accepted, token


def rule_output_distribution(p: torch.Tensor, q: torch.Tensor, *, accept_power: float = 1.0,
                             resample_from_p: bool = False) -> torch.Tensor:
    """The exact distribution of the token one position emits, in closed form: a draft d ~ q is
    kept with probability a(d) = min(1, p(d)/q(d)) ** accept_power, else the replacement is
    drawn from the residual (or from p under the fault). p, q [..., V] fp64 -> [..., V]; equals
    p for the right rule."""
    safe_q = torch.where(q > 0, q, torch.ones_like(q))
    a = torch.where(q > 0, (p / safe_q).clamp(max=1.0) ** accept_power, torch.zeros_like(q))
    kept = q * a
    rejected = 1.0 - kept.sum(-1, keepdim=True)
    return kept + rejected * (p if resample_from_p else residual(p, q))


def verify_sampled(rows: torch.Tensor, draft: list[int], temperature: float, generator: torch.Generator,
                   q: torch.Tensor | None = None, faults: frozenset[str] = frozenset()) -> tuple[int, list[int]]:
    """The engine's hook: rows [1 + K, V] logits of a verification, the K drafts, the request's
    temperature and generator; q [K, V] the drafter's probabilities (None: a deterministic
    drafter, a point mass on each draft). Returns (drafts accepted m, the emitted tokens
    draft[:m] + [next])."""
    k = len(draft)
    p = target_probs(rows, temperature).unsqueeze(0)                                    # [1, K+1, V]
    d = torch.tensor([draft], dtype=torch.long)                                         # [1, K]
    q = point_mass(d, p.shape[-1]) if q is None else q.to(torch.float64).unsqueeze(0)
    accepted, token = speculative_sample(
        p, q, d, generator, accept_power=0.5 if FAULT_ACCEPT_SQRT in faults else 1.0,
        resample_from_p=FAULT_RESAMPLE_FROM_P in faults)
    m = int(accepted[0])
    assert 0 <= m <= k
    return m, draft[:m] + [int(token[0])]
