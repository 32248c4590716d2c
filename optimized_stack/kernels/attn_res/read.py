"""The AttnRes read fused per token in Triton, batch-invariant (model/attn_res.py AttnResRead.mix).

    V = candidates [N+1, T, D]                       (snapshots, then the partial sum)
    score_i = sum_D(rmsnorm(V_i) * norm_w * proj_w)  = rsqrt(mean(V_i^2) + eps) * sum_D(V_i * q),
                                                       q = norm_w * proj_w (fp32, [D])
    p = softmax over the N+1 scores;  out = p_0 V_0 + p_1 V_1 + ... + p_N V_N   (raw V, fp32)

Why a token's bits cannot depend on how many tokens share the call, or where it sits:
- one program per token; the token count only sets the grid;
- the chunk width BLOCK_D depends on D alone and the candidate block NC_P2 on N alone; each
  candidate's two sums (V^2 and V*q) add chunks in ascending order into fp32 vector
  accumulators reduced once; the softmax runs over the token's own N+1 scores;
- the weighted sum visits the candidates in their fixed order 0..N for every chunk.
The fused score (rstd times the dot) rounds differently from the reference's
normalise-then-dot; within ~1 ulp, and the same for every token.

Cost per token: reads the N+1 candidate rows twice (scores, then the mix) and q once:
2*(N+1)*D*itemsize + 4*D bytes, writes D*itemsize; ~6*(N+1)*D FLOPs. The unfused reference
materialises [N+1, T, D] fp32 twice more (the normalised copy and the products).

Shape letters: N snapshots, T tokens, D hidden.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gpu_reference import check_runnable, fail
from ..norm.rows import FLOATS, block_d


@triton.jit
def _attn_res_read_kernel(v_ptr, q_ptr, out_ptr, NC, D, stride_c, stride_t, stride_o, eps,
                          NC_P2: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    cand = tl.arange(0, NC_P2)
    scores = tl.full([NC_P2], float("-inf"), dtype=tl.float32)
    row = v_ptr + t * stride_t                              # candidate i's row: advanced by stride_c
    for i in range(0, NC):                                  # candidate scores, in order
        ss = tl.zeros([BLOCK_D], dtype=tl.float32)
        dq = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            m = d0 + offs < D
            v = tl.load(row + d0 + offs, mask=m, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + d0 + offs, mask=m, other=0.0)
            ss += v * v
            dq += v * q
        score = tl.sum(dq, axis=0) * tl.rsqrt(tl.sum(ss, axis=0) / D + eps)
        scores = tl.where(cand == i, score, scores)
        row += stride_c
    e = tl.exp(scores - tl.max(scores, axis=0))             # padding candidates: exp(-inf) = 0
    p = e / tl.sum(e, axis=0)
    for d0 in range(0, D, BLOCK_D):                         # out = sum_i p_i V_i, i ascending
        m = d0 + offs < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        row = v_ptr + t * stride_t
        for i in range(0, NC):
            p_i = tl.sum(tl.where(cand == i, p, 0.0), axis=0)      # exact: one non-zero term
            v = tl.load(row + d0 + offs, mask=m, other=0.0)
            acc += p_i * v.to(tl.float32)
            row += stride_c
        tl.store(out_ptr + t * stride_o + d0 + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


def attn_res_read(vals: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float, *,
                  _block_d: int | None = None) -> torch.Tensor:
    """vals [N+1, T, D] (snapshots, then the partial sum), norm_w [D], proj_w [1, D] or [D]
    -> [T, D] in vals' dtype. `_block_d` only for the negative control."""
    if vals.dim() != 3:
        fail(f"candidates must be 3-D [N+1, T, D], got shape {list(vals.shape)}")
    if vals.dtype not in FLOATS:
        fail(f"candidates must be bfloat16, float16 or float32, got {vals.dtype}")
    nc, t_len, d = vals.shape
    if nc == 0:
        fail("candidates must hold at least one [T, D] tensor, got N+1 = 0")
    if norm_w.numel() != d or norm_w.dim() != 1:
        fail(f"norm_w must be 1-D [D] = [{d}], got shape {list(norm_w.shape)}")
    if proj_w.numel() != d or proj_w.dim() not in (1, 2):
        fail(f"proj_w must be [1, D] or [D] with D = {d}, got shape {list(proj_w.shape)}")
    check_runnable(candidates=vals, norm_w=norm_w, proj_w=proj_w)
    vals = vals.contiguous()
    query = (norm_w.float() * proj_w.float().reshape(-1)).contiguous()      # [D] fp32
    out = torch.empty(t_len, d, dtype=vals.dtype, device=vals.device)
    if t_len == 0 or d == 0:
        return out
    blk = _block_d if _block_d is not None else block_d(d)
    _attn_res_read_kernel[(t_len,)](vals, query, out, nc, d, vals.stride(0), vals.stride(1),
                                    out.stride(0), float(eps), NC_P2=triton.next_power_of_2(nc),
                                    BLOCK_D=blk, num_warps=4 if blk >= 512 else 2)
    return out
