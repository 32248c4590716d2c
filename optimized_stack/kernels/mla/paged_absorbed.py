"""Absorbed MLA decode over the paged latent cache in Triton: each cached row read once.

    q_lat [B, H, L] (q_nope with kv_b_proj's K half folded in), q_rope [B, H, r],
    rows [N*bs, L + r] (the cache rows [latent | k_rope]), tables [slots, P], slot [B], pos [B]
    -> o_lat [B, H, L] fp32 (the caller folds kv_b_proj's V half in: o = o_lat @ W_uv^T per head)

One program per request holds every head (BLOCK_H >= 16 rows for the tensor-core dot) and walks
its keys in fixed blocks of BLOCK_N = 32 positions, in order, through the block table, with one
online softmax: a row of the cache is loaded once per request for all heads, instead of once per
head as (kv_nope | v) in the decompressed form (kernels/mla/paged.py). The split is a fixed size,
never a count, and nothing depends on the other requests: batch-invariant. Not the reference's
arithmetic (absorbed weights, P rounded to the cache dtype for the PV dot): the `mla_absorbed`
toggle's contract is approx.

Cost per request and step: (pos+1) * (L + r) * itemsize bytes; 2 * H * (pos+1) * (2L + r) FLOPs.
Shape letters: B requests, H heads, L kv_lora_rank, r rope width, P max blocks per request.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gpu_reference import check_runnable, fail, interpreting

BLOCK_N = 32                    # keys per block: the fixed split size


@triton.jit
def _paged_absorbed_kernel(ql_ptr, qr_ptr, rows_ptr, table_ptr, slot_ptr, pos_ptr, o_ptr,
                           H, LAT, ROPE, scale, s_ql_b, s_ql_h, s_qr_b, s_qr_h, s_row, s_tab, so_b, so_h,
                           BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    h_ok, l_ok, r_ok = offs_h < H, offs_l < LAT, offs_r < ROPE
    pos_b = tl.load(pos_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    ql = tl.load(ql_ptr + b * s_ql_b + offs_h[:, None] * s_ql_h + offs_l[None, :],
                 mask=h_ok[:, None] & l_ok[None, :], other=0.0)                     # [BH, BL]
    qr = tl.load(qr_ptr + b * s_qr_b + offs_h[:, None] * s_qr_h + offs_r[None, :],
                 mask=h_ok[:, None] & r_ok[None, :], other=0.0)                     # [BH, BR]
    if IEEE:                    # fp32 rows, or the interpreter (its bf16 dot multiplies raw bits)
        ql, qr = ql.to(tl.float32), qr.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    n_blocks = (pos_b + BLOCK_N) // BLOCK_N
    for j in range(0, n_blocks):
        offs_s = j * BLOCK_N + offs_n
        s_ok = offs_s <= pos_b
        phys = tl.load(table_ptr + slot * s_tab + offs_s // BS, mask=s_ok, other=0).to(tl.int64) * BS + offs_s % BS
        lat = tl.load(rows_ptr + phys[:, None] * s_row + offs_l[None, :],
                      mask=s_ok[:, None] & l_ok[None, :], other=0.0)               # [BN, BL]
        rope = tl.load(rows_ptr + phys[:, None] * s_row + LAT + offs_r[None, :],
                       mask=s_ok[:, None] & r_ok[None, :], other=0.0)              # [BN, BR]
        if IEEE:
            lat, rope = lat.to(tl.float32), rope.to(tl.float32)
            sc = tl.dot(ql, tl.trans(lat), input_precision="ieee") + tl.dot(qr, tl.trans(rope), input_precision="ieee")
        else:
            sc = tl.dot(ql, tl.trans(lat)) + tl.dot(qr, tl.trans(rope))
        sc = tl.where(s_ok[None, :], sc * scale, float("-inf"))                    # [BH, BN]
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))        # every block has a key <= pos: finite
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, lat, input_precision="ieee")
        else:
            pv = tl.dot(p.to(lat.dtype), lat)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * so_b + offs_h[:, None] * so_h + offs_l[None, :], out, mask=h_ok[:, None] & l_ok[None, :])


def paged_absorbed_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor,
                             slot: torch.Tensor, pos: torch.Tensor, scale: float, *, block_size: int) -> torch.Tensor:
    """q_lat [B, H, L] and q_rope [B, H, r] in rows' dtype; rows [N*bs, L + r]; tables [slots, P];
    slot, pos [B] -> o_lat [B, H, L] fp32. Values of slot / pos / tables are not read on the host."""
    if q_lat.dim() != 3 or q_rope.dim() != 3 or q_lat.shape[:2] != q_rope.shape[:2]:
        fail(f"q_lat and q_rope must be [B, H, L] and [B, H, r], got {list(q_lat.shape)} and {list(q_rope.shape)}")
    b_len, h, lat = q_lat.shape
    rope = q_rope.shape[-1]
    if rows.dim() != 2 or rows.shape[1] != lat + rope:
        fail(f"rows must be [N*bs, L + r] = [N*bs, {lat + rope}], got shape {list(rows.shape)}")
    if q_lat.dtype != rows.dtype or q_rope.dtype != rows.dtype:
        fail(f"q_lat and q_rope must have rows' dtype {rows.dtype}, got {q_lat.dtype} and {q_rope.dtype}")
    if rows.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        fail(f"rows must be bfloat16, float16 or float32, got {rows.dtype}")
    check_runnable(q_lat=q_lat, q_rope=q_rope, rows=rows, tables=tables, slot=slot, pos=pos)
    out = torch.empty(b_len, h, lat, dtype=torch.float32, device=rows.device)
    if b_len == 0:
        return out
    q_lat, q_rope = q_lat.contiguous(), q_rope.contiguous()
    ieee = rows.dtype == torch.float32 or interpreting()
    _paged_absorbed_kernel[(b_len,)](
        q_lat, q_rope, rows, tables, slot, pos, out, h, lat, rope, float(scale),
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), rows.stride(0), tables.stride(0),
        out.stride(0), out.stride(1),
        BS=block_size, BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_N=BLOCK_N,
        BLOCK_L=max(16, triton.next_power_of_2(lat)), BLOCK_R=max(16, triton.next_power_of_2(rope)),
        IEEE=ieee, num_warps=8 if lat >= 256 else 4, num_stages=1)
    return out
