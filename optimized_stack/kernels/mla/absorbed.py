"""Absorbed MLA: attention runs over the cache rows directly (MQA, one latent KV head).

kv_b_proj's K half is folded into the query and its V half into the output, so no
per-token K/V is ever decompressed; a decode step reads each cache row once. Equal to the
decompressed reference only to rounding (different summation order): an `approx` toggle.

Shape letters: T queries, S cache rows, H heads, L kv_lora_rank, r rope width,
n qk_nope_head_dim, Vd v_head_dim.
"""
from __future__ import annotations

import torch


def mla_absorbed(layer, q: torch.Tensor, rows: torch.Tensor, q_pos: torch.Tensor,
                 _scale_mult: float = 1.0) -> torch.Tensor:
    """Same contract as MLAttention.attend: q [T, H, n+r], rows [S, L+r] -> [T, H, Vd] fp32.

    `_scale_mult` exists only for the seeded wrong-scale mutant (see toggle_defs)."""
    cfg = layer.cfg
    h, n, lr, vd = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    w = layer.kv_b_proj.weight.float().view(h, n + vd, lr)            # per head [k_nope | v] rows
    w_uk, w_uv = w[:, :n], w[:, n:]                                    # [H, n, L], [H, Vd, L]
    q = q.float()
    lat, k_rope = rows[:, :lr].float(), rows[:, lr:].float()          # [S, L], [S, r]
    q_lat = torch.einsum("thn,hnl->thl", q[..., :n], w_uk)            # absorb W_uk into q
    scores = (torch.einsum("thl,sl->ths", q_lat, lat)
              + torch.einsum("thr,sr->ths", q[..., n:], k_rope)) * (cfg.qk_head_dim ** -0.5 * _scale_mult)
    visible = torch.arange(rows.shape[0], device=q.device).view(1, 1, -1) <= q_pos.view(-1, 1, 1)
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    o_lat = torch.einsum("ths,sl->thl", p, lat)                        # attend in latent space
    return torch.einsum("thl,hvl->thv", o_lat, w_uv)                   # absorb W_uv into output
