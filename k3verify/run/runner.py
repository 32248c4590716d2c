"""Runner: runs scenarios, the reference and the candidates, in this process or on W
tensor-parallel ranks, and keeps each scenario's reference capture.

Every toggle judged in one process shares the reference captures (tensors kept), computed once
per scenario (its name, seed, scale and vocabulary: a scenario built at another scale is
another run). At world size W > 1 every run, the reference too (the same W without the
toggle), goes through the tensor-parallel runner's W ranks, started on first use and stopped
by close().
"""
from __future__ import annotations

from typing import Any

from k3verify.capture.capture import Capture
from k3verify.run.sequential import run_scenario
from k3verify.scenarios.answers import realized


class Runner:
    def __init__(self, model, world_size: int = 1, backend: str = "gloo"):
        self.model = model
        self.world_size = world_size
        self.backend = backend              # torch.distributed backend of the W > 1 ranks
        self._references: dict[tuple, Capture] = {}
        self._tp = None

    def run(self, scenario, toggle_names=(), *, keep: bool = False, force=None) -> Capture:
        """One run of `scenario` with `toggle_names` applied (teacher-forced with `force`)."""
        scenario = realized(self.model, scenario)       # real answers in multi-turn histories
        if self.world_size == 1:
            return run_scenario(self.model, scenario, toggle_names, keep=keep, force=force)
        if self._tp is None:
            from k3verify.run.tp import TPRunner
            self._tp = TPRunner(self.model, self.world_size, backend=self.backend)
        return self._tp.run(scenario, toggle_names, keep=keep, force=force)

    def reference(self, scenario) -> Capture:
        """The scenario's reference capture, tensors kept; run once, then cached."""
        meta = scenario.meta
        key = (scenario.name, meta.get("seed"), meta.get("scale"), meta.get("vocab"))
        if key not in self._references:
            self._references[key] = self.run(scenario, (), keep=True)
        return self._references[key]

    def close(self) -> None:
        if self._tp is not None:
            self._tp.close()
            self._tp = None

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
