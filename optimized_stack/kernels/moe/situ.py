"""The routed experts' SiTU-GLU activation (model/ops.py `situ`) in one Triton launch, bit-identical
to the torch formula on CUDA.

`situ(gate, up, beta, lb)` is `beta * tanh(g / beta) * sigmoid(g) * (lb * tanh(u / lb))` on the fp32
casts g, u of gate and up, cast back to gate's dtype. On CUDA with bf16 inputs that is 12 torch
kernels over [rows, F] (two casts in, the two divisions, two tanh, the sigmoid, four multiplies, the
cast out), each reading and writing the whole tensor. Here: one launch, gate and up read once, the output
written once.

What torch runs for each step on CUDA, read in PyTorch's source (aten/src/ATen/native/cuda/), and
what this kernel runs in its place, in the same order (Python evaluates the formula left to right:
((beta * tanh(g * inv_b)) * sigmoid(g)) * (lb * tanh(u * inv_lb))):
- `g / beta`, beta a Python float (a CPU scalar): BinaryDivTrueKernel.cu does not divide. For a
  CPU-scalar divisor it takes the reciprocal once on the host in the op-math type,
  `inv_b = opmath_t(1.0) / scalar_value<opmath_t>(2)` (a float division of 1 by beta cast to
  float), and runs a MulFunctor: one rounded fp32 multiply `g * inv_b` per element. Here inv_b is
  the same fp32 quotient, computed on the host in numpy float32, passed as an fp32 argument.
- `torch.tanh` (UnaryGeometricTanhKernel.cu): `::tanh(a)` on the float, i.e. CUDA's `tanhf`,
  compiled without fast math. Here libdevice's `__nv_tanhf` (triton.language.extra.libdevice.tanh).
- `beta * t` and each product (BinaryMulKernel.cu): a MulFunctor in the op-math type, one rounded
  fp32 multiply; a Python scalar is cast to float first. Here fp32 multiplies. torch rounds each
  one in its own kernel, so the launch passes enable_fp_fusion=False: no multiply of this kernel
  is contracted into an FMA with an add (kernels/moe/combine.py, the same reason).
- `torch.sigmoid` (UnarySpecialOpsKernel.cu, real dtypes): `scalar_t{1} / (scalar_t{1} +
  std::exp(-a))` on the float: CUDA's accurate `expf` and an IEEE round-to-nearest division
  (nvcc's default -prec-div=true). Here libdevice's `__nv_expf` (not tl.exp: Triton lowers that to
  ex2.approx of x * log2(e)) and tl.math.div_rn (div.rn.f32; Triton's `/` on fp32 is div.full,
  an approximate division).
- `.to(bfloat16)`: c10::BFloat16(float) is `__float2bfloat16` on sm_80+ (cvt.rn.bf16.f32), round
  to nearest even; c10's portable form is the same rounding on the bits (U32 + 0x7FFF + the kept
  lsb). Here that rounding on the bits (kernels/kda/conv_step.py `_round`: Triton's interpreter
  truncates an fp32 -> bf16 cast), then an exact cast. fp16 outputs round to nearest even in both.
- denormals: PyTorch's kernels are built without -ftz, so `tanhf` / `expf` keep subnormal inputs
  and results; Triton links libdevice with its flush-to-zero paths unless told not to (option
  enable_reflect_ftz, default on: __nv_tanhf's polynomial would flush a subnormal argument to 0),
  so the launch passes enable_reflect_ftz=False.
- FMA contraction inside the math functions: nvcc contracts by default (-fmad=true) where torch's
  sigmoid kernel runs expf and the add in one kernel. Read in libdevice.10.bc (Triton 3.6's copy,
  llvm-dis): __nv_tanhf and __nv_expf write their own FMAs as fma intrinsics and have no
  multiply feeding an add; the one such pair is __nv_expf's last step, ex2.approx(f) * 2^j, into
  sigmoid's `1 + e`, and that product is exact unless subnormal, where 1 + e is 1 either way. So
  contracted or not, the bits agree there.
What this argument does not settle, only the GPU can: that the libdevice Triton links (CUDA 12.8's
tools ship with Triton 3.6; the device's torch 2.11 is built with CUDA 13.0) computes tanhf and
expf as the toolkit PyTorch was built with does. tests/test_triton_situ.py's GPU test and the
toggle's exact verdict check it bit for bit.

Triton's interpreter (how CI runs this on the CPU) has no libdevice: there `tanh` comes from exp in
fp64 and `exp` is numpy's, so the interpreter checks the kernel's structure, order and strides
against the torch formula within a few ULP, never its bits (tests/test_triton_situ.py).

Prediction (not measured yet): at decode the static experts' activation of one MoE layer goes
from 12 launches to 1, 11 fewer per MoE layer, 132 fewer a k3-small step (12 MoE layers) of its
~1,550. At a 32K-token prefill on k3-small (sorted experts: [T * k, F] = [131,072, 384] per MoE
layer, 12 layers, bf16) the torch form moves ~98 bytes an element (bf16 -> fp32 casts 6 + 6, nine
fp32 elementwise passes of 8 or 12, the cast out 6), ~59 GB in all; this kernel moves 6 (two bf16
reads, one bf16 write), ~3.6 GB: ~20 ms -> ~1.2 ms of device time at 3 TB/s. The shared experts'
and the dense layer's activations (~27% of a prefill's SiTU elements) keep the torch form.

Shape letters: R rows (every leading dim of gate flattened), F expert width.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..gpu_reference import check_runnable, fail, interpreting
from ..kda.conv_step import _round

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FAULTS = ("fast_exp", "no_linear_beta")
ELEMS = 2048           # elements a program: BLOCK_R rows of BLOCK_F columns
MAX_BLOCK_F = 128
# no FMA contraction, libdevice without its flush-to-zero paths (module docstring); tests/
# test_triton_situ.py compiles the kernel for sm_90 with these and reads the PTX
LAUNCH = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


@triton.jit
def _tanh(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        # no libdevice in the interpreter: tanh from exp in fp64 (no cancellation left that fp32
        # can see) for |x| in [2^-12, 10]; below, tanh(x) rounds to x in fp32; above, to +-1
        x64 = tl.minimum(tl.maximum(x.to(tl.float64), -10.0), 10.0)
        e = tl.exp(2.0 * x64)
        t = ((e - 1.0) / (e + 1.0)).to(tl.float32)
        return tl.where(tl.abs(x) < 0.000244140625, x, t)
    else:
        return libdevice.tanh(x)


@triton.jit
def _exp(x, FAST_EXP: tl.constexpr, INTERPRET: tl.constexpr):
    if FAST_EXP or INTERPRET:     # FAST_EXP: the seeded fault, ex2.approx on the GPU
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _situ_kernel(gate_ptr, up_ptr, out_ptr, n_rows, width, stride_gr, stride_gc, stride_ur, stride_uc, stride_or,
                 beta, inv_beta, linear_beta, inv_linear_beta, OUT: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_F: tl.constexpr, FAST_EXP: tl.constexpr, NO_LINEAR_BETA: tl.constexpr,
                 INTERPRET: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
    r = rows.to(tl.int64)[:, None]          # R * F can pass 2^31 at a long prefill
    c = cols[None, :]
    g = tl.load(gate_ptr + r * stride_gr + c * stride_gc, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + r * stride_ur + c * stride_uc, mask=mask, other=0.0).to(tl.float32)
    a = beta * _tanh(g * inv_beta, INTERPRET)                        # beta * tanh(g / beta)
    s = tl.math.div_rn(1.0, 1.0 + _exp(-g, FAST_EXP, INTERPRET))     # sigmoid(g)
    a = a * s
    b = _tanh(u * inv_linear_beta, INTERPRET)
    if not NO_LINEAR_BETA:       # NO_LINEAR_BETA: the seeded fault, tanh(u / lb) unscaled
        b = linear_beta * b
    y = a * b
    tl.store(out_ptr + r * stride_or + c, _round(y, OUT).to(OUT), mask=mask)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _scalar(name: str, value: float) -> float:
    v = float(value)
    if not np.isfinite(np.float32(v)) or v == 0.0:
        fail(f"fused_situ: {name} must be a finite non-zero number, got {value!r}")
    return v


def fused_situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float, *,
               fault: str | None = None) -> torch.Tensor:
    """model/ops.py situ in one launch: gate, up [..., F] (bf16 / fp16 / fp32, any strides) -> [..., F]
    in gate's dtype, contiguous. `fault` is a seeded fault: "fast_exp" (mut_fused_situ_fast_exp:
    tl.exp's ex2.approx in the sigmoid, a few ULP that only the GPU shows) or "no_linear_beta"
    (mut_fused_situ_no_linear_beta: the up half's lb * tanh(u / lb) loses its lb)."""
    check_runnable(gate=gate, up=up)
    if gate.dtype not in DTYPES or up.dtype != gate.dtype:
        fail(f"fused_situ: gate and up must share one of bfloat16, float16, float32, got {gate.dtype} and {up.dtype}")
    if gate.shape != up.shape or gate.dim() == 0:
        fail(f"fused_situ: gate and up must have one shape [..., F], got {tuple(gate.shape)} and {tuple(up.shape)}")
    if fault is not None and fault not in FAULTS:
        fail(f"fused_situ: fault must be None or one of {', '.join(FAULTS)}, got {fault!r}")
    beta, linear_beta = _scalar("beta", beta), _scalar("linear_beta", linear_beta)
    width = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    g2, u2 = gate.reshape(-1, width), up.reshape(-1, width)       # [R, F]: a view wherever the dims merge
    n_rows = g2.shape[0]
    # torch's reciprocals: 1 / float(beta) in float, once, on the host (module docstring)
    one = np.float32(1.0)
    inv_beta = float(one / np.float32(beta))
    inv_linear_beta = float(one / np.float32(linear_beta))
    block_f = min(triton.next_power_of_2(width), MAX_BLOCK_F)
    block_r = ELEMS // block_f
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(width, block_f))
    _situ_kernel[grid](g2, u2, out, n_rows, width, g2.stride(0), g2.stride(1), u2.stride(0), u2.stride(1), width,
                       beta, inv_beta, linear_beta, inv_linear_beta, OUT=_TL[gate.dtype], BLOCK_R=block_r,
                       BLOCK_F=block_f, FAST_EXP=fault == "fast_exp", NO_LINEAR_BETA=fault == "no_linear_beta",
                       INTERPRET=interpreting(), **LAUNCH)
    return out

