"""The batched paged form of the `mla_absorbed` toggle's decode op (kernels/mla/absorbed.py), so
the toggle runs inside the fast step (and its CUDA graphs) instead of one request at a time.

kv_b_proj's K half is folded into each query (q_lat = q_nope W_uk, per head) and its V half into
the output (o = o_lat W_uv^T); attention runs over the latent cache rows [latent | k_rope]
directly, each row read once for every head. CUDA: kernels/mla/paged_absorbed.py (q in the cache
dtype, fixed 32-key blocks). CPU: the same in torch over the gathered rows (fp32, one softmax,
as kernels/mla/absorbed.py). Approx like the toggle (different summation order from the
decompressed reference); batch-invariant (a request's rows and its own reductions only).

Shape letters: B rows, H heads, n nope, r rope, L latent, Vd v head dim, S keys.
"""
from __future__ import annotations

import torch


def _weights(layer) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = layer.cfg
    h, n, lr, vd = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    w = layer.kv_b_proj.weight.float().view(h, n + vd, lr)           # per head [k_nope | v] rows
    return w[:, :n], w[:, n:]                                          # [H, n, L], [H, Vd, L]


def paged_absorbed(layer, q: torch.Tensor, pool, tables: torch.Tensor, table_slot: torch.Tensor,
                   pos: torch.Tensor) -> torch.Tensor:
    """q [B, H, n+r] of request b at pos[b] over its latent rows 0..pos[b] -> [B, H, Vd] fp32."""
    cfg = layer.cfg
    n, lr = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    scale = cfg.qk_head_dim ** -0.5
    w_uk, w_uv = _weights(layer)
    q_lat = torch.einsum("bhn,hnl->bhl", q[..., :n].float(), w_uk)                # [B, H, L]
    if q.is_cuda:
        from ...kernels.mla.paged_absorbed import paged_absorbed_attention
        dtype = pool.rows.dtype
        o_lat = paged_absorbed_attention(q_lat.to(dtype), q[..., n:].to(dtype), pool.rows, tables, table_slot, pos,
                                         scale, block_size=pool.block_size)
    else:
        o_lat = _absorbed_cpu(q_lat, q[..., n:].float(), pool, tables.index_select(0, table_slot), pos, lr, scale)
    return torch.einsum("bhl,hvl->bhv", o_lat, w_uv)


def _absorbed_cpu(q_lat, q_rope, pool, tables, pos, lr: int, scale: float) -> torch.Tensor:
    s_len = int(pos.max()) + 1
    p = torch.arange(s_len)
    blk = (p // pool.block_size).clamp(max=tables.shape[1] - 1)
    flat = tables.index_select(1, blk).long() * pool.block_size + p % pool.block_size          # [B, S]
    rows = pool.rows[flat].float()                                                         # [B, S, R]
    lat, rope = rows[..., :lr], rows[..., lr:]
    scores = (torch.einsum("bhl,bsl->bhs", q_lat, lat) + torch.einsum("bhr,bsr->bhs", q_rope, rope)) * scale
    visible = (p.view(1, 1, -1) <= pos.view(-1, 1, 1))
    attn = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("bhs,bsl->bhl", attn, lat)
