"""MLA decode attention over the paged projected-K/V cache in Triton: one query per request, its
keys and values read through the request's block table, the same 64-key blocks and the same loop
body as the contiguous reference kernel (kernels/mla/attention.py `key_block_update`).

    q [B, H, C], rows [N*bs, R] (cache rows [latent | k_rope]), kv [N*bs, H*(n+Vd)] (kv_b_proj
    of each row), tables [slots, max_blocks] int32, slot [B], pos [B] -> out [B, H, Vd] fp32

Why request b's bits equal `causal_attention(q[b:b+1], k_b, v_b, pos[b:b+1])` on its decompressed
keys k_b = [kv_nope | k_rope] and values v_b (the reference decode, kernels/gpu_reference.py):
- one program per (request, head) holds a tile of BLOCK_M queries exactly like the reference's
  one-query call: row 0 is the query, rows 1.. are masked loads of 0 with limit -1, the tile
  config is the reference's (attention.TILES, by dtype), so every tl.dot sees the same operand
  tiles as there;
- key block j holds positions 64j .. 64j+63, visited in ascending order up to the query's block,
  through the same `key_block_update`; a key's row is table[slot, p // bs] * bs + p % bs, and the
  K tile is assembled element for element from the two pools (tl.where, never a sum: -0.0 stays
  -0.0) with the values the reference's torch.cat builds; keys past pos are masked loads of 0,
  as past S there (S = pos + 1 in a decode);
- nothing is read from the host: the loop bound comes from pos in device memory, so the launch
  is CUDA-graph capturable and one compiled kernel serves every B and length.

Cost per step: each request reads (pos+1) * (H*(n+Vd) + r) * itemsize bytes once per head group
(K nope and V from kv, k_rope from rows); exp per key per head; latency-bound at short contexts.

Shape letters: B requests, H heads, C = n + r qk head dim (n nope, r rope), Vd v head dim,
L kv_lora_rank, R = L + r row width, N blocks, bs block size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gpu_reference import check_runnable, fail, interpreting
from .attention import KEY_BLOCK, PV_BF16, PV_IEEE, TILES, key_block_update


@triton.jit
def _paged_decode_kernel(q_ptr, rows_ptr, kv_ptr, table_ptr, slot_ptr, pos_ptr, o_ptr,
                         C, NOPE, VD, LAT, scale,
                         sq_b, sq_h, s_row, s_kv, s_kv_h, s_tab, so_b, so_h,
                         BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
                         IEEE: tl.constexpr, UPCAST: tl.constexpr, SHIFT_TABLE: tl.constexpr,
                         PV_MODE: tl.constexpr, WIDEN_PV: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    offs_v = tl.arange(0, BLOCK_V)
    row_ok = offs_m < 1                                   # one query per request: row 0
    c_ok = offs_c < C
    v_ok = offs_v < VD
    is_nope = offs_c < NOPE
    pos_b = tl.load(pos_ptr + b).to(tl.int32)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    pos = tl.where(row_ok, pos_b, -1)                                            # [BM]
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * 0 + offs_c[None, :],
                mask=row_ok[:, None] & c_ok[None, :], other=0.0)                 # [BM, BC]
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    S = pos_b + 1
    n_blocks = (tl.max(pos, axis=0) + BLOCK_N) // BLOCK_N
    for j in range(0, n_blocks):
        start = j * BLOCK_N
        offs_s = start + offs_n
        s_ok = offs_s < S
        tab = offs_s // BS + SHIFT_TABLE                   # SHIFT_TABLE: the negative control only
        phys = tl.load(table_ptr + slot * s_tab + tab, mask=s_ok, other=0).to(tl.int64) * BS + offs_s % BS
        k_nope = tl.load(kv_ptr + phys[None, :] * s_kv + h * s_kv_h + offs_c[:, None],
                         mask=(is_nope & c_ok)[:, None] & s_ok[None, :], other=0.0)      # [BC, BN]
        k_rope = tl.load(rows_ptr + phys[None, :] * s_row + LAT + (offs_c - NOPE)[:, None],
                         mask=(~is_nope & c_ok)[:, None] & s_ok[None, :], other=0.0)     # [BC, BN]
        kt = tl.where(is_nope[:, None], k_nope, k_rope)
        if UPCAST:
            kt = kt.to(tl.float32)
        vb = tl.load(kv_ptr + phys[:, None] * s_kv + h * s_kv_h + NOPE + offs_v[None, :],
                     mask=s_ok[:, None] & v_ok[None, :], other=0.0)                    # [BN, BV]
        if PV_MODE == PV_IEEE:                  # the V tile as the contiguous kernel makes it, per mode
            vb = vb.to(tl.float32)
        else:
            vb = vb.to(tl.bfloat16)
            if WIDEN_PV:
                vb = vb.to(tl.float32)
        m_i, l_i, acc = key_block_update(q, kt, vb, offs_s, s_ok, pos, start, m_i, l_i, acc, scale, IEEE,
                                         PV_MODE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + b * so_b + h * so_h + offs_m[:, None] * 0 + offs_v[None, :], out,
             mask=row_ok[:, None] & v_ok[None, :])


def paged_decode_attention(q: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
                           slot: torch.Tensor, pos: torch.Tensor, scale: float, *, nope: int, v_dim: int,
                           block_size: int, out: torch.Tensor | None = None, lowp_pv: bool = False,
                           _shift_table: int = 0, _block_m: int | None = None) -> torch.Tensor:
    """q [B, H, C]; rows [N*bs, R]; kv [N*bs, H*(nope+Vd)]; tables [slots, max_blocks] int32/int64;
    slot [B], pos [B] (request b's query sits at pos[b] and sees its keys 0..pos[b]) -> [B, H, Vd]
    fp32. `lowp_pv`: P @ V on bf16 tensor cores, request b's bits those of the mla_flash_bf16 toggle's
    call `causal_attention(..., lowp_pv=True)` on its own keys (the same PV_MODE through the same loop
    body); the toggle's decode then runs batched in the fast step, not one request at a time
    (engine/fast/mla_step.py). Shapes and dtypes are checked here; the values of slot / pos / tables are not read on
    the host (no sync: the caller builds them). `_shift_table` only for the negative control;
    `_block_m` only for perf/gpu_probes.py paged_tiles: a query tile of another height than the
    reference's (a decode's one query pads the tile: at B = 64 on k3-small the kernel took 184 us a
    call, 15% of the step's device time, session 23), whose bits the probe compares with these."""
    if q.dim() != 3:
        fail(f"q must be 3-D [B, H, C], got shape {list(q.shape)}")
    b_len, h, c = q.shape
    lat = rows.shape[-1] - (c - nope)
    if rows.dim() != 2 or lat <= 0:
        fail(f"rows must be [N*bs, L + {c - nope}] with L > 0, got shape {list(rows.shape)}")
    if kv.dim() != 2 or kv.shape[0] != rows.shape[0] or kv.shape[1] != h * (nope + v_dim):
        fail(f"kv must be [{rows.shape[0]}, H*(nope+Vd)] = [{rows.shape[0]}, {h * (nope + v_dim)}], "
             f"got shape {list(kv.shape)}")
    if tables.dim() != 2:
        fail(f"tables must be 2-D [slots, max_blocks], got shape {list(tables.shape)}")
    for name, t in (("slot", slot), ("pos", pos)):
        if t.dim() != 1 or t.shape[0] != b_len:
            fail(f"{name} must be 1-D [B] = [{b_len}], got shape {list(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            fail(f"{name} must be int32 or int64, got {t.dtype}")
    if q.dtype not in TILES:
        fail(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    if rows.dtype != q.dtype or kv.dtype != q.dtype:
        fail(f"rows and kv must have q's dtype {q.dtype}, got {rows.dtype} and {kv.dtype}")
    check_runnable(q=q, rows=rows, kv=kv, tables=tables, slot=slot, pos=pos)
    if out is None:
        out = torch.empty(b_len, h, v_dim, dtype=torch.float32, device=q.device)
    if b_len == 0:
        return out
    if q.stride(-1) != 1 or rows.stride(-1) != 1 or kv.stride(-1) != 1 or tables.stride(-1) != 1:
        fail("q, rows, kv and tables must be contiguous in their last dimension")
    block_m, warps, stages = TILES[q.dtype]
    block_m = _block_m or block_m
    upcast = interpreting() and q.dtype != torch.float32
    _paged_decode_kernel[(b_len, h)](
        q, rows, kv, tables, slot, pos, out, c, nope, v_dim, lat, float(scale),
        q.stride(0), q.stride(1), rows.stride(0), kv.stride(0), nope + v_dim, tables.stride(0),
        out.stride(0), out.stride(1),
        BS=block_size, BLOCK_M=block_m, BLOCK_N=KEY_BLOCK,
        BLOCK_C=max(16, triton.next_power_of_2(c)), BLOCK_V=max(16, triton.next_power_of_2(v_dim)),
        IEEE=q.dtype == torch.float32 or upcast, UPCAST=upcast, SHIFT_TABLE=_shift_table,
        PV_MODE=(PV_BF16 if lowp_pv else PV_IEEE).value, WIDEN_PV=interpreting(),
        num_warps=warps, num_stages=stages)
    return out
