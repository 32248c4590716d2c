"""A GPU training run's first check: the fast training forms against the plain ones.

`self_check` reports max relative errors, forward and gradients, of the chunked KDA
forms (plain torch and fla-core) against the batched recurrence, of the fused SDPA against
an explicit softmax, and of the fla op form against the recurrence (scripts/gpu_train.sh
prints it before training).
"""
from __future__ import annotations

import torch

from .kernels.kda.chunked import kda_chunk_torch
from .kernels.kda.fla import fla_chunk, kda_chunk_batched
from .kernels.kda.recurrent import kda_recurrent_batched
from .kernels.mla.sdpa import sdpa_causal


def self_check(device: str = "cuda", b: int = 2, t: int = 300, h: int = 4, kd: int = 16,
               with_fla: bool = False) -> dict:
    """Max relative errors of the fast ops against the plain forms, forward and gradients."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    def l2(x):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    q0, k0, v0 = l2(rnd(b, t, h, kd)) * kd ** -0.5, l2(rnd(b, t, h, kd)), rnd(b, t, h, kd)
    g0, beta0 = -5 * torch.sigmoid(rnd(b, t, h, kd)), torch.sigmoid(rnd(b, t, h))
    out = {}

    def rel(a, r):
        return float((a - r).abs().max() / r.abs().max().clamp(min=1e-12))

    def run(fn):
        ins = [x.clone().requires_grad_(True) for x in (q0, k0, v0, g0, beta0)]
        o = fn(*ins)
        (o * torch.linspace(-1, 1, o.numel(), device=device).view_as(o)).sum().backward()
        return o.detach(), [x.grad for x in ins]

    ref_o, ref_g = run(kda_recurrent_batched)
    o, gr = run(kda_chunk_torch)
    out["kda_torch_fwd"] = rel(o, ref_o)
    out["kda_torch_grad"] = max(rel(a, r) for a, r in zip(gr, ref_g))
    print("kda torch", out, flush=True)
    if not with_fla:
        return out
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        o, gr = run(lambda *a: kda_chunk_batched(*a, io_dtype=dt))
        out[f"kda_{name}_fwd"] = rel(o, ref_o)
        out[f"kda_{name}_grad"] = max(rel(a, r) for a, r in zip(gr, ref_g))
    c, vd = 24, 16
    q, k, v = rnd(b, t, h, c), rnd(b, t, h, c), rnd(b, t, h, vd)
    s = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) * c ** -0.5
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=device).triu(1), float("-inf"))
    ref = (s.softmax(-1) @ v.transpose(1, 2)).transpose(1, 2)
    out["sdpa_fp32"] = rel(sdpa_causal(q, k, v, c ** -0.5), ref)
    out["sdpa_bf16"] = rel(sdpa_causal(q.bfloat16(), k.bfloat16(), v.bfloat16(), c ** -0.5).float(), ref)
    st0 = torch.zeros(h, kd, kd, device=device)
    o1, s1 = fla_chunk(q0[0], k0[0], v0[0], g0[0], beta0[0], st0)
    out["prefill_op_fwd"] = rel(o1, ref_o[0])
    return out
