"""Per-shape GEMM selection: each projection's GEMM implementation chosen by its shape.

Narrow outputs (N <= NARROW_N features: the MoE router, KDA's beta and low-rank gate
projections, MLA's low-rank down projections) go through torch's plain GEMM in one call;
wider ones keep the reference's row-stable form (model/ops.py row_linear). On these CPUs the
tiled form pays most for narrow outputs: every call is padded to 16 output columns and cut
into 8-row tiles, for an [T, D] x [D, 4] product that is a few hundred multiply-adds a row.
A plain GEMM is not row-stable (a row's bits depend on how many rows share the call, and on
N mod 16 under MKL's pinned branch: ops.py), so this toggle's contract is approx: the kernel
budget and the quality gates. On CUDA row_linear is cuBLAS already, so both paths are the
same there until a batch-invariant GPU form lands.

Shape letters: T tokens, D input features, N output features.
"""
from __future__ import annotations

import torch

from ...model.ops import row_linear

NARROW_N = 32       # output features at or below which the narrow path takes the GEMM


def per_shape_linear(x: torch.Tensor, weight: torch.Tensor, *, _drop_last_column: bool = False) -> torch.Tensor:
    """y = x @ weight.T with the implementation picked by the shape. x [.., D], weight [N, D].

    _drop_last_column is the mutant's fault: the narrow path loses its last output column
    (the bug of a narrow kernel that writes N - 1 columns)."""
    n_out = weight.shape[0]
    if n_out > NARROW_N:
        return row_linear(x, weight)
    y = torch.nn.functional.linear(x, weight)                      # [.., N]
    if _drop_last_column:
        y = torch.cat([y[..., :-1], torch.zeros_like(y[..., -1:])], dim=-1)
    return y
