"""Row reductions in Triton, batch-invariant: RMSNorm, L2 norm, row sum and row dot.

Why a row's bits cannot depend on how many rows share the call, or where the row sits:
- one program per row; the row count only sets the grid, never a block size;
- a row is read in chunks of BLOCK_D, which depends on D alone (the width of the op); each
  chunk is added into one fp32 vector accumulator in ascending order, which is reduced once
  at the end by tl.sum: the same reduction tree for every row of every call;
- fp32 throughout; the only roundings to a narrower dtype are the ones the reference
  spells out (ops.py rms_norm: normalise in fp32, cast back to x's dtype, then times the gain).

Cost per row of width D: RMSNorm reads x twice and the gain once, writes once, ~4D FLOPs
(bytes 2*D*x.itemsize + D*w.itemsize + D*y.itemsize); L2 norm the same without the gain;
row sum / row dot read x (and y) once and write one fp32. Memory-bound: the kernels run at
the rate the rows can be streamed.

Shape letters: M rows, D width.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gpu_reference import check_runnable, fail

MAX_BLOCK_D = 1024      # widest chunk a program holds; wider rows loop over chunks
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def block_d(d: int) -> int:
    """The chunk width for rows of width d: a function of d alone (never of the row count)."""
    return min(triton.next_power_of_2(max(d, 1)), MAX_BLOCK_D)


def _warps(block: int) -> int:
    return 4 if block >= 512 else (2 if block >= 256 else 1)


@triton.jit
def _sum_squares(x_row, D, BLOCK_D: tl.constexpr):
    offs = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):                     # ascending chunks, one accumulator
        xv = tl.load(x_row + d0 + offs, mask=d0 + offs < D, other=0.0).to(tl.float32)
        acc += xv * xv
    return tl.sum(acc, axis=0)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps,
                     HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    rstd = tl.rsqrt(_sum_squares(x_row, D, BLOCK_D) / D + eps)
    offs = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        m = d0 + offs < D
        xv = tl.load(x_row + d0 + offs, mask=m, other=0.0).to(tl.float32)
        y = (xv * rstd).to(x_ptr.dtype.element_ty)      # cast back to x's dtype ...
        if HAS_W:                                       # ... then times the gain
            wv = tl.load(w_ptr + d0 + offs, mask=m, other=0.0).to(tl.float32)
            out = y.to(tl.float32) * wv
        else:
            out = y
        tl.store(y_row + d0 + offs, out.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _l2_norm_kernel(x_ptr, y_ptr, D, stride_x, stride_y, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    rnorm = tl.rsqrt(_sum_squares(x_row, D, BLOCK_D) + eps)
    offs = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        m = d0 + offs < D
        xv = tl.load(x_row + d0 + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_row + d0 + offs, (xv * rnorm).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _row_dot_kernel(x_ptr, z_ptr, out_ptr, D, stride_x, stride_z,
                    HAS_Z: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        m = d0 + offs < D
        xv = tl.load(x_ptr + row * stride_x + d0 + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_Z:
            zv = tl.load(z_ptr + row * stride_z + d0 + offs, mask=m, other=0.0).to(tl.float32)
            xv = xv * zv
        acc += xv
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


def _rows(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    if x.dim() != 2:
        fail(f"{name} must be 2-D [M, D], got shape {list(x.shape)}")
    if x.dtype not in FLOATS:
        fail(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    return x.contiguous()


def _block(d: int, override: int | None) -> int:
    return override if override is not None else block_d(d)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                  _block_d: int | None = None) -> torch.Tensor:
    """ops.rms_norm per row of x [M, D]: x * rsqrt(mean(x^2) + eps) in fp32, cast to x's dtype,
    times weight [D] (result in promote(x, weight) dtype, as torch's `y * weight`).
    `_block_d` only for the negative control (a chunk width that follows the row count)."""
    x = _rows(x)
    m, d = x.shape
    if weight is not None:
        if weight.dim() != 1 or weight.shape[0] != d:
            fail(f"weight must be 1-D [D] = [{d}], got shape {list(weight.shape)}")
        if weight.dtype not in FLOATS:
            fail(f"weight must be bfloat16, float16 or float32, got {weight.dtype}")
        check_runnable(x=x, weight=weight)
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        weight = weight.contiguous()
    else:
        check_runnable(x=x)
        out_dtype = x.dtype
    y = torch.empty(m, d, dtype=out_dtype, device=x.device)
    if m == 0 or d == 0:
        return y
    blk = _block(d, _block_d)
    _rms_norm_kernel[(m,)](x, weight if weight is not None else x, y, d, x.stride(0), y.stride(0),
                           float(eps), HAS_W=weight is not None, BLOCK_D=blk, num_warps=_warps(blk))
    return y


def l2_norm_rows(x: torch.Tensor, eps: float = 1e-6, *, _block_d: int | None = None) -> torch.Tensor:
    """ops.l2_norm per row of x [M, D]: x * rsqrt(sum x^2 + eps) in fp32, in x's dtype."""
    x = _rows(x)
    check_runnable(x=x)
    m, d = x.shape
    y = torch.empty_like(x)
    if m == 0 or d == 0:
        return y
    blk = _block(d, _block_d)
    _l2_norm_kernel[(m,)](x, y, d, x.stride(0), y.stride(0), float(eps), BLOCK_D=blk,
                          num_warps=_warps(blk))
    return y


def row_dot(x: torch.Tensor, z: torch.Tensor | None = None, *,
            _block_d: int | None = None) -> torch.Tensor:
    """sum_D(x * z) per row of x, z [M, D] in fp32 (z None: the row sum) -> [M] fp32."""
    x = _rows(x)
    m, d = x.shape
    if z is not None:
        z = _rows(z, "z")
        if z.shape != x.shape:
            fail(f"z must have x's shape {list(x.shape)}, got {list(z.shape)}")
        check_runnable(x=x, z=z)
    else:
        check_runnable(x=x)
    out = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    if d == 0:
        return out.zero_()
    blk = _block(d, _block_d)
    _row_dot_kernel[(m,)](x, z if z is not None else x, out, d, x.stride(0),
                          (z if z is not None else x).stride(0), HAS_Z=z is not None, BLOCK_D=blk,
                          num_warps=_warps(blk))
    return out


def row_sum(x: torch.Tensor, *, _block_d: int | None = None) -> torch.Tensor:
    """sum_D(x) per row of x [M, D] in fp32 -> [M] fp32."""
    return row_dot(x, None, _block_d=_block_d)
