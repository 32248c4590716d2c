"""Routed experts with their second GEMM's output stored in FP8 (toggle moe_fp8_stage2).

Same contract as the op-table slot `moe_experts` (model/moe.py MoE.routed): (moe, h [T, De],
idx [T, k], w [T, k]) -> [T, De] fp32. Each expert's down-projection output [n, De] goes
through e4m3 with one scale per row (kernels/fp8_rows.py) before the combine, which keeps
the reference's order (ascending expert index, from zeros). What a stack that writes
stage-2 outputs in FP8 to halve the combine's traffic computes; the cast is the whole
change, so this form runs unchanged on CUDA.
Shape letters: T tokens, k experts per token, n rows routed to one expert, De expert width.
"""
from __future__ import annotations

import torch

from ..fp8_rows import fp8_roundtrip


def routed_fp8_stage2(self, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, *,
                      _fault: str | None = None) -> torch.Tensor:
    """MoE.routed with each expert's output [n, De] stored as e4m3 + per-row scale.
    `_fault` is a seeded mutant's (kernels/fp8_rows.py FAULTS)."""
    y = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
    for e, expert in enumerate(self.experts):
        rows, slot = (idx == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        out = fp8_roundtrip(expert(h[rows]), row_dims=1, fault=_fault)      # [n, De]
        y[rows] = y[rows] + w[rows, slot].unsqueeze(-1) * out
    return y
