"""A deliberately lossy approx toggle: the quality gates' positive control.

`kda_state_bf16` keeps each KDA layer's recurrent state [H, K, V] in bf16 between
tokens, which halves the state memory a serving engine must hold per request (and
per prefix-cache checkpoint). It is a real trade-off an inference team could
propose, declared with the same approx budget as `kda_chunked`; it is expected to
FAIL that budget (`k3verify diff --toggle kda_state_bf16` exits 1) and, on a model
with quality to lose, the GSM8K / needle gates. If it ever passes, the gates have
gone blind.

The arithmetic reuses the seeded fault behind the `mut_kda_state_bf16` mutant: the
mutant claims an exact contract and must be caught bitwise; this toggle claims an
approx contract and must be caught by its drift budget and quality.

It is registered as kind "mutant" (a control that must be rejected) rather than as an
optimization, so `k3verify selftest` and `k3verify all` demand that it is caught instead
of demanding that it passes. Registered when this module is imported; optimized_stack.
toggles loads it with the other toggle modules.
"""
from __future__ import annotations

from ..toggles import Toggle, register
from .toggle_defs import APPROX_KERNEL, _ops, _recurrent_bf16_state

register(Toggle(
    name="kda_state_bf16", contract=APPROX_KERNEL, touches=("logits", "kda_state"),
    description="KDA recurrent state stored in bf16 between tokens (halves state memory; "
                "deliberately lossy: must fail its drift budget and the quality gates)",
    kind="mutant", caught_by=("drift_budget",), lives_in="kda/mixer",
    patch=_ops(kda_prefill=_recurrent_bf16_state)))
