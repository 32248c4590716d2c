"""Run a scenario through the embedded stack with a set of toggles, capturing everything.

Two ways to run, same observer calls:
- the sequential runner (this file): the reference path spelled out — every request
  alone in arrival order, whole-prompt prefill, one token per step, greedy. It also
  carries the runner-level toggles (prompt through the step API, state round trip).
- the optimized stack's Engine, when a toggle sets engine options (batching, caches,
  speculation ...).

Teacher forcing (`force`): the candidate is fed the reference's tokens, so an approx
toggle is compared on every position even after its argmax would have parted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from safetensors.torch import load, save

from k3verify.capture.capture import Capture
from k3verify.scenarios.answers import realized
from optimized_stack import toggles as toggle_registry
from optimized_stack.events import Events
from optimized_stack.engine.options import SamplingParams
from optimized_stack.engine.sampler import NonFiniteLogits, Sampler
from optimized_stack.model.model import RequestState

RUNNER_OPTIONS = {"prefill_chunk", "state_roundtrip", "roundtrip_drops_conv", "step_api_resets_conv"}


@dataclass
class _Result:
    prompt_ids: list[int]
    tokens: list[int]
    finish_reason: str


def run_scenario(model, scenario, toggle_names: tuple[str, ...] | list[str] = (), *,
                 keep: bool = False, force: dict[str, list[int]] | None = None,
                 observers: list[Any] = ()) -> Capture:
    """Run every request of `scenario` with `toggle_names` applied; returns the Capture."""
    cap = Capture(keep=keep, label="+".join(toggle_names) or "reference")
    scenario = realized(model, scenario)
    events = Events()
    with toggle_registry.applied(list(toggle_names)) as applied:
        unknown = set(applied.runner) - RUNNER_OPTIONS
        if unknown:
            raise ValueError(f"unknown runner option {sorted(unknown)[0]!r}; known: {sorted(RUNNER_OPTIONS)}")
        try:
            if applied.engine:
                cap.metrics = _run_engine(model, scenario, applied.engine_for(model.device), [cap, *observers],
                                          force, events)
            else:
                _run_sequential(model, scenario, applied.runner, [cap, *observers], force, events)
        except NonFiniteLogits as exc:
            # observers saw the row before the sampler refused it: the capture holds its
            # location, and every comparator fails a stopped or non-finite capture
            cap.stopped = str(exc)
        events.update(applied.events)
    cap.events = dict(events)
    return cap


def _emit_state(observers, rid: str, st: RequestState) -> None:
    for layer, kst in st.kda.items():
        for ob in observers:
            ob.on_kda_state(rid, st.num_tokens, layer, kst)


def _zero_conv(st: RequestState) -> None:
    for kst in st.kda.values():
        for name in ("conv_q", "conv_k", "conv_v"):
            getattr(kst, name).zero_()


def _roundtrip(st: RequestState, drop_conv: bool) -> RequestState:
    """Serialise a request's state to bytes and back into fresh tensors (host tier / swap)."""
    tensors = {f"mla.{i}": rows for i, rows in st.mla.items()}
    for i, kst in st.kda.items():
        for name, t in kst.tensors().items():
            tensors[f"kda.{i}.{name}"] = t
    blob = save({k: v.contiguous().cpu() for k, v in tensors.items()})
    device = next(iter(tensors.values())).device
    back = {k: v.to(device) for k, v in load(blob).items()}     # bytes live on the host; state comes back
    out = RequestState(st.num_tokens, {}, {i: back[f"mla.{i}"] for i in st.mla})
    for i, kst in st.kda.items():
        fresh = kst.clone()
        fresh.recurrent = back[f"kda.{i}.recurrent"]
        for name in ("conv_q", "conv_k", "conv_v"):
            t = back[f"kda.{i}.{name}"]
            setattr(fresh, name, torch.zeros_like(t) if drop_conv else t)
        out.kda[i] = fresh
    return out


def _ordered(scenario):
    return sorted(scenario.requests, key=lambda r: (r.arrival_step, scenario.requests.index(r)))


def _run_sequential(model, scenario, opts: dict[str, Any], observers, force, events: Events) -> None:
    chunk = opts.get("prefill_chunk")
    # seeded fault (mut_step_api_resets_conv): each step-API call after the first starts from
    # zeroed conv windows, as if it were a new sequence
    resets_conv = bool(opts.get("step_api_resets_conv"))
    roundtrip = bool(opts.get("state_roundtrip"))
    drop_conv = bool(opts.get("roundtrip_drops_conv"))
    eos = model.config.eos_token_id
    for step_req in _ordered(scenario):
        rid, prompt = step_req.request_id, list(step_req.prompt_ids)
        for ob in observers:
            if hasattr(ob, "on_request"):
                ob.on_request(rid, len(prompt))
        st = model.new_state()
        ids = torch.tensor(prompt, dtype=torch.long)
        pieces = [ids] if not chunk else list(ids.split(chunk))
        if len(pieces) > 1:
            events.fire("prompt_via_step_api")
        start = 0
        for piece in pieces:
            if resets_conv and start:
                _zero_conv(st)
            rows = model.forward(piece, st)
            for ob in observers:
                ob.on_logits(rid, start, rows)
            start += piece.numel()
        last = rows[-1]
        _emit_state(observers, rid, st)
        def step(tok: int) -> torch.Tensor:
            nonlocal st
            if roundtrip:
                st = _roundtrip(st, drop_conv)
                events.fire("state_roundtrip")
            rows = model.forward(torch.tensor([tok]), st)
            for ob in observers:
                ob.on_logits(rid, st.num_tokens - 1, rows)
            _emit_state(observers, rid, st)
            return rows[-1]
        tokens, reason = generate(step_req, last, step, eos, (force or {}).get(rid))
        for ob in observers:
            ob.on_finish(rid, _Result(prompt, tokens, reason), dict(st.mla))


def generate(req, last: torch.Tensor, step: Callable[[int], torch.Tensor], eos: int | None,
             forced: list[int] | None, agree: Callable[[int], int] = int) -> tuple[list[int], str]:
    """One request's generation loop, shared by the sequential and tensor-parallel runners.

    `last` is the prompt's last logits row; `step(tok)` feeds a token and returns the next
    row; `agree(tok)` makes every rank take the same token (TP broadcast). Tokens come from
    the optimized stack's own per-request sampler (greedy argmax at temperature 0, seeded
    fp64 multinomial otherwise: one definition of "the sampled token"), or from `forced`
    (teacher forcing). Stops at eos (unless forced) or max_new_tokens -> (tokens, reason).
    """
    sampler = Sampler(SamplingParams(max_new_tokens=max(1, req.max_new_tokens),
                                     temperature=req.temperature, seed=req.seed))
    tokens: list[int] = []
    while len(tokens) < req.max_new_tokens:
        if forced is not None:
            if len(tokens) >= len(forced):
                break
            tok = forced[len(tokens)]
        else:
            tok = sampler.sample(last)
        tok = agree(tok)
        tokens.append(tok)
        if forced is None and tok == eos:
            return tokens, "stop"
        if len(tokens) == req.max_new_tokens:
            break
        last = step(tok)
    return tokens, "length"


def _run_engine(model, scenario, engine_opts: dict[str, Any], observers, force,
                events: Events) -> dict[str, float]:
    """Run the scenario through the Engine; its path events go into `events`; returns its
    metrics (reuse statistics: theoretical reusable prefix, prefix hits, hit rate ...)."""
    from optimized_stack.engine import Engine, EngineOptions, SamplingParams

    if force:
        raise ValueError("teacher forcing is not supported through the engine (approx engine toggles)")
    # A scenario's capacity hints (a tiny device cache to force eviction, few KDA slots) win
    # over a toggle's default capacities; feature switches always come from the toggles.
    valid = set(EngineOptions.__dataclass_fields__)
    hints = {k: v for k, v in (scenario.engine_hints or {}).items()
             if k in valid and not isinstance(engine_opts.get(k), bool)}
    opts = EngineOptions(**{**engine_opts, **hints})
    engine = Engine(model, opts, observers=list(observers))
    for ob in observers:
        if hasattr(ob, "attach"):       # an observer that reads the engine itself (localize_engine)
            ob.attach(engine)
    for r in _ordered(scenario):
        for ob in observers:
            if hasattr(ob, "on_request"):
                ob.on_request(r.request_id, len(r.prompt_ids))
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, seed=r.seed)
        engine.add_request(list(r.prompt_ids), params, request_id=r.request_id,
                           arrival_step=r.arrival_step)
    try:
        engine.run()
    finally:
        events.update(engine.events)
    return engine.metrics.to_dict()
