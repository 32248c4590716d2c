"""What the engine benchmark (fast_bench.py) needs besides timing: engines whose requests already hold
a context of L tokens, and the HBM roofline of a decode step.

Decode cells start from real state copied, not recomputed: one request of L tokens is prefilled
once on the reference path (`Donor`), and every request of a cell gets a copy of its KDA state
and MLA rows (and their projection, for the projected K/V cache) in its own slot and blocks.
Distinct copies, so a step reads B contexts from HBM as a real batch does; the values are real
activations, so logits stay finite. This times decode, not reference bits: which rows are right
is the contract check's business (fast_bench.py), on real prefills.

The roofline is gpu_bench.py's (decode_step_bytes over hbm_copy_bandwidth, re-exported here):
the bytes a decode step must touch at least once over the bandwidth of a device-to-device copy
measured in the same run.

Shape letters: B requests, L context tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from optimized_stack.config import KDA, MLA
from optimized_stack.engine.engine import Engine
from optimized_stack.engine.options import EngineOptions, SamplingParams
from optimized_stack.engine.store import PagedStore

from .gpu_bench import decode_step_bytes, hbm_copy_bandwidth, sync  # noqa: F401  (re-exported)


@dataclass
class Donor:
    """One request of `context` tokens prefilled on the reference path: its state, the projected
    K/V of its rows per MLA layer, and the greedy token after it."""

    ids: list[int]
    state: object
    kv: dict[int, torch.Tensor]
    first_token: int

    @classmethod
    def prefill(cls, model, context: int, seed: int = 7) -> "Donor":
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (context,), generator=gen).tolist()
        st = model.new_state()
        logits = model.forward(torch.tensor(ids, device=model.device), st)
        kv = {i: model.model.layers[i].self_attn.project(rows) for i, rows in st.mla.items()}
        return cls(ids, st, kv, int(logits[-1].argmax()))


def cache_tokens_for(batch: int, context: int, new_tokens: int, block_size: int = 64) -> int:
    """An MLA pool that holds B requests of context + new tokens (whole blocks each)."""
    per = -(-(context + new_tokens) // block_size) * block_size
    return batch * per


def seeded_engine(model, opts: EngineOptions, donor: Donor, batch: int, new_tokens: int,
                  observers: tuple = ()) -> Engine:
    """An engine whose `batch` requests (at most what it runs at once) each hold a copy of the
    donor's context and its first token, so the next step is a plain decode step. `observers`
    (EngineObserver) see its steps, as a verifier's capture does."""
    eng = Engine(model, opts, observers)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for b in range(batch):
        eng.add_request(donor.ids, params, request_id=f"d{b}")
    sched = eng.scheduler
    for req in list(eng._future):                       # admit without computing the prompt
        eng._future.remove(req)
        sched.enqueue(req)
    plan = sched.schedule()
    context = len(donor.ids)
    if len(plan) != batch:
        # the scheduler admits what the token budget holds; the rest would be prefilled by the timed
        # steps (capture_bench, 2026-12-07: at B = 64 with a budget of 256, four 512-token prompts a
        # step, a 259 ms "decode" step where the decode alone is ~8 ms)
        raise ValueError(f"seeded_engine: the scheduler placed {len(plan)} of {batch} requests (token_budget "
                         f"{opts.token_budget}, max_num_seqs {opts.max_num_seqs}, {context}-token prompts): "
                         f"give a budget of at least batch x context")
    for req, _ in plan:
        req.admitted_once = True
        if isinstance(eng.store, PagedStore):
            store = eng.store
            store.mla.write(req.blocks, 0, {i: donor.state.mla[i] for i in store.mla_layers})
            if store.mla.kv is not None:
                store.mla.write(req.blocks, 0, {i: donor.kv[i] for i in store.mla_layers}, kv=True)
            store.pool.load(req.slot, donor.state.kda)
            store.commit_written(req, context)
        else:
            req.state = donor.state.clone()
            if opts.projected_kv_cache:
                req.state.mla_kv = {i: t.clone() for i, t in donor.kv.items()}
            req.num_computed = context
        req.tokens.append(donor.first_token)
    sync()
    return eng


def layer_counts(model) -> dict[str, int]:
    kinds = model.config.layer_kinds
    return {"kda": sum(k == KDA for k in kinds), "mla": sum(k == MLA for k in kinds)}
