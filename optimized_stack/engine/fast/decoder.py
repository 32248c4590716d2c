"""The engine's side of the fast decode step: which rows of a step it takes, and those rows end to end.

    fast = FastDecoder(model, store, opts)       # engine option batched_decode (cuda_graphs: replayed)
    decodes, rest = fast.split(plan)
    out = fast.run(decodes, keep_rows=...)    # out.rows, out.tokens, out.words; `rest` through forward_batch

The fast path takes a step's plain one-token decodes: one pending token, the last one sampled,
past the prompt, no speculative drafts, no seeded recompute jump, no probe attached to the
model. Everything else (prefill chunks, verifications) runs in the same step on the engine's
reference path, in its own forward: rows are row-invariant, so splitting one forward of a mixed
step into two changes no bits. The step itself writes the new MLA rows and KDA state into the
pools; the engine then does the commit bookkeeping (store.commit_written).

Per step on the host: the block tables of the rows whose block list changed, one [4, Bp] input
tensor, and one [2, Bp] read-back (tokens and finiteness): the only host sync of the step. With an
observer's digests in the step (step_digests.py), one more small device copy: the step's words.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import K3Error
from ...kernels.moe.situ_form import fire_situ_events
from .batch import ROW_KDA_SLOT, build_meta, padded_size
from .decode_step import DecodeStep
from .graphs import GraphRunner
from .kda_step import value_tiles


@dataclass
class FastStats:
    """Evidence that the fast path ran (design.md, "Evidence that a check ran")."""

    steps: int = 0                 # decode steps taken by the fast path
    rows: int = 0                  # real rows they decoded
    padded_rows: int = 0           # padding rows they ran
    graph_replays: int = 0
    graph_captures: int = 0
    eager_reason: str | None = None    # why cuda_graphs ran eagerly (None: it did not)
    digest_steps: int = 0              # steps whose observer digests were taken inside the step
    digests_off: str | None = None     # why the in-step digests were turned off (None: they were not)


@dataclass
class FastResult:
    """One fast step for B requests: their logits rows [B, V] fp32 on the device, per request its
    greedy token (None: the engine's sampler takes the row), and the observer's words of the step
    [entries, B, W] (a copy; None when no digests rode in the step)."""

    rows: torch.Tensor
    tokens: list[int | None]
    words: torch.Tensor | None = None


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
        self.events = store.events                      # the engine's path events (events.py)
        self._pin = model.device.type == "cuda"
        self._eager_checked = False                     # the eager step's first words checked

    def split(self, plan) -> tuple[list, list]:
        """plan -> (the plain one-token decodes this path runs, everything else). Nothing is taken
        while a probe is attached to the model (the fast step emits none), unless the probe says
        it watches forward_batch rows only (`fast_path_ok`: the engine trace of localize_engine)."""
        if any(not getattr(p, "fast_path_ok", False) for p in self.model._probes):
            return [], list(plan)
        fast, rest = [], []
        for req, n in plan:
            plain = (n == 1 and not req.draft and not req.skip_generated and req.slot is not None
                     and req.num_computed == len(req.tokens) - 1 and req.num_computed >= len(req.prompt))
            (fast if plain else rest).append((req, n))
        return fast, rest

    def run(self, plan, *, keep_rows: bool) -> FastResult:
        """Decode one token for every request of `plan` -> its FastResult (a token is None where the
        request samples or its row is not finite: the engine's sampler then handles that row).
        `keep_rows`: the rows outlive the step (an observer reads them), so a replay's are copied."""
        reqs = [req for req, _ in plan]
        tables = self.step.tables
        for req in reqs:
            tables.sync(req.slot, req.blocks)
        size = padded_size(len(reqs))
        batch = build_meta([req.tokens[-1] for req in reqs], [req.num_computed for req in reqs],
                           [req.slot for req in reqs], self.step.spare_slot, size, pin=self._pin,
                           pad_shares_table=self.pad_shares_table)
        logits, sampled, words = self._forward(batch.meta)
        if words is not None:
            words = words[:, :len(reqs)].clone()                    # the next replay overwrites them
        flags = sampled[:, :len(reqs)].tolist()                     # the step's one host sync
        rows = logits[:len(reqs)]
        if keep_rows and self.graphs is not None and words is None:
            rows = rows.clone()                                     # the next replay overwrites it
        tokens = [tok if ok and req.params.temperature == 0 and req.sampler.takes_device_token else None
                  for req, tok, ok in zip(reqs, flags[0], flags[1])]
        s = self.stats
        s.steps += 1
        s.rows += len(reqs)
        s.padded_rows += size - len(reqs)
        self.events.fire("fast_decode_rows", len(reqs))
        if value_tiles(self.model.config.kda_head_dim) > 1 and "kda" in self.model.config.layer_kinds:
            self.events.fire("fast_kda_value_tiles", len(reqs))
        if size > len(reqs):
            self.events.fire("fast_padded_rows", size - len(reqs))
        if words is not None:
            s.digest_steps += 1
            self.events.fire("fast_step_digests", len(reqs))
        if self.step.fused_conv and "kda" in self.model.config.layer_kinds:
            self.events.fire("fast_fused_conv_rows", len(reqs))
        if self.step.combine_fused and self.model.config.num_experts:   # set by the (captured) forward
            self.events.fire("fast_fused_combine_rows", len(reqs))
            if self.model.config.num_experts_per_token > 2:
                self.events.fire("fast_fused_combine_three_plus", len(reqs))
        if self.step.situ_fused:                                         # set by the (captured) forward
            fire_situ_events(self.events, len(reqs), self.model.config)
        return FastResult(rows, tokens, words)

    def _forward(self, meta_host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(logits, sampled, words or None). A failure of the digests turns them off and this step's
        observers get their calls after the step; the step itself is never run twice on the requests'
        state (it advances the pools in place): eagerly the words are taken after the forward, apart
        from it; a graph is retried without them only when the failure came while capturing it (its
        warm-up and capture touch the spare slot alone). The first words of each graph, and of the
        eager step, are checked against the digester's other form."""
        digests = self.step.digests
        if self.graphs is not None:
            reason = self.step.capturable()
            if reason is None:
                size = meta_host.shape[1]
                fresh = not self.graphs.has(size)
                try:
                    out = self.graphs.run(meta_host)
                except Exception as exc:   # noqa: BLE001 - re-raised unless a capture with digests failed
                    if digests is None or not fresh:
                        raise
                    self._digests_off(f"capturing the step with its digests failed: {type(exc).__name__}: {exc}"[:300])
                    out = self.graphs.run(meta_host)
                self.events.fire("graph_replay")
                self.stats.graph_replays = self.graphs.replays
                self.stats.graph_captures = self.graphs.captures
                return self._checked(out, meta_host, self.graphs.first_replay)
            self.stats.eager_reason = reason
        meta = meta_host.to(self.model.device, non_blocking=True)
        logits, sampled = self.step.forward(meta)
        if digests is None:
            return logits, sampled, None
        try:
            words = digests.words(logits, meta[ROW_KDA_SLOT])
        except Exception as exc:   # noqa: BLE001 - the forward is done; only the words are lost
            self._digests_off(f"the step's digests failed: {type(exc).__name__}: {exc}"[:300])
            return logits, sampled, None
        first = not self._eager_checked
        self._eager_checked = True
        return self._checked((logits, sampled, words), meta_host, first)

    def _checked(self, out, meta_host: torch.Tensor, first: bool):
        """out, or out without its words when these first words differ from the digester's other form."""
        digests = self.step.digests
        if digests is None or out[2] is None or not first:
            return out
        why = digests.check(out[0], meta_host[ROW_KDA_SLOT].to(self.model.device), out[2])
        if why is None:
            return out
        self._digests_off(why)
        return out[0], out[1], None

    def _digests_off(self, why: str) -> None:
        digests = self.step.digests
        if digests is not None:
            digests.turn_off(why)
        self.step.digests = None                 # graphs are keyed by it: new ones are captured plain
        self.stats.digests_off = why
