"""MLA prefill attention on FP8 Q, K and V (toggle mla_fp8_prefill).

Same contract as the op-table slot `mla_prefill` (model/mla.py MLAttention.attend, called
for calls of more than one query; decode keeps its own slot and is untouched): (layer,
q [T, H, C], rows [S, R], q_pos [T]) -> [T, H, Vd] fp32. The rows are decompressed as in
the reference, then Q, K and V each go through e4m3 with one scale per (token, head) row
(kernels/fp8_rows.py); the scores, softmax and P @ V run in fp32 on the dequantized values
through the reference's blocked attention (on CUDA: its Triton kernel).

What this models is the storage precision of an FP8 prefill kernel: a scaled FP8 GEMM
(torch._scaled_mm) multiplies exactly these e4m3 values and applies the same scales. The
scaled-GEMM form is fp8_prefill_scaled.py (toggle mla_fp8_prefill_scaled): its row-wise scales
write bf16 scores, which it adds to this form's error, and it pads to 16-aligned shapes.
Shape letters: T queries, S cache rows, H heads, C qk head dim, Vd v head dim, R row width.
"""
from __future__ import annotations

import torch

from ...model.mla import blocked_attention
from ..fp8_rows import fp8_roundtrip


def mla_fp8_prefill(layer, q: torch.Tensor, rows: torch.Tensor, q_pos: torch.Tensor, *,
                    _fault: str | None = None) -> torch.Tensor:
    """`_fault` is a seeded mutant's (kernels/fp8_rows.py FAULTS)."""
    k, v = layer.decompress(rows)                                   # [S, H, C], [S, H, Vd]
    q8, k8, v8 = (fp8_roundtrip(x, row_dims=2, fault=_fault) for x in (q, k, v))   # a row: one head of one token
    return blocked_attention(q8, k8, v8, q_pos, layer.cfg.qk_head_dim ** -0.5)
