"""An observer's digests of the fast decode step, taken inside the step (and so inside its CUDA graph).

A verifier watching the engine records a digest of every logits row and every KDA state after every
step. Taken after the step, that is ~37 tensors gathered, stacked and digested per step on the host's
schedule: on the H100 one step's stacks and digests cost 2.87 ms of launches at B = 64 beside a ~6-8 ms
decode step (NOTES.md, session 21), so the capture alone was +35% or more. Here the fast step itself,
after its forward, gathers the stepped rows of every KDA pool tensor by slot and hands them with the
logits rows to the observer's digester; inside a CUDA graph those launches are replayed with the step
and cost the host nothing. After the step the engine copies the words out (one small copy: the next
replay overwrites the graph's buffer) and hands them to the observer with the points they belong to.

The observer supplies the digest (the engine never imports the verifier). A digester has
- `scheme`: a name (observers that disagree get no in-step digests: each keeps the calls after the step);
- `words(tensors, index) -> [rows, W] per tensor`: capturable (no host sync, no host allocation once
  warm); index[i] (or None) names the rows of tensors[i] to digest, read where they lie: the pool's
  stepped slots, with no gathered copy (~300 MB a step at B = 64 on k3-small);
- `check(tensors, words) -> None | why`: the same words computed another way, eagerly. The first words
  of every graph (and of the first eager step) are checked; a difference or a failure turns the in-step
  digests off for the engine, says why once, and the observers get the calls after the step again.

Shape letters: Bp padded rows, B real rows, W words per row, V vocab.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Entry:
    """What one digested tensor of the step is: a row per request, each of `shape` and `dtype`."""

    kind: str                   # "logits" or "kda"
    layer: int                  # the KDA layer (-1 for logits)
    name: str                   # the KDA tensor ("" for logits)
    dtype: torch.dtype
    shape: tuple[int, ...]      # one row's shape


class StepDigests:
    """The step's digested tensors (layout) and their words; whether the in-step form still holds."""

    def __init__(self, digester, kda_pools: dict[int, dict[str, torch.Tensor]], vocab: int):
        self.digester = digester
        self.pools = kda_pools                                   # layer -> name -> [slots, ...]
        self.layout = [Entry("logits", -1, "", torch.float32, (vocab,))] + [
            Entry("kda", layer, name, pool[name].dtype, tuple(pool[name].shape[1:]))
            for layer, pool in kda_pools.items() for name in pool]          # KDAState.tensors()' order
        self.broken: str | None = None          # why the in-step digests were turned off

    def tensors(self, logits: torch.Tensor, kda_slot: torch.Tensor) -> list[torch.Tensor]:
        """logits [Bp, V] fp32, kda_slot [Bp] -> the layout's tensors, [Bp, ...] each (the stepped
        rows of every pool tensor, gathered by slot on the device)."""
        return [logits] + [self.pools[e.layer][e.name].index_select(0, kda_slot) for e in self.layout[1:]]

    def words(self, logits: torch.Tensor, kda_slot: torch.Tensor) -> torch.Tensor:
        """[len(layout), Bp, W] int64: the digester's words of every tensor of `tensors` (capturable); the
        pools' rows are read in place at kda_slot."""
        pools = [self.pools[e.layer][e.name] for e in self.layout[1:]]
        return torch.stack(list(self.digester.words([logits] + pools, [None] + [kda_slot] * len(pools))))

    def check(self, logits: torch.Tensor, kda_slot: torch.Tensor, words: torch.Tensor) -> str | None:
        """None when `words` (the step's, [len(layout), Bp, W]) are what the digester's other form gives
        for the same tensors now; else why not."""
        try:
            return self.digester.check(self.tensors(logits, kda_slot), list(words.unbind(0)))
        except Exception as exc:   # noqa: BLE001 - a check that cannot run cannot vouch for the words
            return f"the check failed: {type(exc).__name__}: {exc}"[:300]

    def turn_off(self, why: str) -> None:
        if self.broken is None:
            print(f"optimized_stack: the observer's in-step digests are off ({why}); "
                  "it gets its calls after the step", file=sys.stderr, flush=True)
        self.broken = why


def step_digester(observers, device: torch.device):
    """The digester every observer agrees on for this device (each offers `step_digester(device)` and
    takes `on_step_words`), or None: then the observers get their calls after the step."""
    if not observers:
        return None
    offered = []
    for obs in observers:
        make = getattr(obs, "step_digester", None)
        if make is None or not callable(getattr(obs, "on_step_words", None)):
            return None
        d = make(device)
        if d is None:
            return None
        offered.append(d)
    return offered[0] if len({d.scheme for d in offered}) == 1 else None
