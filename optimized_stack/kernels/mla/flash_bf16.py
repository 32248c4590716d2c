"""The mla_flash_bf16 toggle's attention (op-table slot `attention`): the reference's blocked Triton
kernel (kernels/mla/attention.py: fixed tiles, 64-key blocks, so a query's bits still never depend
on the batch) with P @ V on bf16 tensor cores, P and V rounded to bf16 and fp32 accumulation,
instead of the reference's fp32 IEEE FMAs. Triton is imported on the first call: the toggle runs on
CUDA only, and the CPU install has no Triton.

Shape letters: T queries, S keys, H heads, C qk head dim, Vd v head dim.
"""
from __future__ import annotations

import torch


def flash_bf16_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                         scale: float, _fault: str | None = None) -> torch.Tensor:
    """q [T, H, C], k [S, H, C], v [S, H, Vd], q_pos [T] -> [T, H, Vd] fp32 (mla.blocked_attention's
    contract). `_fault` only for the mutant: "diag_unmasked"."""
    from .attention import causal_attention
    return causal_attention(q, k, v, q_pos, scale, lowp_pv=True, _fault=_fault)
