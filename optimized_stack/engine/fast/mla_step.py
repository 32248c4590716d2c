"""One MLA decode token for B requests at once, over the paged cache (rows and projected K/V).

The reference (model/mla.py MLAttention.forward_projected, one request, T = 1): the new cache
row, its kv_b_proj projection, the query, attention over every row so far (decompressed K/V
from the projected cache), the output gate and o_proj. Here the token-wise ops run on the B rows
(row-invariant), the new row and its projection are written into the pools through each
request's block table, and attention reads the pools through the tables:
- the reference decode attention (OPS.attention and OPS.mla_decode empty): the batched paged
  forms of engine/fast/paged_attention.py (CPU) and kernels/mla/paged.py (CUDA, invariant
  profile), bitwise the reference's blocked arithmetic;
- a kernel toggle's decode op with a batched paged form in PAGED_FORMS, or its attention op with
  one in ATTENTION_PAGED_FORMS: that form;
- any other op in the slots: the op itself one request at a time on the rows it expects
  (correct, slow, not capturable).

Shape letters: B rows, H heads, C = n + r, Vd, L latent, R = L + r, W = H*(n+Vd), N*bs pool rows,
P max blocks per request.
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch

from ...kernels.mla.absorbed import mla_absorbed
from ...kernels.mla.flash_bf16 import flash_bf16_attention
from ...model import ops
from ...model.mla import MLAttention, blocked_attention
from ...model.ops import OPS, sigmoid
from ...toggles import base_form, count_call
from .absorbed_step import paged_absorbed
from .paged_attention import paged_attention_cpu

# a kernel toggle's decode op (OPS.mla_decode) -> its batched paged form, which the fast step (and
# its graphs) runs instead: (layer, q [B, H, C], pool, tables, table_slot, pos) -> [B, H, Vd] fp32
PAGED_FORMS: dict[Callable, Callable] = {mla_absorbed: paged_absorbed}


def paged_flash_bf16(layer: MLAttention, q, pool: "PagedMLA", tables, table_slot, pos) -> torch.Tensor:
    """mla_flash_bf16's attention for B decode rows over the pools: each row's bits are those of its
    own call (kernels/mla/paged.py lowp_pv). One request at a time, that toggle's GSM8K decode was
    the release run's second-longest unit (118 s of 176 on k3-mini, H100 run 11)."""
    from ...kernels.mla.paged import paged_decode_attention
    cfg = layer.cfg
    return paged_decode_attention(q, pool.rows, pool.kv, tables, table_slot, pos, cfg.qk_head_dim ** -0.5,
                                  nope=cfg.qk_nope_head_dim, v_dim=cfg.v_head_dim, block_size=pool.block_size,
                                  lowp_pv=True)


# a kernel toggle's attention op (OPS.attention, with OPS.mla_decode empty) -> its batched paged form
ATTENTION_PAGED_FORMS: dict[Callable, Callable] = {flash_bf16_attention: paged_flash_bf16}


def paged_form(ops_table=OPS) -> Callable | None:
    """The batched paged form the fast step runs for the MLA decode ops in force, or None: the
    reference's (both slots empty: see `attend`) or an op with none (then one request at a time)."""
    if ops_table.mla_decode is not None:
        return PAGED_FORMS.get(base_form(ops_table.mla_decode))
    if ops_table.attention is not None:
        return ATTENTION_PAGED_FORMS.get(base_form(ops_table.attention))
    return None


class PagedMLA:
    """One MLA layer's pools as the fast step reads them, plus the batch's addressing."""

    def __init__(self, rows: torch.Tensor, kv: torch.Tensor, block_size: int):
        self.rows = rows.view(-1, rows.shape[-1])          # [N*bs, R] (a view: writes land in the pool)
        self.kv = kv.view(-1, kv.shape[-1])                # [N*bs, W]
        self.block_size = block_size


def write_rows(pool: PagedMLA, tables: torch.Tensor, table_slot: torch.Tensor, pos: torch.Tensor,
               rows: torch.Tensor, kv: torch.Tensor) -> None:
    """Row pos[b] of request b (its table: tables[table_slot[b]]) <- rows[b], kv[b]."""
    bs = pool.block_size
    blk = tables[table_slot, pos // bs].long()                                    # [B]
    flat = blk * bs + pos % bs
    pool.rows.index_copy_(0, flat, rows.to(pool.rows.dtype))
    pool.kv.index_copy_(0, flat, kv.to(pool.kv.dtype))


def _reference_attention_in_force(x: torch.Tensor) -> bool:
    if OPS.attention is not None or OPS.mla_decode is not None:
        return False
    if not x.is_cuda:
        return True
    from ...kernels import gpu_reference
    return ops.gpu_reference() is gpu_reference


def attend(layer: MLAttention, q: torch.Tensor, pool: PagedMLA, tables: torch.Tensor, table_slot: torch.Tensor,
           pos: torch.Tensor) -> torch.Tensor:
    """q [B, H, C] of request b at pos[b] over its rows 0..pos[b] -> [B, H, Vd] fp32."""
    cfg = layer.cfg
    scale = cfg.qk_head_dim ** -0.5
    form = paged_form()                                     # the slots hold counting wrappers
    if form is not None:
        count_call(OPS.mla_decode if OPS.mla_decode is not None else OPS.attention)
        return form(layer, q, pool, tables, table_slot, pos)
    if not _reference_attention_in_force(q):
        return _one_by_one(layer, q, pool, tables, table_slot, pos)
    if q.is_cuda:
        from ...kernels.mla.paged import paged_decode_attention
        return paged_decode_attention(q, pool.rows, pool.kv, tables, table_slot, pos, scale,
                                      nope=cfg.qk_nope_head_dim, v_dim=cfg.v_head_dim,
                                      block_size=pool.block_size)
    return paged_attention_cpu(q, pool.rows, pool.kv, tables.index_select(0, table_slot), pos, scale,
                               nope=cfg.qk_nope_head_dim, v_dim=cfg.v_head_dim, block_size=pool.block_size)


def packed_rows(pool: PagedMLA, tables: torch.Tensor, table_slot: torch.Tensor, pos: torch.Tensor,
                lengths: list[int], kv: bool = False) -> torch.Tensor:
    """Every request's first lengths[b] = pos[b] + 1 rows, request after request: [sum, R] (or [sum, W]).
    Request b's slice holds the values a gather of its own rows would (a gather copies exactly), in one
    gather for the batch, not one index build and gather per request."""
    n = pos.long() + 1                                                          # lengths, on the device
    req = torch.repeat_interleave(torch.arange(len(lengths), device=pos.device), n, output_size=sum(lengths))
    p = torch.arange(sum(lengths), device=pos.device) - (torch.cumsum(n, 0) - n)[req]          # row in its request
    bs = pool.block_size
    flat = tables[table_slot[req], p // bs].long() * bs + p % bs
    return (pool.kv if kv else pool.rows)[flat]


def _one_by_one(layer: MLAttention, q, pool: PagedMLA, tables, table_slot, pos) -> torch.Tensor:
    """forward_projected's attention for each request alone, with the ops in force. The requests' rows
    are gathered for the batch at once (packed_rows); the op is called per request on its slice."""
    cfg = layer.cfg
    h, nope, lat = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    lengths = [p + 1 for p in pos.tolist()]
    starts = [0, *itertools.accumulate(lengths)][:-1]
    all_rows = packed_rows(pool, tables, table_slot, pos, lengths)
    all_kv = None if OPS.mla_decode is not None else packed_rows(pool, tables, table_slot, pos, lengths, kv=True)
    outs = []
    for b, (a, n) in enumerate(zip(starts, lengths)):
        rows = all_rows[a:a + n]
        q_pos = pos[b:b + 1]
        if OPS.mla_decode is not None:
            outs.append(OPS.mla_decode(layer, q[b:b + 1], rows, q_pos))
            continue
        kv3 = all_kv[a:a + n].view(n, h, nope + cfg.v_head_dim)
        k_rope = rows[:, lat:].unsqueeze(1).expand(-1, h, -1)
        k, v = torch.cat([kv3[..., :nope], k_rope], -1), kv3[..., nope:]
        attn = OPS.attention or blocked_attention
        outs.append(attn(q[b:b + 1], k, v, q_pos, cfg.qk_head_dim ** -0.5))
    return torch.cat(outs)


def mla_decode(layer: MLAttention, x: torch.Tensor, pool: PagedMLA, tables: torch.Tensor,
               table_slot: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """forward_projected for one token of each of B requests: x [B, D] -> [B, D]; the new rows
    are written into the pools at pos (their block tables: tables[table_slot])."""
    cfg, lin = layer.cfg, OPS.linear
    new_rows = layer.cache_rows(x).to(pool.rows.dtype)                          # [B, R]
    new_kv = layer.project(new_rows)                                            # [B, W]
    write_rows(pool, tables, table_slot, pos, new_rows, new_kv)                 # before attending: it sees itself
    o = attend(layer, layer.queries(x), pool, tables, table_slot, pos)
    if cfg.mla_output_gate:
        o = o * sigmoid(lin(x, layer.g_proj.weight).float()).view_as(o)
    return lin(o.reshape(x.shape[0], -1).to(x.dtype), layer.o_proj.weight)
