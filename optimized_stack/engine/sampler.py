"""Per-request sampling: greedy argmax at temperature 0, seeded multinomial otherwise.

Each request owns its torch.Generator (seeded from SamplingParams.seed), and sampling reads
one logit row at a time, so a request's tokens never depend on which requests share a step.
"""
from __future__ import annotations

import torch

from .options import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator().manual_seed(0 if params.seed is None else params.seed)

    def sample(self, row: torch.Tensor) -> int:
        """row [V] fp32 -> token id."""
        if self.generator is None:
            return int(torch.argmax(row))             # first maximum on ties
        # fp64 on a single CPU row: no batch dependence, no rounding into zero probabilities
        probs = torch.softmax(row.detach().to("cpu", torch.float64) / self.params.temperature, -1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
