"""Which SiTU-GLU the engine's expert forms run under the engine option fused_situ, and the evidence
that the fused one ran.

The static experts of the batched decode step (engine/fast/moe_static.py) and the sorted prefill
experts (kernels/moe/sorted.py) take an activation with model/ops.py situ's signature. With
fused_situ that is `situ_form(...)`: kernels/moe/situ.py's one launch where it can run (CUDA
tensors; any tensor under Triton's interpreter, how CI runs the kernels), the torch form elsewhere.
On the CPU no kernel runs and no event fires: the toggle is CUDA-only (the CPU gate skips it, as it
does fused_moe_combine), and an engine on the CPU with the option on runs the reference's activation
with no evidence of a kernel. Triton is imported only when the kernel runs (the CPU venv has none).
"""
from __future__ import annotations

from typing import Callable

import torch

from ...events import DIMS_NEEDED, Events
from ...model.ops import situ
from ..gpu_reference import interpreting

# the engine's seeded faults (engine/options.py FAULTS) -> the kernel's (kernels/moe/situ.py FAULTS)
ENGINE_FAULTS = {"mut_fused_situ_fast_exp": "fast_exp", "mut_fused_situ_no_linear_beta": "no_linear_beta"}


def situ_form(faults: frozenset[str], ran: Callable[[int], None]) -> Callable[..., torch.Tensor]:
    """An activation with situ's signature: the fused kernel where it can run, `ran(rows)` told each
    time it did (rows: every leading dim of gate); situ itself elsewhere. `faults`: the engine's
    seeded faults, of which the fused_situ ones (ENGINE_FAULTS) reach the kernel."""
    fault = next((ENGINE_FAULTS[f] for f in sorted(faults) if f in ENGINE_FAULTS), None)

    def act(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
        if not (gate.is_cuda or interpreting()):
            return situ(gate, up, beta, linear_beta)
        from .situ import fused_situ
        out = fused_situ(gate, up, beta, linear_beta, fault=fault)
        ran(gate.numel() // gate.shape[-1] if gate.shape[-1] else 0)
        return out
    return act


def fire_situ_events(events: Events, rows: int, config) -> None:
    """The path events of `rows` rows through the kernel: fused_situ, and fused_situ_wide where the
    model's experts are wide enough for a few-ULP fault to show in bf16 (events.py DIMS_NEEDED)."""
    events.fire("fused_situ", rows)
    field, width, _ = DIMS_NEEDED["fused_situ_wide"]
    if getattr(config, field) > width:
        events.fire("fused_situ_wide", rows)
