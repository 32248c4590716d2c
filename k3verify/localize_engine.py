"""Localise an engine fault to where it entered: the first computation of the candidate engine,
in its own execution order, that leaves the reference.

localize.py replays one request through the model; an engine fault (a restored checkpoint, a
cache block, a rollback, a batched GEMM, a sampler) does not live in the model, so that replay
shows nothing and the state check alone named the first KDA state that differed: an MLA cache
fault read as "kda/conv", a GEMM fault as "kda/recurrent". Here the scenario runs once more
through the candidate engine with a trace attached, and every computation the engine made for a
request is re-done on the reference path, from the reference's own state at the same token:

  a forward segment (a prompt piece, a decode, a verification of drafts) and
  a row of the batched decode step (engine/fast, which has no sublayer probes).

The reference state at any token is exact whatever the cut (the reference is row-stable on the
CPU and cut on the 64-token grid on CUDA, as the engine is), so each engine computation has one
right answer. Per computation, in order, the first thing that differs names the component:

  1. a token it was fed that is not the reference's     -> engine/spec when a verification
     emitted it, engine/sampler otherwise (the engine step and request where the streams part);
  2. the state it started from, layer by layer in execution order, a KDA layer's recurrent
     state before its conv window (a checkpoint taken a token late differs in both)
                                                         -> kda/recurrent, kda/conv, mla/cache;
     and the cache rows before its first token as it left them (it only reads those: a step
     that rewrote one is a cache fault, even where its own attention read the bad row)
                                                         -> mla/cache;
  3. a sublayer output (segments only), in execution order: with equal inputs and state, a
     different op-table slot than the reference's        -> ops/<slot>; an MLA mixer over an
     equal latent cache                                  -> mla/attention; else the sublayer's
     component (localize.component);
  4. its logits row (batched decode rows)                -> engine/graphs when the step replayed
     a CUDA graph, else engine/fast_step;
  5. the state it left (KDA per layer, MLA latent rows)  -> as in 2.

Equality is by hash (bits). Cost: one more engine run and one reference forward per engine
computation, on failures only.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from k3verify.compare.tensors import hash_tensor
from optimized_stack import toggles as toggle_registry
from optimized_stack.kernels.kda.grid import grid_in_force, grid_pieces
from optimized_stack.model.ops import OPS


@dataclass
class _Computation:
    """One engine computation for one request, with the hashes needed to judge it."""

    seq: int                       # execution order across requests
    rid: str
    step: int                      # engine step index
    kind: str                      # "segment" | "fast"
    start: int                     # first token position it computes
    ids: list[int]
    nondraft: int                  # ids[:nondraft] are accepted tokens; the rest drafts
    pre: dict[tuple[int, str], str] = field(default_factory=dict)
    rows: dict[tuple[int, str], str] = field(default_factory=dict)
    order: list[tuple[int, str]] = field(default_factory=list)
    ops: dict[str, str] = field(default_factory=dict)
    logits: str | None = None
    kept_rows: int = 0             # logits rows the engine kept (a verification keeps the accepted)
    post: dict[tuple[int, str], str] = field(default_factory=dict)
    post_at: int | None = None
    cached_after: dict[tuple[int, str], str] = field(default_factory=dict)   # MLA rows [0, start) after it
    graph_replayed: bool = False


# the op slots that run a layer's mixer over several segments at once (prefill_batched_mixers): they can
# only have made a differing "mixer" row of their own layer kind, and only where a forward had several
# segments; a fault elsewhere is not theirs to take the blame for
_SEGMENT_SLOTS = {"kda_segments": "mixer", "mla_segments": "mixer"}
_SEGMENT_KINDS = {"kda_segments": "kda", "mla_segments": "mla"}


def blamed_slots(model, ops: dict[str, str], ref_ops: dict[str, str], layer: int, name: str) -> list[str]:
    """The op slots a computation ran off the reference that could have made sublayer `name` of
    `layer` differ, in the op table's order (the first is named as where the fault lives)."""
    return [s for s in ref_ops if ops.get(s) != ref_ops[s] and _SEGMENT_SLOTS.get(s, name) == name
            and (s not in _SEGMENT_KINDS or model.config.layer_kinds[layer] == _SEGMENT_KINDS[s])]


def _op_names() -> dict[str, str]:
    """The op table's implementation per slot, by qualified name (None: the model's own code)."""
    out = {}
    for f in fields(OPS):
        fn = getattr(OPS, f.name)
        base = getattr(fn, "func", fn)                          # functools.partial
        out[f.name] = "reference" if fn is None else f"{getattr(base, '__module__', '?')}.{getattr(base, '__qualname__', repr(base))}"
    return out


def _state_hashes(model, st, upto: int) -> dict[tuple[int, str], str]:
    """Per layer, in execution order: KDA recurrent then conv windows; MLA latent rows [0, upto)."""
    out: dict[tuple[int, str], str] = {}
    for layer in range(model.config.num_layers):
        if layer in st.kda:
            for name, t in st.kda[layer].tensors().items():     # recurrent first, then conv_q/k/v
                out[(layer, name)] = hash_tensor(t)
        elif layer in st.mla:
            out[(layer, "mla_rows")] = hash_tensor(st.mla[layer][:upto])
    return out


def _mla_post(rows: dict[int, torch.Tensor], upto: int) -> dict[tuple[int, str], str]:
    return {(layer, "mla_rows"): hash_tensor(t[:upto]) for layer, t in rows.items()}


class _Trace:
    """Observer + model probes on the candidate engine: one _Computation per engine computation."""

    def __init__(self, model):
        self.model = model
        self.engine = None
        self.done: list[_Computation] = []
        self._pending: list[_Computation] = []      # the current forward_batch's segments
        self._req_of_state: dict[int, Any] = {}
        self._bounds: list[tuple[int, int]] = []
        self._seq = 0
        self._step = 0
        self._step_len: dict[str, int] = {}
        self._step_replays = 0
        # rid -> position -> (who emitted it: "spec" | "sampler", the engine step, the token)
        self.emitted_by: dict[str, dict[int, tuple[str, int, int]]] = {}
        self._verified: set[str] = set()

    # -- engine wiring
    def attach(self, engine) -> None:
        self.engine = engine
        inner = engine.store.state_for

        def state_for(req):
            st = inner(req)
            self._req_of_state[id(st)] = req
            return st
        engine.store.state_for = state_for

    def _replays(self) -> int:
        return int(dict(self.engine.events).get("graph_replay", 0)) if self.engine is not None else 0

    def on_step(self, step_index: int, scheduled) -> None:
        self._close_step()
        self._step = step_index
        self._step_replays = self._replays()
        reqs = self.engine._requests
        self._step_len = {rid: len(reqs[rid].tokens) for rid, _ in scheduled}
        self._verified = set()

    def _close_step(self) -> None:
        """Tokens the last step appended: by a verification (spec) or by the sampler."""
        if self.engine is None:
            return
        for rid, before in self._step_len.items():
            req = self.engine._requests[rid]
            kind = "spec" if rid in self._verified else "sampler"
            for p in range(before, len(req.tokens)):
                self.emitted_by.setdefault(rid, {}).setdefault(p, (kind, self._step, int(req.tokens[p])))

    # -- model probes
    def on_segments(self, segments) -> None:
        self._pending, self._bounds, a = [], [], 0
        reqs = [self._req_of_state.get(id(st)) for _, st in segments]
        if any(r is None for r in reqs):        # not an engine step (e.g. a reference replay)
            return
        ops = _op_names()
        if len(segments) == 1:                  # the mixers over several segments were not called
            ops = {**ops, **{slot: "reference" for slot in _SEGMENT_SLOTS}}
        for (ids, st), req in zip(segments, reqs):
            rid = req.request_id
            start = st.num_tokens
            nondraft = max(0, min(len(ids), len(req.tokens) - start))
            if nondraft < len(ids):
                self._verified.add(rid)
            c = _Computation(self._next(), rid, self._step, "segment", start, [int(t) for t in ids.tolist()],
                             nondraft, pre=_state_hashes(self.model, st, start), ops=ops)
            self._pending.append(c)
            self._bounds.append((a, a + len(ids)))
            a += len(ids)

    def on_probe(self, layer: int, name: str, t: torch.Tensor) -> None:
        for c, (a, b) in zip(self._pending, self._bounds):
            c.order.append((layer, name))
            c.rows[(layer, name)] = hash_tensor(t[a:b])

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    # -- engine observer
    def on_request(self, *_a) -> None:
        pass

    def on_logits(self, rid: str, start: int, rows: torch.Tensor) -> None:
        if self._pending:                       # the forward_batch segments, in batch order
            c = self._pending.pop(0)
            c.rid, c.logits, c.kept_rows = rid, hash_tensor(rows), rows.shape[0]
            self.done.append(c)
            if not self._pending:
                self._bounds = []
            return
        req = self.engine._requests[rid]        # a row of the batched decode step
        c = _Computation(self._next(), rid, self._step, "fast", start, [int(req.tokens[start])], 1,
                         logits=hash_tensor(rows), kept_rows=rows.shape[0],
                         graph_replayed=self._replays() > self._step_replays)
        self.done.append(c)

    def on_kda_state(self, rid: str, num_tokens: int, layer: int, kst) -> None:
        last = next((c for c in reversed(self.done) if c.rid == rid), None)
        if last is None:
            return
        if last.post_at != num_tokens:
            last.post, last.post_at = {}, num_tokens
            req = self.engine._requests[rid]
            rows = self.engine.store.mla_rows(req)
            last.post.update(_mla_post(rows, num_tokens))
            last.cached_after = _mla_post(rows, last.start)
        for name, t in kst.tensors().items():
            last.post[(layer, name)] = hash_tensor(t)

    def on_finish(self, *_a) -> None:
        pass

    def finish(self) -> None:
        self._close_step()


class _RowProbe:
    """The trace's sublayer probe; it leaves the batched decode step on (engine/fast runs its
    rows without probes, and the trace judges those rows by their logits and states)."""

    fast_path_ok = True

    def __init__(self, trace: _Trace):
        self.trace = trace

    def __call__(self, layer: int, name: str, t: torch.Tensor) -> None:
        self.trace.on_probe(layer, name, t)


class _ReferenceWalk:
    """The reference state of one request at any token of its reference sequence (cached)."""

    def __init__(self, model, seq: list[int], prompt_len: int):
        self.model, self.seq, self.prompt_len = model, seq, prompt_len
        self.grid = grid_in_force(model.device)
        self._states = {0: model.new_state()}

    def put(self, s: int, st) -> None:
        """A state at token s computed on the reference path elsewhere (a judged computation's
        forward over the reference's own tokens): saves walking there again."""
        self._states.setdefault(s, st.clone())

    def state_at(self, s: int):
        if s not in self._states:
            c = max(k for k in self._states if k <= s)
            st = self._states[c].clone()
            pieces = grid_pieces(c, s, self.prompt_len, self.grid) if self.grid else [(c, s)]
            for a, b in pieces:
                self.model.forward(torch.tensor(self.seq[a:b], dtype=torch.long), st)
            self._states[s] = st
        return self._states[s].clone()


def _state_component(layer: int, name: str) -> str:
    return "mla/cache" if name == "mla_rows" else ("kda/recurrent" if name == "recurrent" else "kda/conv")


def _first_state_diff(cand: dict, ref: dict) -> tuple[int, str] | None:
    for key in ref:                              # ref's insertion order is execution order
        if key in cand and cand[key] != ref[key]:
            return key
    return None


def localize_engine(model, toggle_name: str, scenario, ref_capture) -> dict[str, Any] | None:
    """Run `scenario` through the candidate engine with the trace and return the first engine
    computation that leaves the reference, or None when every computation agrees."""
    from k3verify.localize import component
    from k3verify.run.sequential import run_scenario

    trace = _Trace(model)
    with model.segment_probe(trace.on_segments), model.probe(_RowProbe(trace)):
        run_scenario(model, scenario, (toggle_name,), observers=[trace])
    trace.finish()
    specs = {r.request_id: r for r in scenario.requests}
    walks: dict[str, _ReferenceWalk] = {}
    ref_ops = _op_names()
    with toggle_registry.applied([]):
        for c in trace.done:
            if c.rid not in specs or c.rid not in ref_capture.requests:
                continue
            spec = specs[c.rid]
            seq = list(spec.prompt_ids) + list(ref_capture.requests[c.rid].tokens)
            walk = walks.setdefault(c.rid, _ReferenceWalk(model, seq, len(spec.prompt_ids)))
            found = _judge(model, c, walk, seq, ref_ops, trace.emitted_by.get(c.rid, {}), component)
            if found is not None:
                return {"request": c.rid, "engine_step": c.step, "computation": c.kind,
                        "tokens": [c.start, c.start + len(c.ids)], "replay": "engine trace", **found}
    return None


def _judge(model, c: _Computation, walk: _ReferenceWalk, seq: list[int], ref_ops: dict, emitted: dict,
           component) -> dict[str, Any] | None:
    # 1. the tokens it was fed
    for i, tok in enumerate(c.ids[:c.nondraft]):
        p = c.start + i
        if p >= len(seq) or tok != seq[p]:
            by = emitted.get(p, ("sampler",))[0]
            return {"component": f"engine/{by}", "layer": None, "sublayer": None, "first_position": p,
                    "reason": f"the token streams part at position {p}: fed {tok}, the reference has "
                              f"{seq[p] if p < len(seq) else 'no token'} (emitted by the {by})"}
    st = walk.state_at(c.start)
    # 2. the state it started from (segments; a fast row's start state is the previous post state)
    if c.kind == "segment":
        key = _first_state_diff(c.pre, _state_hashes(model, st, c.start))
        if key is not None:
            return _state_found(key, c.start, "the state this computation started from")
    # 2b. the cache rows it found must be the rows it leaves: a computation that rewrote a cached
    # row (one it only reads) is a cache fault, even where its own attention then read the bad row
    key = _first_state_diff(c.cached_after, _mla_post(st.mla, c.start))
    if key is not None:
        return {**_state_found(key, c.start, ""),
                "reason": f"layer {key[0]}: a cached row before token {c.start} was rewritten by this "
                          f"computation, which only reads them"}
    # 3. sublayer outputs, 4. logits
    rec: dict[tuple[int, str], str] = {}
    order: list[tuple[int, str]] = []

    def probe(layer, name, t):
        order.append((layer, name))
        rec[(layer, name)] = hash_tensor(t)
    ids = torch.tensor(c.ids, dtype=torch.long)
    with model.probe(probe):
        logits = model.forward(ids, st)
    if c.nondraft == len(c.ids) and c.ids == seq[c.start:c.start + len(c.ids)]:
        walk.put(c.start + len(c.ids), st)
    if c.kind == "segment":
        for key in order:
            if key in c.rows and c.rows[key] != rec[key]:
                layer, name = key
                slots = blamed_slots(model, c.ops, ref_ops, layer, name)
                where = component(model, layer, name)
                if slots:
                    where = f"ops/{slots[0]}"
                elif name == "mixer" and where == "mla/mixer":
                    where = "mla/attention"
                return {"component": where, "layer": layer, "sublayer": name, "first_position": c.start,
                        "layer_kind": model.config.layer_kinds[layer] if layer >= 0 else None,
                        "reason": f"layer {layer} {name} differs with the same input and state"
                                  + (f" (op slot {slots[0]}: {c.ops[slots[0]]})" if slots else "")}
    if c.logits is not None and c.logits != hash_tensor(logits[:c.kept_rows]):
        if c.kind == "fast":
            where = "engine/graphs" if c.graph_replayed else "engine/fast_step"
            return {"component": where, "layer": None, "sublayer": "logits", "first_position": c.start,
                    "reason": f"the batched decode row at position {c.start} differs from the reference's "
                              f"from the same state" + (" (a replayed CUDA graph)" if c.graph_replayed else "")}
        return {"component": "head/logits", "layer": -1, "sublayer": "logits", "first_position": c.start,
                "reason": "the logits differ with every sublayer output equal"}
    # 5. the tokens its step emitted (a verification keeps or drops drafts; the sampler picks), then
    # the state it left, which follows from them
    if c.post_at is not None:
        for p, (by, step, tok) in sorted(emitted.items()):
            if step == c.step and (p >= len(seq) or tok != seq[p]):
                return {"component": f"engine/{by}", "layer": None, "sublayer": None, "first_position": p,
                        "reason": f"the token streams part at position {p}: engine step {c.step} emitted {tok}, "
                                  f"the reference has {seq[p] if p < len(seq) else 'no token'} (by the {by})"}
    if c.post_at is not None:
        key = _first_state_diff(c.post, _state_hashes(model, walk.state_at(c.post_at), c.post_at))
        if key is not None:
            return _state_found(key, c.post_at, "the state this computation left")
    return None


def _state_found(key: tuple[int, str], at: int, what: str) -> dict[str, Any]:
    layer, name = key
    return {"component": _state_component(layer, name), "layer": layer, "sublayer": "state",
            "layer_kind": "mla" if name == "mla_rows" else "kda", "first_position": at,
            "state": {"layer": layer, "tensor": name, "num_tokens": at},
            "reason": f"{what} differs at token {at}: layer {layer} {name}"}
