"""The engine's side of the fast decode step: which steps it takes, and one step end to end.

    fast = FastDecoder(model, store, opts)       # engine option batched_decode (cuda_graphs: replayed)
    if fast.takes(plan):
        rows, tokens = fast.run(plan, keep_rows=...)

A step is taken when every scheduled request is a plain one-token decode: one pending token,
the last one sampled, past the prompt, no speculative drafts, no seeded recompute jump, and no
probe attached to the model. Everything else (prefill chunks, verifications, mixed steps) stays
on the engine's reference path. The step itself writes the new MLA rows and KDA state into the
pools; the engine then does the commit bookkeeping (store.commit_written).

Per step on the host: the block tables of the rows whose block list changed, one [4, Bp] input
tensor, and one [2, Bp] read-back (tokens and finiteness): the only host sync of the step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import K3Error
from .batch import build_meta, padded_size
from .decode_step import DecodeStep
from .graphs import GraphRunner


@dataclass
class FastStats:
    """Evidence that the fast path ran (design.md, "Evidence that a check ran")."""

    steps: int = 0                 # decode steps taken by the fast path
    rows: int = 0                  # real rows they decoded
    padded_rows: int = 0           # padding rows they ran
    graph_replays: int = 0
    graph_captures: int = 0
    eager_reason: str | None = None    # why cuda_graphs ran eagerly (None: it did not)


class FastDecoder:
    def __init__(self, model, store, opts):
        if opts.cuda_graphs and model.device.type != "cuda":
            raise K3Error(f"engine option cuda_graphs needs a CUDA model, the model is on {model.device}")
        self.model = model
        self.step = DecodeStep(model, store, opts)
        self.graphs = (GraphRunner(self.step, stale_input="mut_graph_stale_input" in opts.faults)
                       if opts.cuda_graphs else None)
        self.pad_shares_table = "mut_fast_pad_shares_table" in opts.faults
        self.stats = FastStats()
        self._pin = model.device.type == "cuda"

    def takes(self, plan) -> bool:
        if not plan or self.model._probes:
            return False
        for req, n in plan:
            if (n != 1 or req.draft or req.skip_generated or req.slot is None
                    or req.num_computed != len(req.tokens) - 1 or req.num_computed < len(req.prompt)):
                return False
        return True

    def run(self, plan, *, keep_rows: bool) -> tuple[torch.Tensor, list[int | None]]:
        """Decode one token for every request of `plan` -> (logits rows [B, V] fp32 on the device,
        per request its greedy token, or None where the request samples or its row is not finite:
        the engine's sampler then handles that row)."""
        reqs = [req for req, _ in plan]
        tables = self.step.tables
        for req in reqs:
            tables.sync(req.slot, req.blocks)
        size = padded_size(len(reqs))
        batch = build_meta([req.tokens[-1] for req in reqs], [req.num_computed for req in reqs],
                           [req.slot for req in reqs], self.step.spare_slot, size, pin=self._pin,
                           pad_shares_table=self.pad_shares_table)
        logits, sampled = self._forward(batch.meta)
        flags = sampled[:, :len(reqs)].tolist()                     # the step's one host sync
        rows = logits[:len(reqs)]
        if keep_rows and self.graphs is not None:
            rows = rows.clone()                                     # the next replay overwrites it
        tokens = [tok if ok and req.params.temperature == 0 else None
                  for req, tok, ok in zip(reqs, flags[0], flags[1])]
        s = self.stats
        s.steps += 1
        s.rows += len(reqs)
        s.padded_rows += size - len(reqs)
        return rows, tokens

    def _forward(self, meta_host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graphs is not None:
            reason = self.step.capturable()
            if reason is None:
                out = self.graphs.run(meta_host)
                self.stats.graph_replays = self.graphs.replays
                self.stats.graph_captures = self.graphs.captures
                return out
            self.stats.eager_reason = reason
        return self.step.forward(meta_host.to(self.model.device, non_blocking=True))
