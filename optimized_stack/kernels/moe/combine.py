"""The static-capacity experts' combine (engine/fast/moe_static.py `_combine`) in one Triton launch.

`_combine` forms each row's output as the reference MoE.routed does: from zeros, add w * out of
each chosen expert in ascending expert index, in fp32. In torch that is ~2k + 4 kernels per MoE
layer (the products, a sort, then k gathers and k adds), ~20 at top-8: with 12 MoE layers ~240
of a k3-small decode step's ~1,100 small kernels on the H200. Here: the sort, and one launch.

Bit-identical to `_combine`: the same fp32 product w * out per chosen expert, rounded once, and
the same fp32 additions in the same order, starting from +0.0 (so -0.0 products come out as
+0.0 in both). Triton contracts a multiply feeding an add into one FMA (one rounding instead of
two) unless told not to: the launch passes enable_fp_fusion=False.

One program per (row, column block). Shape letters: T rows, k experts per row, E experts,
D width of the experts' output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gpu_reference import check_runnable, fail

BLOCK_D = 128


@triton.jit
def _combine_kernel(out_ptr, order_ptr, idx_ptr, pos_ptr, w_ptr, y_ptr, D,
                    stride_oe, stride_ot, stride_it, stride_wt, stride_yt,
                    TOPK: tl.constexpr, KEEP: tl.constexpr, SLOT_ORDER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    y = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(KEEP):   # KEEP = TOPK; TOPK - 1 is the seeded fault (the highest expert left out)
        if SLOT_ORDER:     # the seeded fault: the chosen experts added in slot order, not expert order
            s = j
        else:
            s = tl.load(order_ptr + row * TOPK + j)          # the j-th lowest expert's slot
        e = tl.load(idx_ptr + row * stride_it + s)
        p = tl.load(pos_ptr + row * TOPK + s)
        wt = tl.load(w_ptr + row * stride_wt + s).to(tl.float32)
        o = tl.load(out_ptr + e * stride_oe + p * stride_ot + cols, mask=mask, other=0.0)
        y = y + wt * o
    tl.store(y_ptr + row * stride_yt + cols, y, mask=mask)


def fused_combine(out: torch.Tensor, pos: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                  *, slot_order: bool = False, drop_last: bool = False) -> torch.Tensor:
    """out [E, T, D] fp32 (expert e's output for its buffer row p at out[e, p]), pos [T*k] (the
    buffer row of each (row, slot), moe_static.placement), idx [T, k] experts, w [T, k] weights ->
    y [T, D] fp32: per row, zeros + w * out in ascending expert index. Seeded faults: `slot_order`
    (mut_fused_combine_slot_order: the same sum in router order, other roundings from three experts
    a row up) and `drop_last` (mut_fused_combine_drops_last: each row's highest expert left out)."""
    check_runnable(out=out, pos=pos, idx=idx, w=w)
    if out.dtype != torch.float32 or out.dim() != 3:
        fail(f"fused_combine: out must be fp32 [E, T, D], got {out.dtype} {tuple(out.shape)}")
    n_tok, top_k = idx.shape
    if w.shape != idx.shape or pos.shape != (n_tok * top_k,) or out.shape[1] < n_tok:
        fail(f"fused_combine: shapes disagree: out {tuple(out.shape)}, pos {tuple(pos.shape)}, idx "
             f"{tuple(idx.shape)}, w {tuple(w.shape)}")
    if out.stride(2) != 1 or idx.stride(1) != 1 or w.stride(1) != 1 or not pos.is_contiguous():
        fail("fused_combine: out's last axis, idx's and w's slot axis and pos must be contiguous")
    order = torch.sort(idx, dim=1, stable=True).indices.contiguous()     # slots by expert id
    d = out.shape[2]
    y = torch.empty(n_tok, d, dtype=torch.float32, device=out.device)
    grid = (n_tok, triton.cdiv(d, BLOCK_D))
    _combine_kernel[grid](out, order, idx, pos, w, y, d, out.stride(0), out.stride(1), idx.stride(0), w.stride(0),
                          y.stride(0), TOPK=top_k, KEEP=top_k - 1 if drop_last else top_k, SLOT_ORDER=slot_order, BLOCK=BLOCK_D, enable_fp_fusion=False)
    return y
