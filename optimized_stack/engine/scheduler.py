"""Requests and the step scheduler (FCFS admission, token budget, LIFO preemption).

A request's pending tokens are tokens[num_computed:]: the prompt while prefilling, then
exactly one token (the last sampled) per decode step; after a recompute preemption the
whole prompt + generated sequence is pending again. So prefill, decode and resume are one
thing: run the next chunk of pending tokens; when none are left, sample.

Per step: running decodes first, then running prefills (oldest start first), then
admission from the waiting queue in arrival order (no overtaking) while slots, pages and
budget last. Without chunked prefill a prompt always runs whole (the budget only stops
admission); with it, prefill chunks are cut to the budget left. Without continuous
batching one request runs at a time. When a running request cannot get the MLA pages it
needs, the most recently started running request is preempted (possibly itself).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..events import Events
from ..kernels.kda.grid import grid_end
from ..model.model import RequestState
from .options import EngineOptions, SamplingParams
from .sampler import Sampler


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_step: int
    order: int
    sampler: Sampler
    tokens: list[int] = field(default_factory=list)     # prompt + generated
    num_computed: int = 0                               # tokens in the state
    max_computed: int = 0                               # high-water mark (recompute metric)
    status: str = "waiting"                             # waiting | running | finished
    start_seq: int = -1
    admitted_once: bool = False
    finish_reason: str | None = None
    # storage (one of the stores below fills these)
    state: RequestState | None = None                   # plain store
    slot: int | None = None                             # paged store: KDA slot
    blocks: list[int] = field(default_factory=list)     # paged store: block table
    hashes: list[bytes] = field(default_factory=list)   # prefix hash chain of full blocks
    registered: int = 0                                 # leading blocks already hittable
    swapped: bool = False
    skip_generated: bool = False                        # seeded fault, see options.FAULTS
    draft: list[int] = field(default_factory=list)      # speculative drafts to verify this step (spec.py)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def pending(self) -> int:
        if self.skip_generated:                          # fault: stop at the prompt's end
            return max(len(self.prompt) - self.num_computed, 0) or 1
        return len(self.tokens) - self.num_computed

    def sort_key(self) -> tuple[int, int]:
        return self.arrival_step, self.order


class Store(Protocol):
    def admit(self, req: Request) -> bool: ...
    def ensure(self, req: Request, num_rows: int) -> bool: ...
    def preempt(self, req: Request) -> None: ...


class Scheduler:
    def __init__(self, opts: EngineOptions, store: Store, grid: int | None = None,
                 events: Events | None = None):
        self.opts = opts
        self.events = events if events is not None else Events()
        self.store = store
        self.grid = grid                                 # KDA grid (kernels/kda/grid.py) or None
        self.waiting: list[Request] = []                 # arrived, sorted by arrival
        self.running: list[Request] = []
        self.max_running = opts.max_num_seqs if opts.continuous_batching else 1
        self.preemptions = 0
        self._start_seq = 0

    def enqueue(self, req: Request) -> None:
        req.status = "waiting"
        self.waiting.append(req)
        self.waiting.sort(key=Request.sort_key)

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        req.status = "finished"

    def schedule(self) -> list[tuple[Request, int]]:
        plan: dict[Request, int] = {}
        preempted_now = False

        def budget() -> int:
            return self.opts.token_budget - sum(plan.values())

        def place(req: Request) -> None:
            nonlocal preempted_now
            n = self._chunk(req, budget())
            if n <= 0:
                return
            while not self.store.ensure(req, req.num_computed + n):
                victim = max(self.running, key=lambda r: r.start_seq)
                self._preempt(victim)
                plan.pop(victim, None)
                preempted_now = True
                if victim is req:
                    return
            plan[req] = n
            if req.num_computed < len(req.prompt) and n < req.pending:     # a prefill cut short
                grid = "on" if (req.num_computed + n) % self.opts.block_size == 0 else "off"
                self.events.fire(f"chunk_cut_{grid}_grid")

        for req in sorted(self.running, key=lambda r: (r.pending > 1, r.start_seq)):
            if req.status == "running":
                place(req)
        while (self.waiting and not preempted_now and len(self.running) < self.max_running
               and (budget() > 0 or not plan)):
            req = self.waiting[0]
            if not self.store.admit(req):
                break
            self.waiting.pop(0)
            req.status = "running"
            req.start_seq = self._start_seq
            self._start_seq += 1
            self.running.append(req)
            place(req)
        return list(plan.items())

    def _chunk(self, req: Request, budget: int) -> int:
        pending = req.pending
        if pending == 1 and req.draft:
            # a decode verifies its speculative drafts in the same forward, as far as the budget goes
            req.draft = req.draft[:max(budget - 1, 0)]
            return 1 + len(req.draft) if budget > 0 else 0
        if pending <= 1 or not self.opts.chunked_prefill:
            # decodes need budget; a whole (unchunked) prompt runs even past the budget
            return pending if (pending > 1 or budget > 0) else 0
        n = min(pending, budget)
        if self.grid and n > 0:
            # a chunk stops on the KDA grid; below one grid step of budget it overruns to one step
            start, prompt = req.num_computed, len(req.prompt)
            stop = grid_end(start, start + n, prompt, self.grid)
            if stop == start:
                stop = grid_end(start, start + min(pending, self.grid), prompt, self.grid)
            n = stop - start
        return n

    def _preempt(self, req: Request) -> None:
        self.events.fire("preempt_swap" if self.opts.preempt_mode == "swap" else "preempt_recompute")
        if self.opts.preempt_mode != "swap" and req.generated:
            self.events.fire("preempt_recompute_generated")
        if req.params.temperature > 0:
            self.events.fire("preempt_sampled")
        self.running.remove(req)
        self.store.preempt(req)
        self.preemptions += 1
        self.enqueue(req)
