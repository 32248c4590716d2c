"""The engine: requests in, tokens out, one scheduler step at a time.

    eng = Engine(model, EngineOptions(...), observers=[...])
    rid = eng.add_request(prompt_ids, SamplingParams(max_new_tokens=16))
    eng.step()                  # one scheduler step -> [StepOutput]
    results = eng.run()         # until every request finished -> {rid: RequestResult}

With every option off this is the reference path: one request at a time in arrival order,
whole-prompt prefill in one forward, then one token per step, no cache reuse. Every
option only changes *which rows are computed when* and *where state is kept*; rows are
always computed by the model's row-stable ops and state is only ever copied, so each
option is exact by construction (and the verifier checks it, through the observers).

A step runs the scheduled chunks in rounds: round r runs the r-th piece of every
request's chunk in one `forward_batch` (a chunk is cut into pieces only where the prefix
cache takes a KDA checkpoint, because the model hands back state at the end of a call).
"""
from __future__ import annotations

import contextlib
import itertools

import torch

from ..errors import K3Error
from ..events import Events
from ..kernels.kda.grid import grid_in_force, grid_pieces
from ..model import ops
from ..model.kda import KDAState
from ..model.model import K3Model
from .fast.decoder import FastDecoder
from .fast.step_digests import StepDigests, step_digester
from .metrics import EngineMetrics, PrefixTrie
from .options import EngineOptions, RequestResult, SamplingParams, StepOutput
from .sampler import Sampler
from .scheduler import Request, Scheduler
from .spec import Speculator
from .store import PagedStore, PlainStore


class EngineObserver:
    """Hook points for probes (the verifier subclasses this; the engine never imports it).
    Tensors handed over are owned by the observer (copies), except `rows` which the engine
    never modifies afterwards."""

    def on_logits(self, request_id: str, start_pos: int, rows: torch.Tensor) -> None:
        """rows [n, V] fp32 for positions start_pos .. start_pos+n-1 (row p predicts p+1)."""

    def on_kda_state(self, request_id: str, num_tokens: int, layer: int, kda_state: KDAState) -> None:
        """The state of one KDA layer after the request consumed num_tokens tokens."""

    def on_finish(self, request_id: str, result: RequestResult, mla_rows: dict[int, torch.Tensor]) -> None:
        """The request's MLA cache rows [S, R] per layer at the end."""

    def on_step(self, step_index: int, scheduled: list[tuple[str, int]]) -> None:
        """What one step ran: (request_id, tokens computed)."""

    # Optional batched forms (an observer may define them; the engine falls back to the per-request
    # methods above when it does not): one call per step instead of one per request and layer, so a
    # device observer launches one reduction for every row (the capture's overhead on the GPU engine
    # was its ~B x layers x 4 launches a step, NOTES.md session 16).
    #   on_logits_rows(points [(request_id, position)], rows [n, V])   one row per point
    #   on_kda_states(points [(request_id, num_tokens)], layer, {name: [n, ...]})   stacked copies
    # And digests taken inside the fast decode step (and its CUDA graph), when every observer offers
    # one digester (engine/fast/step_digests.py; the calls above then skip that step's fast rows):
    #   step_digester(device) -> a digester or None
    #   on_step_words(layout [Entry], logits_points, state_points, words [len(layout), n, W])


def emit_logits_rows(obs, points: list[tuple[str, int]], rows: torch.Tensor) -> None:
    """rows[i] is the logits row of points[i] = (request_id, position): the observer's batched form
    where it has one, else one on_logits per row."""
    batched = getattr(obs, "on_logits_rows", None)
    if batched is not None:
        batched(points, rows)
        return
    for i, (rid, pos) in enumerate(points):
        obs.on_logits(rid, pos, rows[i:i + 1])


def emit_kda_states(obs, points: list[tuple[str, int]], layer: int, stacked: dict[str, torch.Tensor]) -> None:
    """stacked[name][i] is KDA layer `layer`'s tensor `name` of points[i] = (request_id, num_tokens):
    the observer's batched form where it has one, else one on_kda_state per request."""
    batched = getattr(obs, "on_kda_states", None)
    if batched is not None:
        batched(points, layer, stacked)
        return
    for i, (rid, n) in enumerate(points):
        obs.on_kda_state(rid, n, layer, KDAState(*(stacked[name][i] for name in KDA_TENSOR_NAMES)))


KDA_TENSOR_NAMES = ("recurrent", "conv_q", "conv_k", "conv_v")      # KDAState's fields, in order


class Engine:
    def __init__(self, model: K3Model, opts: EngineOptions | None = None,
                 observers: list[EngineObserver] | tuple[EngineObserver, ...] = ()):
        self.model = model
        self.opts = opts if opts is not None else EngineOptions()
        if not isinstance(self.opts, EngineOptions):
            raise K3Error(f"Engine: expected EngineOptions, got {type(self.opts).__name__}")
        self.observers = list(observers)
        # the KDA grid in force (kernels/kda/grid.py): calls cut and state reused only on it
        self.grid = grid_in_force(model.device, self.opts.kda_grid)
        if self.grid and self.opts.block_size % self.grid:
            raise K3Error(f"Engine: block_size {self.opts.block_size} is not a multiple of the KDA grid {self.grid}")
        # path events (optimized_stack/events.py): one counter set shared by every component
        self.events = Events()
        self.store = (PagedStore(model, self.opts, self.grid, self.events) if self.opts.paged
                      else PlainStore(model, self.opts, self.events))
        self.scheduler = Scheduler(self.opts, self.store, self.grid, self.events)
        self.metrics = EngineMetrics(cache_capacity_tokens=self.store.capacity_tokens())
        self.results: dict[str, RequestResult] = {}
        self.step_index = 0
        self._future: list[Request] = []                   # not yet arrived
        self._requests: dict[str, Request] = {}
        self._order = itertools.count()
        self._trie = PrefixTrie()
        self._eos = model.config.eos_token_id
        # speculative decoding (spec.py): drafts verified in the decode forward, KDA rolled back
        self.spec = Speculator(model, self.opts, self.events) if self.opts.speculative else None
        self._emitted: dict[Request, list[int]] = {}       # tokens a verification emitted this step
        # plain decode steps as one static-shape forward (engine/fast), greedy tokens sampled there
        self.fast = FastDecoder(model, self.store, self.opts) if self.opts.batched_decode else None
        digester = step_digester(self.observers, model.device) if self.fast is not None else None
        if digester is not None:          # the observers' digests of a fast step ride inside it
            self.fast.step.digests = StepDigests(digester, self.fast.step.kda, model.config.vocab_size)
        self._observed_in_step: set[Request] = set()      # this step's requests whose states came with the step
        self._sorted_form = self._sorted_experts_form()
        self._segment_forms = self._segment_mixers_forms()
        self._sampled: dict[Request, int] = {}

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_step: int = 0, sampler: Sampler | None = None) -> str:
        """sampler: the request's own token chooser (a server's, with its grammar and logprobs)
        in place of Sampler(params); one that sets takes_device_token False sees every row."""
        params = params if params is not None else SamplingParams()
        ids = [int(t) for t in prompt_ids]
        vocab = self.model.config.vocab_size
        if not ids:
            raise K3Error("add_request: expected at least one prompt token, got none")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise K3Error(f"add_request: expected token ids in 0..{vocab - 1}, got {bad[0]}")
        if not isinstance(arrival_step, int) or arrival_step < 0:
            raise K3Error(f"add_request: expected arrival_step >= 0, got {arrival_step!r}")
        order = next(self._order)
        rid = request_id if request_id is not None else f"req-{order}"
        if rid in self._requests:
            raise K3Error(f"add_request: request id {rid!r} is already in use")
        need = len(ids) + params.max_new_tokens - 1
        if isinstance(self.store, PagedStore) and not self.store.fits(need):
            raise K3Error(f"add_request: the request needs {need} tokens of MLA cache, the device "
                          f"pool holds {self.store.capacity_tokens()}")
        req = Request(rid, ids, params, arrival_step, order, sampler if sampler is not None else Sampler(params),
                      tokens=list(ids))
        self._requests[rid] = req
        self._future.append(req)
        return rid

    def abort_request(self, request_id: str) -> None:
        """End a request between steps (its client went away, its grammar is complete): it frees
        its slot and blocks and is finished with reason "abort". Unknown or finished ids: no-op."""
        req = self._requests.get(request_id)
        if req is None or req.status == "finished":
            return
        if req in self._future:
            self._future.remove(req)
            req.status = "finished"
        elif req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
            req.status = "finished"
            if req.swapped:                       # its state waits on the host: drop it
                self.store.swap.pop(req.request_id, None)
        else:                                     # running: its state is whole between steps
            req.finish_reason = "abort"
            self._finish(req)
        req.draft = []

    def forget(self, request_id: str) -> RequestResult | None:
        """Drop a finished request's bookkeeping (a long-lived server would keep every one) and
        hand back its result."""
        req = self._requests.get(request_id)
        if req is not None and req.status != "finished":
            raise K3Error(f"forget: request {request_id!r} is still {req.status}")
        self._requests.pop(request_id, None)
        return self.results.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._future or self.scheduler.waiting or self.scheduler.running)

    # ---- stepping ---------------------------------------------------------------------
    def run(self, max_steps: int | None = None) -> dict[str, RequestResult]:
        n = 0
        while self.has_unfinished():
            if max_steps is not None and n >= max_steps:
                raise K3Error(f"run: requests still unfinished after max_steps={max_steps}")
            self.step()
            n += 1
        return dict(self.results)

    def step(self) -> list[StepOutput]:
        sched = self.scheduler
        if not sched.waiting and not sched.running and self._future:
            # idle: jump the clock to the next arrival instead of simulating empty steps
            self.step_index = max(self.step_index, min(r.arrival_step for r in self._future))
        for req in [r for r in self._future if r.arrival_step <= self.step_index]:
            self._future.remove(req)
            sched.enqueue(req)
        if self.spec is not None:
            self.spec.propose(sched.running + sched.waiting)
        plan = sched.schedule()
        self._count_admissions(plan)
        for obs in self.observers:
            obs.on_step(self.step_index, [(r.request_id, n) for r, n in plan])
        last_rows = self._run_plan(plan)
        emitted = [self._take_step_token(req, last_rows[req]) for req, _ in plan]
        if self.observers and plan:
            self._observe_kda_states([req for req, _ in plan])
        outputs = [self._step_output(req, n, e) for (req, n), e in zip(plan, emitted)]
        self.metrics.steps += 1
        self.metrics.preemptions = sched.preemptions
        if isinstance(self.store, PagedStore):
            self.metrics.evictions = self.store.evictions
            self.metrics.restores = self.store.restores
            self.metrics.checkpoints_saved = self.store.checkpoints_saved
            self.metrics.swap_ins = self.store.swap_ins
        self.step_index += 1
        return outputs

    def _count_admissions(self, plan: list[tuple[Request, int]]) -> None:
        for req, _ in plan:
            if req.admitted_once:
                continue
            req.admitted_once = True
            m = self.metrics
            m.prompt_tokens += len(req.prompt)
            m.reusable_tokens += min(self._trie.longest_prefix(req.prompt), len(req.prompt) - 1)
            m.prefix_hit_tokens += req.num_computed
            self._trie.insert(req.prompt)

    def _run_plan(self, plan: list[tuple[Request, int]]) -> dict[Request, torch.Tensor]:
        last: dict[Request, torch.Tensor] = {}
        if self.fast is not None:            # plain decodes in one batched forward, the rest below
            decodes, plan = self.fast.split(plan)
            if decodes:
                last = self._run_fast(decodes)
        pieces: dict[Request, list[tuple[int, int]]] = {}
        for req, n in plan:
            start, end = req.num_computed, req.num_computed + n
            assert not req.draft or n == 1 + len(req.draft), "a verification runs 1 + drafts tokens"
            # a verification never stops at a checkpoint: its tokens are not accepted yet
            split = isinstance(self.store, PagedStore) and not req.draft
            cuts = [start] + (self.store.split_points(req, start, end) if split else []) + [end]
            pieces[req] = list(zip(cuts[:-1], cuts[1:]))
            if self.grid and not req.draft:     # every call on the KDA grid (a verification is < grid)
                pieces[req] = [q for a, b in pieces[req] for q in grid_pieces(a, b, len(req.prompt), self.grid)]
            fault = ("mut_chunk_aligned_resets_conv" if start % self.opts.block_size == 0
                     else "mut_chunk_resets_conv")
            if fault in self.opts.faults and start > 0 and n > 1 and start < len(req.prompt):
                self.store.zero_conv(req)
        rounds = max((len(p) for p in pieces.values()), default=0)
        for r in range(rounds):
            batch = [(req, p[r]) for req, p in pieces.items() if r < len(p)]
            if len(batch) > 1:
                self.events.fire("batched_forward")
            states = [self.store.state_for(req) for req, _ in batch]
            ids = [torch.tensor((req.tokens + req.draft)[a:b], dtype=torch.long) for req, (a, b) in batch]
            recording = (self.spec.recording([(req, st) for (req, _), st in zip(batch, states)])
                         if self.spec is not None else contextlib.nullcontext({}))
            # the draft model reads the final-norm rows of this very forward (no second forward)
            watching = (self.spec.watching([(req, a, b) for req, (a, b) in batch])
                        if self.spec is not None else contextlib.nullcontext())
            plain = len(batch) > 1 and "mut_batch_plain_linear" in self.opts.faults
            # the segment mixers first: speculation's recording turns the KDA one off inside it
            with self._segment_mixers(), recording as records, watching, (
                    ops.override(linear=ops.plain_linear) if plain else contextlib.nullcontext()), \
                    self._sorted_experts():
                outs = self.model.forward_batch(list(zip(ids, states)))
            for (req, (a, b)), st, rows in zip(batch, states, outs):
                self.metrics.tokens_computed += b - a
                if req in records:
                    rows, b = self._verify(req, st, rows, records[req], a)
                self.store.commit(req, st, a, b)
                self.metrics.tokens_recomputed += max(0, min(b, req.max_computed) - a)
                req.max_computed = max(req.max_computed, b)
                for obs in self.observers:
                    obs.on_logits(req.request_id, a, rows)
                last[req] = rows[-1]
                if req.skip_generated and req.num_computed >= len(req.prompt):
                    req.num_computed = len(req.tokens) - 1          # the seeded fault's jump
                    req.skip_generated = False
        return last

    def _sorted_experts_form(self):
        """Option prefill_sorted_experts: the experts op for the forwards outside the batched decode
        step, one host sync per layer (kernels/moe/sorted.py, bit-identical to MoE.routed), counting
        its calls; None with the option off. With fused_situ its activation is the fused kernel on
        CUDA (kernels/moe/situ_form.py), counting the rows it took. Built once per engine."""
        if not self.opts.prefill_sorted_experts:
            return None
        from ..kernels.moe import sorted as sorted_experts
        from ..kernels.moe.situ_form import fire_situ_events, situ_form
        form = (sorted_experts.routed_sorted_weights_unsorted
                if "mut_sorted_experts_weights_unsorted" in self.opts.faults else sorted_experts.routed_sorted)
        events, config = self.events, self.model.config
        act = (situ_form(self.opts.faults, lambda rows: fire_situ_events(events, rows, config))
               if self.opts.fused_situ else None)

        def experts(moe, h, idx, w):
            events.fire("prefill_sorted_experts")
            return form(moe, h, idx, w, _situ=act)
        return experts

    def _segment_mixers_forms(self) -> dict | None:
        """Option prefill_batched_mixers: each KDA and MLA layer of a forward over several segments
        runs their token-wise work on all rows at once (kernels/kda/segments.py, kernels/mla/segments.py;
        bit-identical to one call per segment), counting the segments it took; None with it off."""
        if not self.opts.prefill_batched_mixers:
            return None
        import functools

        from ..kernels.kda.segments import kda_segments
        from ..kernels.mla.segments import mla_segments
        kda = (functools.partial(kda_segments, _windows_from_next=True)
               if "mut_batched_mixers_window_from_next" in self.opts.faults else kda_segments)
        events = self.events

        def counted(form):
            def over_segments(attn, layer_index, x, bounds, states):
                events.fire("prefill_batched_mixers", len(bounds))
                return form(attn, layer_index, x, bounds, states)
            return over_segments
        return {"kda_segments": counted(kda), "mla_segments": counted(mla_segments)}

    def _segment_mixers(self) -> contextlib.AbstractContextManager:
        """The segment mixers in the op table for one forward, where their slots are empty."""
        if self._segment_forms is None:
            return contextlib.nullcontext()
        return ops.override(**{k: v for k, v in self._segment_forms.items() if getattr(ops.OPS, k) is None})

    def _sorted_experts(self) -> contextlib.AbstractContextManager:
        """The sorted experts in the op table for one forward, unless a toggle's own experts hold the
        slot (grouped, FP8, a mutant): they are what that run judges."""
        if self._sorted_form is None or ops.OPS.moe_experts is not None:
            return contextlib.nullcontext()
        return ops.override(moe_experts=self._sorted_form)

    def _run_fast(self, plan: list[tuple[Request, int]]) -> dict[Request, torch.Tensor]:
        """A step of plain decodes through engine/fast: the step wrote rows and state into the
        pools; here the same bookkeeping as the loop above, per request."""
        assert self.fast is not None
        out = self.fast.run(plan, keep_rows=bool(self.observers))
        rows, tokens = out.rows, out.tokens
        last: dict[Request, torch.Tensor] = {}
        points: list[tuple[str, int]] = []                  # (request, position) of each row
        for i, (req, _) in enumerate(plan):
            a = req.num_computed
            points.append((req.request_id, a))
            self.metrics.tokens_computed += 1
            self.store.commit_written(req, a + 1)
            self.metrics.tokens_recomputed += max(0, min(a + 1, req.max_computed) - a)
            req.max_computed = max(req.max_computed, a + 1)
            last[req] = rows[i]
            if tokens[i] is not None:
                self._sampled[req] = tokens[i]
        if self.observers and out.words is not None:   # digested inside the step: rows and states
            layout = self.fast.step.digests.layout             # words come only while the digests hold
            states = [(rid, pos + 1) for rid, pos in points]        # the state after the row's token
            for obs in self.observers:
                obs.on_step_words(layout, points, states, out.words)
            self._observed_in_step.update(req for req, _ in plan)
        elif self.observers:                        # the step's rows were computed together: one call
            for obs in self.observers:
                emit_logits_rows(obs, points, rows[:len(plan)])
        return last

    def _verify(self, req: Request, st, rows: torch.Tensor, record, start: int) -> tuple[torch.Tensor, int]:
        """Greedy acceptance of req.draft; the emitted tokens are appended (before the commit,
        which hashes req.tokens for the prefix cache) and the KDA state rolled back to the
        verified tokens kept. Returns the logits rows of the kept positions and the new end."""
        assert self.spec is not None
        kept = self._take_tokens(req, self.spec.accept(req, rows))
        self.spec.rollback(req, st, record, kept)
        self._emitted[req] = req.tokens[-kept:]
        req.draft = []
        return rows[:kept], start + kept

    def _take_tokens(self, req: Request, tokens: list[int]) -> int:
        """Append tokens until one finishes the request; returns how many were appended."""
        p = req.params
        for i, tok in enumerate(tokens):
            req.tokens.append(tok)
            self.metrics.generated_tokens += 1
            if tok in p.stop_ids or (not p.ignore_eos and tok == self._eos):
                req.finish_reason = "stop"
            elif len(req.generated) >= p.max_new_tokens:
                req.finish_reason = "length"
            if req.finish_reason is not None:
                return i + 1
        return len(tokens)

    def _take_step_token(self, req: Request, last_row: torch.Tensor) -> tuple[int, ...] | None:
        """The tokens the step emitted for req (speculation's kept tokens, or the one sampled), now
        in req.tokens; None when it emitted none (a prefill chunk short of the prompt's end)."""
        emitted = self._emitted.pop(req, None)
        if emitted is not None:
            return tuple(emitted)
        if req.num_computed == len(req.tokens):
            new_token = self._sampled.pop(req, None)           # greedy, sampled by the fast step
            if new_token is None:
                new_token = req.sampler.sample(last_row)
            self._take_tokens(req, [new_token])
            return (new_token,)
        return None

    def _observe_kda_states(self, reqs: list[Request]) -> None:
        """Every stepped request's KDA state, after its tokens were taken and before any finishes:
        per layer and tensor one stacked copy of all requests' rows (one launch, not one per request;
        the paged store gathers them from its pool by slot, no per-request views)."""
        reqs = [req for req in reqs if req not in self._observed_in_step]
        self._observed_in_step.clear()
        if not reqs:
            return
        points = [(req.request_id, req.num_computed) for req in reqs]
        for layer, stacked in self.store.kda_states_stacked(reqs).items():
            for obs in self.observers:
                emit_kda_states(obs, points, layer, stacked)

    def _step_output(self, req: Request, n: int, emitted: tuple[int, ...] | None) -> StepOutput:
        done = req.finish_reason is not None
        if done:
            self._finish(req)
        return StepOutput(req.request_id, n, req.num_computed, emitted[-1] if emitted else None, done,
                          req.finish_reason, emitted or ())

    def _finish(self, req: Request) -> None:
        assert req.finish_reason is not None
        result = RequestResult(list(req.prompt), list(req.generated), req.finish_reason)
        self.results[req.request_id] = result
        if self.observers:
            rows = self.store.mla_rows(req)          # copies already (PagedStore's gather, PlainStore's clone)
            for obs in self.observers:
                obs.on_finish(req.request_id, result, rows)
        self._trie.insert(req.tokens[:req.num_computed])
        self.store.finish(req)
        self.scheduler.finish(req)
        self.metrics.requests_finished += 1
