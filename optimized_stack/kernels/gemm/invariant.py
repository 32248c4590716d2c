"""Batch-invariant GEMM in Triton: y = x @ w.T, the bits of a row independent of the batch.

Why a row's bits cannot depend on M (the number of rows in the call) or on the row's place
in it:
- one tile config per input dtype and weight (TILES, or SMALL_N_TILES for a weight of few rows),
  fixed before M is known and never autotuned, so the same kernel computes every output tile
  whatever the batch;
- each output tile reduces over K in the same BLOCK_K steps, in ascending order, into one
  fp32 accumulator: no split-K, no stream-K, no atomics;
- an element of the tile is computed by the same instruction sequence whatever row of the
  tile it lands in; rows past M are masked loads of 0 that only feed their own (never
  stored) rows of the product;
- M is not specialised (`do_not_specialize`): Triton would otherwise compile a separate
  kernel for M == 1 and for M % 16 == 0; here one compiled kernel serves every M;
- fp32 inputs take tl.dot(input_precision="ieee"): fp32 FMAs, never TF32; bf16 / fp16
  inputs take the tensor-core dot with fp32 accumulation. The result is rounded once, to
  x's dtype, when the tile is stored.

Cost per call: 2*M*N*K FLOPs; bytes read (M*K + ceil(M/BLOCK_M)*N*K) * itemsize (the weight
is re-read once per row tile; M <= BLOCK_M reads it once), written M*N * itemsize.

Triton's interpreter (TRITON_INTERPRET=1, how CI runs this on a CPU) multiplies bf16 tiles
as their raw uint16 bits (triton 3.6.0, runtime/interpreter.py create_dot: measured garbage,
1e10 off), so there the bf16 tiles are widened to fp32 before the dot (UPCAST): the CPU run
proves the tiling, masking and K order; the tensor-core arithmetic is the GPU run's.

Shape letters: M rows, K reduction width, N output features.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gpu_reference import check_runnable, interpreting, fail

# dtype -> (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Chosen per dtype only, never
# per shape: a config that followed M would break invariance (the negative control in
# tests/test_triton_gemm.py picks BLOCK_K by M and is caught).
TILES: dict[torch.dtype, tuple[int, int, int, int, int]] = {
    torch.bfloat16: (64, 128, 64, 4, 3),
    torch.float16: (64, 128, 64, 4, 3),
    torch.float32: (32, 64, 32, 4, 2),
}
# fp32 weights of at most SMALL_N rows (the MoE router: N = the number of experts). With the tile
# above the grid is cdiv(M, 32) x 1 programs and one program's serial K loop sets the time: 61 us
# at M = 64, 256 and 2,112 alike on the H200, twelve a k3-small decode step, 0.73 of its 5.07 device
# ms (NOTES.md 2026-12-02, step_kernels.txt). A 16 x 16 tile gives a program 8x less work and 4-8x
# the programs. Chosen by the weight's shape, never by M, so rows stay batch-invariant; and on CUDA
# Triton's IEEE fp32 dot is one FMA chain per output element in ascending K (NOTES.md 2026-12-01: the
# K grouping did not change the bits on the H200), so an element's bits do not depend on the tile
# at all there (tests/test_triton_gemm.py checks it on a GPU; the interpreter's numpy dot is not
# that chain, so CI checks only the invariance).
# BLOCK_K 128, from the device probe (perf/gpu_probes.py router_tiles, H100, K 768, N 32, 2026-12-07):
# 33.5 / 33.8 / 33.2 us at M = 64 / 256 / 2,112, against 61.2 / 60.2 / 60.4 for the default tile and
# 57.3 / 32.1 / 36.3 for 16 x 16 x 32; every candidate bitwise the default tile's output.
SMALL_N = 64
SMALL_N_TILES: dict[torch.dtype, tuple[int, int, int, int, int]] = {
    torch.float32: (16, 16, 128, 4, 2),
}


def tiles_for(dtype: torch.dtype, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for x of `dtype` times a weight of n rows."""
    if n <= SMALL_N and dtype in SMALL_N_TILES:
        return SMALL_N_TILES[dtype]
    return TILES[dtype]


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 row/column offsets: M*N and N*K pass 2^31 for a long prefill through the lm_head
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    col_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):                       # ascending K, one accumulator
        kk = k0 + offs_k
        k_ok = kk < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)       # [BM, BK]
        b = tl.load(w_ptr + offs_n[None, :] * stride_wn + kk[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)       # [BK, BN]
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y,
             mask=row_ok[:, None] & col_ok[None, :])


def matmul(x: torch.Tensor, w: torch.Tensor, *, _block_k_by_rows: bool = False,
           _tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x's dtype; fp32 accumulation, fixed tiles.

    `_block_k_by_rows` is the negative control only: BLOCK_K follows M (16 for M < 8, else
    the fixed one), the kind of per-shape choice an autotuner makes; it changes the order
    in which a row's K products are summed and must be caught by the invariance test.
    `_tiles` overrides the tile config (the GPU probe that times and compares tile choices)."""
    if x.dim() != 2:
        fail(f"x must be 2-D [M, K], got shape {list(x.shape)}")
    if w.dim() != 2:
        fail(f"w must be 2-D [N, K], got shape {list(w.shape)}")
    if x.shape[1] != w.shape[1]:
        fail(f"x [M, K] and w [N, K] must share K, got x {list(x.shape)} and w {list(w.shape)}")
    if x.dtype not in TILES:
        fail(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if w.dtype != x.dtype:
        fail(f"w must have x's dtype {x.dtype}, got {w.dtype}")
    check_runnable(x=x, w=w)
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    x, w = x.contiguous(), w.contiguous()
    bm, bn, bk, warps, stages = _tiles or tiles_for(x.dtype, n)
    if _block_k_by_rows and m < 8:
        bk = 16
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    upcast = interpreting() and x.dtype != torch.float32
    _matmul_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=x.dtype == torch.float32 or upcast,
                         UPCAST=upcast,
                         num_warps=warps, num_stages=stages)
    return y
