"""The per-shape GEMM toggle and its mutant (kernels/gemm/per_shape.py)."""
from __future__ import annotations

import functools

from ...toggles import Toggle, register
from ..kda.toggle_defs import APPROX_KERNEL
from .per_shape import NARROW_N, per_shape_linear

# Approx with the CPU kernels' budget (kda/toggle_defs.py APPROX_KERNEL): a plain GEMM moves a
# narrow projection's last bits, a few ULP, which the logits and the KDA state feel far below
# the budget (NOTES.md, 2026-12-01); a wrong column lands far outside it.
register(Toggle(
    name="gemm_per_shape", contract=APPROX_KERNEL, touches=("logits", "kda_state"),
    description=f"GEMMs picked per shape: narrow outputs (N <= {NARROW_N}: router, KDA beta and gate ranks, "
                "MLA down projections) through torch's plain GEMM, the rest row-stable tiles",
    ops={"linear": per_shape_linear}, events=("op:linear",)))

register(Toggle(
    name="mut_gemm_per_shape_drops_column", kind="mutant", mutant_of="gemm_per_shape", contract=APPROX_KERNEL,
    touches=("logits", "kda_state"), description="the narrow GEMM path writes N - 1 columns (the last one stays 0)",
    caught_by=("drift_budget",), lives_in="kda/mixer",
    ops={"linear": functools.partial(per_shape_linear, _drop_last_column=True)}, events=("op:linear",)))
