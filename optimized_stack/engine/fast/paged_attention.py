"""MLA decode attention for B requests at once over the paged projected-K/V cache.

The reference decode (model/mla.py forward_projected, one request) attends q [1, H, C] over
k = [kv_nope | k_rope] and v of its own rows with `blocked_attention` (CPU) or the Triton
kernel (CUDA, kernels/mla/attention.py). Here both forms read the rows through the block table:

- CPU (`paged_attention_cpu`): blocked_attention's arithmetic over a batch dimension. Per
  64-key block the same products and reductions on the same per-request tile shapes
  ([H, 64, C] scores, [H, Vd, 64] P.V), the same exp, and a request whose limit lies before the
  block keeps its (m, l, acc) by a select (torch.where), not by the x*1 + 0 the reference relies
  on, so no -0.0 can turn into +0.0. Keys past a request's limit are zeros, as the reference's
  padding. Bitwise equal to blocked_attention per request (tests/test_fast_parts.py, both
  thread counts).
- CUDA (kernels/mla/paged.py): the reference kernel's loop body on the same tiles, no host sync.

Shape letters: B requests, H heads, C = n + r, Vd, L latent, R = L + r, N blocks, bs block size,
W = H*(n+Vd) projected width, P max blocks per request.
"""
from __future__ import annotations

import torch

from ...model.mla import KEY_BLOCK
from ...model.ops import exp


def key_rows(tables: torch.Tensor, block_size: int, start: int) -> torch.Tensor:
    """Flat pool row of positions start .. start+63 for each request: tables [B, P] -> [B, 64]."""
    pos = start + torch.arange(KEY_BLOCK, device=tables.device)
    blk = (pos // block_size).clamp(max=tables.shape[1] - 1)     # past the table: masked anyway
    return tables.index_select(1, blk).long() * block_size + pos % block_size


def paged_attention_cpu(q: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
                        pos: torch.Tensor, scale: float, *, nope: int, v_dim: int, block_size: int
                        ) -> torch.Tensor:
    """q [B, H, C]; rows [N*bs, R], kv [N*bs, W] (flat pools); tables [B, P] (each request's own
    block table); pos [B] -> [B, H, Vd] fp32 (request b sees its keys 0..pos[b])."""
    b_len, h, c = q.shape
    lat = rows.shape[-1] - (c - nope)
    n_blocks = int(pos.max()) // KEY_BLOCK + 1
    q = q.float()
    m = torch.full((b_len, h, 1), float("-inf"), device=q.device)
    l = torch.zeros(b_len, h, 1, device=q.device)
    acc = torch.zeros(b_len, h, v_dim, device=q.device)
    key_idx = torch.arange(KEY_BLOCK, device=q.device)
    for j in range(n_blocks):
        start = j * KEY_BLOCK
        visible = (start + key_idx).view(1, -1) <= pos.view(-1, 1)                  # [B, 64]
        flat = key_rows(tables, block_size, start)                                   # [B, 64]
        kv_b = kv[flat].view(b_len, KEY_BLOCK, h, nope + v_dim)                      # [B, 64, H, n+Vd]
        rope = rows[flat][..., lat:].unsqueeze(2).expand(-1, -1, h, -1)              # [B, 64, H, r]
        k = torch.cat([kv_b[..., :nope], rope], -1).float()                          # [B, 64, H, C]
        v = kv_b[..., nope:].float()                                                 # [B, 64, H, Vd]
        keep = visible.view(b_len, KEY_BLOCK, 1, 1)
        k = torch.where(keep, k, torch.zeros((), device=q.device))     # the reference pads with zeros
        v = torch.where(keep, v, torch.zeros((), device=q.device))
        kb = k.permute(0, 2, 1, 3)                                                   # [B, H, 64, C]
        vb = v.permute(0, 2, 3, 1)                                                   # [B, H, Vd, 64]
        s = (q.unsqueeze(2) * kb).sum(-1) * scale                                    # [B, H, 64]
        s = s.masked_fill(~visible.view(b_len, 1, KEY_BLOCK), float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha = exp(m - m_new)
        p = exp(s - m_new)
        l_new = l * alpha + p.sum(-1, keepdim=True)
        pv = (p.unsqueeze(2) * vb).sum(-1)                                           # [B, H, Vd]
        acc_new = acc * alpha + pv
        active = (start <= pos).view(-1, 1, 1)
        m = torch.where(active, m_new, m)
        l = torch.where(active, l_new, l)
        acc = torch.where(active, acc_new, acc)
    return acc / l
