"""The batched decode step's causal conv for one token of B requests, fused in one Triton kernel.

engine/fast/kda_step.py `conv_step` (the reference's semantics, model/kda.py causal_conv for
T = 1) runs ~10 torch kernels per conv: gather the windows, cast, concatenate, W multiplies,
W - 1 adds, cast back, scatter the new windows. Three convs per KDA layer make it ~270 kernels of a
k3-small decode step (9 KDA layers), a quarter of the step's ~1,100 small kernels on the H200
(golden/reports/gpu-2026-12-01-h200-engine/step_kernels.txt). Here it is one launch per conv.

Bit-identical to conv_step by construction: every value goes through the same roundings in the
same order. torch's bf16 elementwise ops compute in fp32 and round each result to bf16 (round to
nearest even); so does this kernel, explicitly (in fp32 registers that hold the rounded values):
    y = round(win_0 * w_0);  y = round(y + round(win_j * w_j)) for j = 1 .. W-1 (ascending)
with win_{W-1} the new input. The product of two bf16 values is exact in fp32, so the first
rounding is torch's; the explicit rounding between the multiply and the add also keeps the
compiler from contracting them into an FMA (which would round once). That argument needs a
narrower output dtype, so the kernel takes bf16 / fp16 inputs only (the GPU profile's); fp32
stays on conv_step.

One program per (row, channel block). The window moves left by one in place, tap j + 1 read
before tap j is written, all within the program that owns those columns of that slot. Padding rows share the spare slot and race on it, which is
harmless: the spare slot holds no request's state and padding rows' outputs are dropped (as with
conv_step's index_copy_ of repeated slots).

Shape letters: B rows, C channels, W taps, P pool slots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gpu_reference import check_runnable, fail

NARROW = (torch.bfloat16, torch.float16)
BLOCK_C = 128


@triton.jit
def _round(v, OUT: tl.constexpr):
    """fp32 -> OUT (bf16 / fp16), rounded to nearest even, as fp32 again. bf16 is rounded on the
    bits: Triton's interpreter (how CI runs this) truncates an fp32 -> bf16 cast where torch and
    the GPU round to nearest even, so the rounding is spelled out; NaN passes through."""
    if OUT == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        up = bits + 0x7FFF + ((bits >> 16) & 1)
        kept = tl.where(v != v, bits, up & -65536)            # -65536 == 0xFFFF0000
        return kept.to(tl.float32, bitcast=True)
    else:
        return v.to(OUT).to(tl.float32)


@triton.jit
def _tap(x, win_ptr, w_ptr, cols, mask, stride_pw, stride_wc, J: tl.constexpr, TAPS: tl.constexpr,
         OUT: tl.constexpr):
    """round(win_J * w_J) (fp32 holding an OUT value): tap J of the window, the last tap x itself."""
    if J == TAPS - 1:
        v = x
    else:
        v = _round(tl.load(win_ptr + J * stride_pw, mask=mask, other=0.0).to(tl.float32), OUT)
    w = tl.load(w_ptr + cols * stride_wc + J, mask=mask, other=0.0).to(tl.float32)
    return _round(v * w, OUT)


@triton.jit
def _conv_step_kernel(x_ptr, pool_ptr, slots_ptr, w_ptr, y_ptr, C,
                      stride_xb, stride_pp, stride_pw, stride_wc, stride_yb,
                      TAPS: tl.constexpr, BLOCK: tl.constexpr, REVERSED: tl.constexpr, STALE: tl.constexpr,
                      OUT: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < C
    slot = tl.load(slots_ptr + row)
    win_ptr = pool_ptr + slot * stride_pp + cols
    x = tl.load(x_ptr + row * stride_xb + cols, mask=mask, other=0.0).to(tl.float32)   # exact: x is OUT
    # conv_step's order: tap 0 times its weight, then each later tap's product added in turn,
    # every product and every partial sum rounded to OUT (fp32 values that OUT holds exactly)
    if REVERSED:          # the seeded fault: the taps summed from the newest down
        y = _tap(x, win_ptr, w_ptr, cols, mask, stride_pw, stride_wc, TAPS - 1, TAPS, OUT)
        for i in tl.static_range(1, TAPS):
            y = _round(y + _tap(x, win_ptr, w_ptr, cols, mask, stride_pw, stride_wc, TAPS - 1 - i, TAPS, OUT), OUT)
    else:
        y = _tap(x, win_ptr, w_ptr, cols, mask, stride_pw, stride_wc, 0, TAPS, OUT)
        for j in tl.static_range(1, TAPS):
            y = _round(y + _tap(x, win_ptr, w_ptr, cols, mask, stride_pw, stride_wc, j, TAPS, OUT), OUT)
    # move the window left by one; tap j + 1 is read before tap j is written, in one program
    pool_ty = pool_ptr.dtype.element_ty
    for j in tl.static_range(0, TAPS - 1):
        if j == TAPS - 2:
            tl.store(win_ptr + j * stride_pw, x.to(pool_ty), mask=mask)
        elif not STALE:   # the seeded fault stores the new input but leaves the older taps unshifted
            nxt = _round(tl.load(win_ptr + (j + 1) * stride_pw, mask=mask, other=0.0).to(tl.float32), OUT)
            tl.store(win_ptr + j * stride_pw, nxt.to(pool_ty), mask=mask)
    tl.store(y_ptr + row * stride_yb + cols, y.to(OUT), mask=mask)


def fused_conv_step(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                    *, reversed_taps: bool = False, stale_window: bool = False) -> torch.Tensor:
    """conv_step in one launch: x [B, C] (bf16/fp16), pool [P, W-1, C] (updated in place at
    `slots` [B]), weight [C, 1, W] -> y [B, C] in x's dtype. Two seeded faults:
    `reversed_taps` sums the taps newest first (the same value in exact arithmetic, other
    roundings: the kernel test's negative control); `stale_window` (mutant
    mut_fused_conv_stale_window) writes the new input but does not shift the older taps."""
    check_runnable(x=x, pool=pool, slots=slots, weight=weight)
    if x.dtype not in NARROW:
        fail(f"fused_conv_step: x must be bfloat16 or float16 (fp32 stays on conv_step), got {x.dtype}")
    if x.dim() != 2 or pool.dim() != 3 or weight.dim() != 3 or weight.shape[1] != 1:
        fail(f"fused_conv_step: expected x [B, C], pool [P, W-1, C], weight [C, 1, W]; got x "
             f"{tuple(x.shape)}, pool {tuple(pool.shape)}, weight {tuple(weight.shape)}")
    b, c = x.shape
    taps = weight.shape[-1]
    if pool.shape[1:] != (taps - 1, c) or weight.shape[0] != c or slots.shape != (b,):
        fail(f"fused_conv_step: shapes disagree: x {tuple(x.shape)}, pool {tuple(pool.shape)}, weight "
             f"{tuple(weight.shape)}, slots {tuple(slots.shape)}")
    if x.stride(1) != 1 or pool.stride(2) != 1 or weight.stride(2) != 1:
        fail("fused_conv_step: the channel axis of x and pool and the tap axis of weight must be contiguous")
    y = torch.empty_like(x)
    grid = (b, triton.cdiv(c, BLOCK_C))
    _conv_step_kernel[grid](x, pool, slots, weight, y, c, x.stride(0), pool.stride(0), pool.stride(1),
                            weight.stride(0), y.stride(0), TAPS=taps, BLOCK=BLOCK_C, REVERSED=reversed_taps,
                            STALE=stale_window, OUT=tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16)
    return y
