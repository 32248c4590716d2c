"""Causal softmax attention for MLA in Triton, batch-invariant: fixed 64-key blocks, online
softmax in block order (the contract of model/mla.py blocked_attention).

    q [T, H, C], k [S, H, C], v [S, H, Vd], q_pos [T] (query t sees keys 0..q_pos[t])
    -> out [T, H, Vd] fp32

Why a query's bits cannot depend on T, on S beyond its causal limit, or on other queries:
- keys are visited in blocks of BLOCK_N = 64, from block 0 up to the block holding the
  query's position, in ascending order, with one online-softmax state (m, l, acc) per
  query: the split is a fixed SIZE, never a count (no split-KV by S, no merge step);
- a program holds a tile of BLOCK_M queries (one config per dtype, never chosen by T) and
  loops to its furthest query's block; a block past a query's own limit leaves that query's
  (m, l, acc) untouched (tl.where on `active`), so the tile mates never show;
- inside the query's last block the keys past q_pos score -inf: p = exp(-inf) = 0, and the
  product 0 * v adds nothing (the sum's bits could change only if it were exactly -0.0,
  the reference's own caveat); keys past S are masked loads of 0;
- scores in fp32 (tl.dot of the input dtype with fp32 accumulation; fp32 inputs through
  input_precision="ieee", never TF32), P @ V in fp32 ("ieee") on P unrounded.
T and S are not specialised (`do_not_specialize`): one compiled kernel for every length.

Cost (one head, causal prefill of T queries over S = T keys): QK 2*T*S*C/2 FLOPs, PV
2*T*S*Vd/2 FLOPs (fp32 FMAs), exp T*S/2; K and V bytes re-read once per query tile:
ceil(T/BLOCK_M) * S/2 * (C + Vd) * itemsize. A decode step (T = 1) reads S*(C+Vd)*itemsize
per head in one program per head: latency-bound, as a reference may be.

Under Triton's interpreter (CI) bf16 tiles are widened to fp32 before the dot (its bf16 dot
multiplies raw bits; see kernels/gemm/invariant.py).

Shape letters: T queries, S keys, H heads, C qk head dim, Vd v head dim.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gpu_reference import check_runnable, fail, interpreting

KEY_BLOCK = 64                  # keys per block: the fixed split size
# how a key block's P @ V runs (key_block_update's PV_MODE)
PV_IEEE: tl.constexpr = tl.constexpr(0)
PV_BF16: tl.constexpr = tl.constexpr(1)
PV_BF16_DIAG_UNMASKED: tl.constexpr = tl.constexpr(2)
BLOCK: tl.constexpr = tl.constexpr(KEY_BLOCK)
# dtype -> (BLOCK_M queries per program, num_warps, num_stages); never a function of T or S
TILES: dict[torch.dtype, tuple[int, int, int]] = {
    torch.bfloat16: (32, 4, 2),
    torch.float16: (32, 4, 2),
    torch.float32: (16, 4, 1),      # fp32 K and V tiles: one stage keeps shared memory < 100 KB
}


@triton.jit
def key_block_update(q, kt, vb, offs_s, s_ok, pos, start, m_i, l_i, acc, scale, IEEE: tl.constexpr,
                     PV_MODE: tl.constexpr):
    """One 64-key block of the online softmax for a tile of queries: the loop body shared by the
    contiguous kernel below and the paged decode kernel (kernels/mla/paged.py), so the two run the
    same operations in the same order on the same tile shapes.

    q [BM, BC] (input dtype), kt [BC, BN] (q's dtype), vb [BN, BV] fp32, offs_s [BN] key positions,
    s_ok [BN] keys that exist, pos [BM] each query's causal limit (-1: no query), start = the
    block's first position; (m_i [BM], l_i [BM], acc [BM, BV]) fp32 in and out.
    PV_MODE: PV_IEEE (the reference: P @ V in fp32, vb fp32); PV_BF16 (the mla_flash_bf16 toggle's
    form, never the reference's bits): P rounded to bf16 and P @ V on bf16 tensor cores with fp32
    accumulation, vb holding bf16 values (widened to fp32 under the interpreter, whose dot then
    multiplies the same bf16 values exactly); PV_BF16_DIAG_UNMASKED: PV_BF16 with a seeded fault (the
    mutant mut_mla_flash_diag_unmasked), the causal mask dropped inside a block: a query sees the
    later keys of its own block."""
    if IEEE:
        sc = tl.dot(q, kt, input_precision="ieee")
    else:
        sc = tl.dot(q, kt)
    sc = sc * scale                                                          # [BM, BN] fp32
    if PV_MODE == PV_BF16_DIAG_UNMASKED:
        visible = (offs_s[None, :] < start + BLOCK) & s_ok[None, :] & (pos[:, None] >= 0)
    else:
        visible = (offs_s[None, :] <= pos[:, None]) & s_ok[None, :]
    sc = tl.where(visible, sc, float("-inf"))
    active = start <= pos                  # the query sees at least one key of this block
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_use = tl.where(active, m_new, 0.0)   # inactive rows: keep exp() finite, result unused
    alpha = tl.exp(m_i - m_use)            # first block: exp(-inf) = 0
    p = tl.exp(sc - m_use[:, None])        # masked keys: exactly 0
    if PV_MODE != PV_IEEE:
        p_lo = p.to(tl.bfloat16)
        if vb.dtype == tl.float32:                      # the interpreter's widened tiles
            pv = tl.dot(p_lo.to(tl.float32), vb, input_precision="ieee")
        else:
            pv = tl.dot(p_lo, vb)
    else:
        pv = tl.dot(p, vb, input_precision="ieee")
    l_new = l_i * alpha + tl.sum(p, axis=1)
    acc_new = acc * alpha[:, None] + pv
    m_i = tl.where(active, m_new, m_i)
    l_i = tl.where(active, l_new, l_i)
    acc = tl.where(active[:, None], acc_new, acc)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["T", "S"])
def _causal_attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, T, S, C, VD, scale,
                             sq_t, sq_h, sk_s, sk_h, sv_s, sv_h, so_t, so_h,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_V: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                             PV_MODE: tl.constexpr, WIDEN_PV: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)      # int64: S*H*C can pass 2^31
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    offs_v = tl.arange(0, BLOCK_V)
    row_ok = offs_m < T
    c_ok = offs_c < C
    v_ok = offs_v < VD
    pos = tl.load(pos_ptr + offs_m, mask=row_ok, other=-1).to(tl.int32)       # [BM]
    q = tl.load(q_ptr + offs_m[:, None] * sq_t + h * sq_h + offs_c[None, :],
                mask=row_ok[:, None] & c_ok[None, :], other=0.0)                # [BM, BC]
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    n_blocks = (tl.max(pos, axis=0) + BLOCK_N) // BLOCK_N      # up to the tile's furthest limit
    for j in range(0, n_blocks):
        start = j * BLOCK_N                                                      # int32 scalar
        offs_s = start + offs_n
        s_ok = offs_s < S
        kt = tl.load(k_ptr + offs_s[None, :] * sk_s + h * sk_h + offs_c[:, None],
                     mask=c_ok[:, None] & s_ok[None, :], other=0.0)             # [BC, BN]
        if UPCAST:
            kt = kt.to(tl.float32)
        vb = tl.load(v_ptr + offs_s[:, None] * sv_s + h * sv_h + offs_v[None, :],
                     mask=s_ok[:, None] & v_ok[None, :], other=0.0)                 # [BN, BV]
        if PV_MODE == PV_IEEE:
            vb = vb.to(tl.float32)
        else:
            vb = vb.to(tl.bfloat16)
            if WIDEN_PV:                  # the interpreter: bf16 values in fp32 tiles (see above)
                vb = vb.to(tl.float32)
        m_i, l_i, acc = key_block_update(q, kt, vb, offs_s, s_ok, pos, start, m_i, l_i, acc, scale, IEEE,
                                         PV_MODE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + offs_m[:, None] * so_t + h * so_h + offs_v[None, :], out,
             mask=row_ok[:, None] & v_ok[None, :])


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     scale: float, *, _block_n: int | None = None, lowp_pv: bool = False,
                     _fault: str | None = None) -> torch.Tensor:
    """q [T, H, C], k [S, H, C], v [S, H, Vd], q_pos [T] (0 <= q_pos < S) -> [T, H, Vd] fp32.

    lowp_pv: P @ V on bf16 tensor cores (the mla_flash_bf16 toggle; not the reference's bits).
    `_block_n` only for the negative control: a key block that follows the call's shape.
    `_fault` only for the mutant: "diag_unmasked"."""
    if _fault not in (None, "diag_unmasked") or (_fault and not lowp_pv):
        fail(f"_fault must be None, or 'diag_unmasked' with lowp_pv, got {_fault!r}")
    if q.dim() != 3:
        fail(f"q must be 3-D [T, H, C], got shape {list(q.shape)}")
    if k.dim() != 3 or k.shape[1:] != q.shape[1:]:
        fail(f"k must be [S, H, C] = [S, {q.shape[1]}, {q.shape[2]}], got shape {list(k.shape)}")
    if v.dim() != 3 or v.shape[:2] != k.shape[:2]:
        fail(f"v must be [S, H, Vd] = [{k.shape[0]}, {k.shape[1]}, Vd], got shape {list(v.shape)}")
    if q_pos.dim() != 1 or q_pos.shape[0] != q.shape[0]:
        fail(f"q_pos must be 1-D [T] = [{q.shape[0]}], got shape {list(q_pos.shape)}")
    if q_pos.dtype not in (torch.int32, torch.int64):
        fail(f"q_pos must be int32 or int64, got {q_pos.dtype}")
    if q.dtype not in TILES:
        fail(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    if k.dtype != q.dtype:
        fail(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    if v.dtype not in TILES:
        fail(f"v must be bfloat16, float16 or float32, got {v.dtype}")
    check_runnable(q=q, k=k, v=v, q_pos=q_pos)
    t_len, h, c = q.shape
    s_len, vd = k.shape[0], v.shape[-1]
    out = torch.empty(t_len, h, vd, dtype=torch.float32, device=q.device)
    if t_len == 0:
        return out
    lo, hi = int(q_pos.min()), int(q_pos.max())
    if lo < 0 or hi >= s_len:
        fail(f"q_pos must lie in 0..S-1 = 0..{s_len - 1}, got {lo if lo < 0 else hi}")
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    q_pos = q_pos.contiguous()
    block_m, warps, stages = TILES[q.dtype]
    upcast = interpreting() and q.dtype != torch.float32
    grid = (triton.cdiv(t_len, block_m), h)
    _causal_attention_kernel[grid](
        q, k, v, q_pos, out, t_len, s_len, c, vd, float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=_block_n or KEY_BLOCK,
        BLOCK_C=max(16, triton.next_power_of_2(c)), BLOCK_V=max(16, triton.next_power_of_2(vd)),
        IEEE=q.dtype == torch.float32 or upcast, UPCAST=upcast,
        PV_MODE=(PV_IEEE if not lowp_pv else PV_BF16_DIAG_UNMASKED if _fault == "diag_unmasked" else PV_BF16).value,
        WIDEN_PV=interpreting(), num_warps=warps, num_stages=stages)
    return out

