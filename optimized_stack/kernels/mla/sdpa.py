"""MLA attention through torch's scaled_dot_product_attention (flash / memory-efficient).

Decompressed K/V as in the reference, but the causal softmax runs in torch's fused
kernel: O(T) memory, so 100K-token prefills fit on a CPU. Different summation order
from the blocked reference: an `approx` toggle. Two forms: `sdpa_attention` (the op-table
slot `attention`, one sequence at any query positions) and `sdpa_causal` (batched
[B, T, ...] causal, for training).

torch's fused kernels want one head size for q, k and v (K3: 192 vs 128); otherwise they
fall back to a path holding the whole [T, S] score matrix (OOM at 108K tokens). V is
zero-padded up to the qk head size: zero value columns change nothing in the first Vd outputs.

Shape letters: B batch, T queries, S keys, H heads, C qk head dim, Vd v head dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                   scale: float, _mask_leaks_next: bool = False) -> torch.Tensor:
    """Same contract as mla.blocked_attention: q [T, H, C], k [S, H, C], v [S, H, Vd].
    `_mask_leaks_next` is a seeded fault (a mutant): the mask lets each query see the next key."""
    t_len, s_len = q.shape[0], k.shape[0]
    vd = v.shape[-1]
    if vd < q.shape[-1]:
        v = torch.cat([v, v.new_zeros(*v.shape[:-1], q.shape[-1] - vd)], -1)
    qh, kh, vh = (x.float().permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))   # [1, H, *, *]
    if t_len == 1:
        # one query (a decode): its positions are contiguous by definition, and it starts at 0 with
        # S = start + 1 keys exactly when S == 1 (0 <= q_pos < S): the branch below without its two
        # host syncs, which the engine's one-request-at-a-time decode paid per request per layer
        whole_causal = s_len == 1
    else:
        start = int(q_pos[0])
        contiguous = bool((q_pos == torch.arange(start, start + t_len, device=q.device)).all())
        whole_causal = contiguous and start + t_len == s_len and start == 0
    if whole_causal and not _mask_leaks_next:
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        visible = torch.arange(s_len, device=q.device).view(1, -1) <= q_pos.view(-1, 1) + int(_mask_leaks_next)  # [T, S]
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=scale)
    return out.squeeze(0).permute(1, 0, 2)[..., :vd]


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention. q, k [B, T, H, C], v [B, T, H, V] -> [B, T, H, V] (V padded
    up to C for the fused kernel, see the module docstring)."""
    vd, c = v.shape[-1], q.shape[-1]
    if vd < c:
        v = F.pad(v, (0, c - vd))
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, scale=scale)
    return o.transpose(1, 2)[..., :vd]
