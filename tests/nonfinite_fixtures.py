"""In-process poisons for the non-finite tests: one NaN / inf in a forward's output or state,
or in a weight, always undone; and a temporary toggle that poisons the candidate only.

The loader will refuse non-finite weights unless allowed, so nothing here writes a
checkpoint: a loaded model is poisoned in memory and restored in `finally`.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

from optimized_stack import toggles as registry

VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@contextlib.contextmanager
def poisoned(model, where: str, *, position: int, value: str, index: int = 5, layer: int | None = None
             ) -> Iterator[None]:
    """Write VALUES[value] into one element, in place, on every forward that reaches it.

    where "logits": element `index` of the logits row for token `position`;
    "recurrent" / "conv_q" / "conv_k" / "conv_v": flat element `index` of KDA layer `layer`'s
    state once the request holds `position` tokens (after that forward);
    "mla": flat element `index` of MLA layer `layer`'s cache rows [S, R] at `position` tokens.
    """
    forward_batch = model.forward_batch                   # the bound reference method
    x = VALUES[value]

    def wrapped(segments):
        starts = [st.num_tokens for _, st in segments]
        outs = forward_batch(segments)
        for (_, st), start, rows in zip(segments, starts, outs):
            if where == "logits":
                if start <= position < st.num_tokens:
                    rows[position - start, index] = x       # rows [T, V] is a view of the logits
            elif st.num_tokens == position:
                t = st.mla[layer] if where == "mla" else getattr(st.kda[layer], where)
                t.view(-1)[index] = x
        return outs

    outer = model.__dict__.get("forward_batch")          # an enclosing poison, if any
    model.forward_batch = wrapped                         # instance attribute shadows the method
    try:
        yield
    finally:
        if outer is None:
            del model.forward_batch
        else:
            model.forward_batch = outer


@contextlib.contextmanager
def poisoned_weight(param: torch.nn.Parameter, index: tuple[int, ...], value: str) -> Iterator[None]:
    old = param.data[index].clone()
    param.data[index] = VALUES[value]
    try:
        yield
    finally:
        param.data[index] = old


@contextlib.contextmanager
def candidate_poison(name: str, poison, contract: str = "exact") -> Iterator[str]:
    """A temporary toggle whose only effect is `poison()` (a context manager factory): the
    candidate run is poisoned, the reference is not.

    A toggle switches op-table slots, engine or runner options, never a model's methods, so
    the test's poison (a shadowed forward_batch) rides on the one place toggles are applied:
    `registry.applied` enters it whenever this toggle is among the names (in this process)."""
    c = registry.Contract("approx", max_kl=1e-3, min_top1=0.99) if contract == "approx" else registry.EXACT
    registry.register(registry.Toggle(name=name, description="test only: poisons the candidate",
                                      contract=c, touches=("logits",)))
    real = registry.applied

    @contextlib.contextmanager
    def applied(names):
        with real(names) as result:
            if name not in names:
                yield result
                return
            with poison():
                yield result
    registry.applied = applied
    try:
        yield name
    finally:
        registry.applied = real
        registry._REGISTRY.pop(name)
