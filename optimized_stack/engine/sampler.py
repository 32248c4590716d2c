"""Per-request sampling: greedy argmax at temperature 0, seeded multinomial otherwise.

Each request owns its torch.Generator (seeded from SamplingParams.seed), and sampling reads
one logit row at a time, so a request's tokens never depend on which requests share a step.

A row holding NaN or +inf is refused with NonFiniteLogits instead of becoming a token:
torch.argmax returns the index of the first NaN, so a broken model would otherwise generate
confidently. -inf is a legitimate value (a masked token: probability 0) as long as some
entry is finite. The caller that knows where the row came from reports the location (the
verifier's runners keep the run's capture and fail the check with it).
"""
from __future__ import annotations

import math

import torch

from .options import SamplingParams


class NonFiniteLogits(ArithmeticError):
    """A logits row the sampler cannot pick a token from (NaN, +inf, or nothing finite)."""

    def __init__(self, kind: str, vocab_index: int, count: int, vocab: int):
        self.kind, self.vocab_index, self.count, self.vocab = kind, vocab_index, count, vocab
        super().__init__(f"sampler refused a logits row: {kind} at vocab index {vocab_index} "
                         f"({count} of {vocab} entries non-finite); no token can be chosen from it")


def check_row(row: torch.Tensor) -> None:
    """Raise NonFiniteLogits unless `row` [V] is samplable: no NaN, no +inf, one finite entry."""
    finite = torch.isfinite(row)
    if bool(finite.all()):
        return
    bad = torch.isnan(row) | (row == math.inf)
    if not bool(bad.any()) and bool(finite.any()):
        return                                        # -inf entries only: masked tokens
    where = (bad if bool(bad.any()) else ~finite).nonzero()
    i = int(where[0, 0])
    x = float(row[i])
    kind = "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    raise NonFiniteLogits(kind, i, int((~finite).sum()), row.numel())


def target_probs(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    """The sampling distribution of logits rows [..., V] at temperature > 0, fp64 on the CPU
    (one definition for the plain sampler and speculative sampling, spec_sampling.py)."""
    return torch.softmax(rows.detach().to("cpu", torch.float64) / temperature, -1)


class Sampler:
    # the batched decode step's on-device greedy token may stand in for sample() (same rule:
    # first maximum); a sampler that must see every row (a grammar, logprobs) sets this False
    takes_device_token = True

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator().manual_seed(0 if params.seed is None else params.seed)

    def sample(self, row: torch.Tensor) -> int:
        """row [V] fp32 -> token id; NonFiniteLogits for a row no token can come from."""
        check_row(row)
        if self.generator is None:
            return int(torch.argmax(row))             # first maximum on ties
        # fp64 on a single CPU row: no batch dependence, no rounding into zero probabilities
        return int(torch.multinomial(target_probs(row, self.params.temperature), 1, generator=self.generator))
