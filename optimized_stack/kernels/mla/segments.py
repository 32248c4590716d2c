"""MLA for every segment of a forward_batch at once (engine toggle prefill_batched_mixers).

Same contract as the op-table slot `mla_segments`: (attn, layer index, x [T, D], bounds [(a, b)],
states [RequestState]) -> [T, D], each segment's rows, cache rows and projected K/V bit-identical to
its own call (model/model.py _mixer: `forward_projected` where the state keeps projected K/V, else
`forward`). The token-wise work (the cache rows' projection and norm, kv_b_proj of the new rows, the
queries, the output gate, o_proj) runs on all T rows at once; every one is row-invariant, so a row
has its own bits beside other segments' rows (kernels/kda/segments.py says why this matters: a
prefill step over many prompts is host-bound). Attention stays per segment, over that segment's
rows, through the op slots its own call would take.

Shape letters: T rows of all segments, D hidden, H heads, C = n + r, Vd v dim, R cache row width,
S a segment's rows so far.
"""
from __future__ import annotations

import torch

from ...model.mla import MLAttention, blocked_attention
from ...model.ops import OPS, sigmoid


def mla_segments(attn: MLAttention, layer_index: int, x: torch.Tensor, bounds: list[tuple[int, int]],
                 states: list) -> torch.Tensor:
    """MLAttention.forward / forward_projected for every segment (module docstring): x [T, D] -> [T, D];
    each state's mla[layer_index] (and mla_kv[layer_index] where it keeps projected K/V) extended."""
    cfg, lin = attn.cfg, OPS.linear
    h, nope = cfg.num_heads, cfg.qk_nope_head_dim
    new_rows = attn.cache_rows(x)                                                   # [T, R]
    q = attn.queries(x)                                                             # [T, H, C]
    projected = [st.mla_kv is not None for st in states]
    cache_dtype = states[0].mla[layer_index].dtype          # the rows' dtype the projection reads
    new_kv = attn.project(new_rows.to(cache_dtype)) if any(projected) else None
    outs = []
    for (a, b), st, keeps_kv in zip(bounds, states, projected):
        cache = st.mla[layer_index]
        start = cache.shape[0]
        rows = torch.cat([cache, new_rows[a:b].to(cache.dtype)], 0)                 # [S, R]
        q_pos = torch.arange(start, start + b - a, device=x.device)
        st.mla[layer_index] = rows
        if not keeps_kv:
            outs.append(attn.attend(q[a:b], rows, q_pos))
            continue
        kv = st.mla_kv.get(layer_index)
        have = 0 if kv is None else kv.shape[0]
        fresh = new_kv[a:b] if cache.dtype == cache_dtype else attn.project(rows[start:])
        if have < start:                      # cached rows never projected: project them, as its call does
            fresh = torch.cat([attn.project(rows[have:start]), fresh], 0)
        kv = fresh if kv is None else torch.cat([kv.to(fresh.dtype), fresh], 0)
        st.mla_kv[layer_index] = kv
        fast = attn._over_rows(b - a)
        if fast is not None:                  # a kernel toggle owns attention: give it rows
            outs.append(fast(attn, q[a:b], rows, q_pos))
            continue
        kv3 = kv.view(rows.shape[0], h, nope + cfg.v_head_dim)
        k_rope = rows[:, cfg.kv_lora_rank:].unsqueeze(1).expand(-1, h, -1)
        k, v = torch.cat([kv3[..., :nope], k_rope], -1), kv3[..., nope:]
        attn_op = OPS.attention or blocked_attention
        outs.append(attn_op(q[a:b], k, v, q_pos, cfg.qk_head_dim ** -0.5))
    o = torch.cat(outs)                                                             # [T, H, Vd] fp32
    if cfg.mla_output_gate:
        o = o * sigmoid(lin(x, attn.g_proj.weight).float()).view_as(o)
    return lin(o.reshape(x.shape[0], -1).to(x.dtype), attn.o_proj.weight)
