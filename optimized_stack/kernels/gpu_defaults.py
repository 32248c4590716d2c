"""torch's own forms of the reference primitives on CUDA: what "no invariance" costs nothing for.

`K3_GPU_PROFILE=torch` makes the reference primitives call these instead of the invariant GPU
profile (kernels/gpu_reference.py): cuBLAS as it comes (bf16 with its reduced-precision
reductions, fp32 with TF32 when torch allows it), torch's reductions and fused SDPA, and KDA
through fla's chunk_kda over the whole call whatever its length. Same functions and signatures
as gpu_reference. NOT batch-invariant (cuBLAS and torch's reductions pick their split by the row
count, NOTES.md): it exists as the side B of the price-of-exactness measurement (issue 18) and
as a negative control, never as a reference.

Shape letters: T tokens, S keys, H heads, C qk head dim, Vd v head dim, D width, N candidates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .gpu_reference import kda_activations, needs_autograd  # noqa: F401  (the callers ask the module they got)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else y * weight


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(-1, keepdim=True)


def attn_res_mix(candidates: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor,
                 eps: float) -> torch.Tensor:
    vals = torch.stack(candidates).float()                                   # [N+1, T, D]
    scores = (rms_norm(vals, None, eps) * (norm_w.float() * proj_w.float().reshape(-1))).sum(-1)
    p = torch.softmax(scores, 0).unsqueeze(-1)                               # [N+1, T, 1]
    return (p * vals).sum(0).to(candidates[-1].dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              scale: float) -> torch.Tensor:
    from .mla.sdpa import sdpa_attention
    return sdpa_attention(q, k, v, q_pos, scale)


def kda_scan(q, k, v, g, beta, initial_state=None):
    from .kda.fla import fla_chunk
    return fla_chunk(q, k, v, g, beta, initial_state)
