"""MLA attention through torch's scaled_dot_product_attention (flash / memory-efficient).

Decompressed K/V as in the reference, but the causal softmax runs in torch's fused
kernel: O(T) memory, so 100K-token prefills fit on a CPU. Different summation order
from the blocked reference: an `approx` toggle.

Shape letters: T queries, S keys, H heads, C qk head dim, Vd v head dim.
"""
from __future__ import annotations

import torch


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Same contract as mla.blocked_attention: q [T, H, C], k [S, H, C], v [S, H, Vd]."""
    t_len, s_len = q.shape[0], k.shape[0]
    vd = v.shape[-1]
    if vd < q.shape[-1]:
        # torch's fused CPU kernel needs equal q/k and v head sizes (K3: 192 vs 128); otherwise
        # it falls back to a path holding the whole [T, S] score matrix (OOM at 108K tokens).
        # Zero value columns change nothing in the first vd outputs.
        v = torch.cat([v, v.new_zeros(*v.shape[:-1], q.shape[-1] - vd)], -1)
    qh, kh, vh = (x.float().permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))   # [1, H, *, *]
    start = int(q_pos[0])
    contiguous = bool((q_pos == torch.arange(start, start + t_len, device=q.device)).all())
    if contiguous and start + t_len == s_len and start == 0:
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        visible = torch.arange(s_len, device=q.device).view(1, -1) <= q_pos.view(-1, 1)   # [T, S]
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=scale)
    return out.squeeze(0).permute(1, 0, 2)[..., :vd]
