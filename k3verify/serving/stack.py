"""Which stack a server runs: the reference path, or the engine with a named set of toggles.

    stack = serve_stack("counted", [], "cpu")          # ServeStack(name="counted", toggles=(...))
    stack.label                                        # "engine[batched_decode,projected_kv_cache]"

"reference" is the plain token-by-token loop (backends/embedded.py `decode`). Any other stack is
served by the engine (backends/engine_backend.py). "counted" means the fast decode path that
counts as a speedup on the device: every exact optimization that switches the engine's batched
decode step on (engine option `batched_decode`) and runs on that device, i.e. batched_decode on
the CPU and batched_decode + cuda_graphs + the fused kernels (fused_kda_conv, fused_moe_combine,
fused_situ) on CUDA. Which toggles a suite run finally counted is only
known after the run (suites/verdicts.py); this is the set whose verdicts that run is about, so
`--toggle NAME` names any other set explicitly.

Toggles a server cannot honour are refused by name: the verifier's runner options (they change
its sequential runner, not the engine) and speculative decoding (its greedy acceptance would
bypass the request's grammar and logprobs).
"""
from __future__ import annotations

from dataclasses import dataclass

from optimized_stack import toggles as registry
from optimized_stack.errors import K3Error

STACKS = ("reference", "counted")
FAST_PATH_OPTION = "batched_decode"


@dataclass(frozen=True)
class ServeStack:
    name: str                        # "reference", "counted" or "toggles"
    toggles: tuple[str, ...]         # as named (requires resolved at apply time)
    device: str

    @property
    def engine(self) -> bool:
        return self.name != "reference"

    @property
    def resolved(self) -> tuple[str, ...]:
        """The toggles applied, requires included, in the registry's stable order."""
        return tuple(t.name for t in registry.resolve(list(self.toggles)))

    @property
    def label(self) -> str:
        """One token naming what serves: `reference` or `engine[t1,t2,...]` (resolved, sorted)."""
        return "reference" if not self.engine else f"engine[{','.join(sorted(self.resolved))}]"

    def to_dict(self) -> dict:
        return {"stack": self.name, "label": self.label, "toggles": list(self.resolved) if self.engine else [],
                "device": self.device}


def counted_toggles(device: str) -> tuple[str, ...]:
    """The exact optimizations that switch the batched decode step on and run on `device`."""
    return tuple(t.name for t in registry.all_toggles("optimization")
                 if t.contract.kind == "exact" and t.engine.get(FAST_PATH_OPTION) and device in t.devices)


def serve_stack(stack: str | None, toggle_names: list[str] | tuple[str, ...], device: str) -> ServeStack:
    """--stack / --toggle -> the stack to serve; K3Error (one line) for what cannot be served here."""
    toggle_names = tuple(toggle_names or ())
    if stack is not None and stack not in STACKS:
        raise K3Error(f"stack must be one of {', '.join(STACKS)}, got {stack!r}")
    if stack == "reference" and toggle_names:
        raise K3Error(f"the reference stack takes no toggles, got {', '.join(toggle_names)}")
    if stack == "counted" and toggle_names:
        raise K3Error("the counted stack names its own toggles; give either the stack or the toggles, not both")
    if stack == "counted":
        names, name = counted_toggles(device), "counted"
        if not names:
            raise K3Error(f"no fast-path toggle runs on {device}: the counted stack is empty there")
    elif toggle_names:
        names, name = toggle_names, "toggles"
    else:
        return ServeStack("reference", (), device)
    for t in registry.resolve(list(names)):
        if device not in t.devices:
            raise K3Error(f"toggle {t.name} runs on {', '.join(t.devices)} only, not on {device}")
        if t.runner:
            raise K3Error(f"toggle {t.name} changes the verifier's sequential runner, not the engine; "
                          "it cannot be served")
        if t.engine.get("speculative"):
            raise K3Error(f"toggle {t.name} is speculative decoding, whose greedy acceptance would bypass "
                          "a request's grammar and logprobs; it is not served")
    return ServeStack(name, names, device)
