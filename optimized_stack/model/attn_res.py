"""AttnRes (K3 block attention residuals): a learned per-token mix of residual snapshots.

Shape letters: N snapshots, T tokens, D hidden.

    V = stack(snapshots + [partial]).float()                        # [N+1, T, D]
    p = softmax over N+1 of sum_D(rmsnorm_nogain(V) * norm_w * proj_w)
    input = sum_i p_i * V_i                                          # the RAW vectors
The mix is per token, so decoding needs no cache for it.
"""
from __future__ import annotations

import torch
from torch import nn

from . import ops
from .ops import exp, rms_norm


class AttnResRead(nn.Module):
    """One read site: `{name}_norm.weight` [D] and `{name}_proj.weight` [1, D] in the checkpoint.

    Held as two parameters on the owning module so the state-dict names match HF; this
    class only carries the computation.
    """

    @staticmethod
    def mix(candidates: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor,
            eps: float) -> torch.Tensor:
        """candidates: N+1 tensors [T, D] (snapshots, then the partial sum) -> [T, D].
        On CUDA: fused per token in one Triton kernel (kernels/attn_res/read.py)."""
        if candidates[-1].is_cuda and not ops.gpu_reference().needs_autograd(*candidates, norm_w, proj_w):
            return ops.gpu_reference().attn_res_mix(candidates, norm_w, proj_w, eps)
        vals = torch.stack(candidates).float()                              # [N+1, T, D]
        query = (norm_w.float() * proj_w.float().reshape(-1))               # [D]
        scores = (rms_norm(vals, None, eps) * query).sum(-1)                # [N+1, T]
        # softmax over candidates, spelled out so exp goes through the row-stable path
        e = exp(scores - scores.amax(0, keepdim=True))
        p = (e / e.sum(0, keepdim=True)).unsqueeze(-1)                      # [N+1, T, 1]
        out = p[0] * vals[0]
        for i in range(1, vals.shape[0]):                                   # fixed order
            out = out + p[i] * vals[i]
        return out.to(candidates[-1].dtype)


def make_read_params(owner: nn.Module, name: str, d: int) -> None:
    """Register `{name}_norm.weight` and `{name}_proj.weight` on owner (HF names)."""
    norm = nn.Module()
    norm.weight = nn.Parameter(torch.ones(d))
    proj = nn.Module()
    proj.weight = nn.Parameter(torch.zeros(1, d))
    setattr(owner, f"{name}_norm", norm)
    setattr(owner, f"{name}_proj", proj)
