"""The KDA recurrence with a batch dimension: the differentiable, obviously-correct form
training falls back to on a CPU (and the check the chunked training forms are held to).

The single-sequence reference with a start state is model/kda.py `kda_recurrent`; this
form has the same four steps per token (decay, delta, write, read) over [B, ...].

Shape letters: B batch, T tokens, H heads, K key dim, V value dim.
"""
from __future__ import annotations

import torch


def kda_recurrent_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor) -> torch.Tensor:
    """The KDA recurrence (decay, delta, write, read) with a batch dim, zero initial state.

    q, k, g [B, T, H, K] (q l2-normed and scaled), v [B, T, H, V], beta [B, T, H].
    Returns o [B, T, H, V] fp32. Differentiable; slow (one step per token): CPU / tests only.
    """
    b, t_len, h, kd = q.shape
    q, k, v, g, beta = q.float(), k.float(), v.float(), g.float(), beta.float()
    state = q.new_zeros(b, h, kd, v.shape[-1])
    decay = torch.exp(g)
    outs = []
    for t in range(t_len):
        state = state * decay[:, t].unsqueeze(-1)                          # [B, H, K, V]
        kv = (state * k[:, t].unsqueeze(-1)).sum(2)                        # S^T k  [B, H, V]
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - kv)
        state = state + k[:, t].unsqueeze(-1) * u.unsqueeze(2)
        outs.append((state * q[:, t].unsqueeze(-1)).sum(2))
    return torch.stack(outs, 1)
