"""FP8 (float8_e4m3fn) with one fp32 scale per row: the storage form the FP8 toggles share
(moe_fp8_stage2, mla_fp8_prefill, mla_fp8_prefill_scaled, dcp_fp8_allgather).

    scale = amax(|x| over the row) / 448        (448: e4m3fn's largest finite value)
    q     = e4m3(x / scale)                     (round to nearest even; |x / scale| <= 448)
    x'    = q * scale                           (fp32)

Error of one value (e4m3: 3 mantissa bits, normals from 2^-6, subnormal spacing 2^-9): a
normal value rounds within half its ulp, at most 2^-4 of itself; a value under 2^-6 (in the
scaled domain) rounds within half the subnormal spacing, 2^-10. Back in x's units:
    |x - x'| <= max(2^-4 * |x|, 2^-10 * scale)    (plus fp32's 2^-24 on the divide and multiply)
A row-wise scale keeps that bound relative to the row's own amax; a per-tensor scale (one
amax for all rows, the mutants' fault) pushes a small row into the subnormals, where its
relative error grows without bound.

Runs wherever torch casts to float8_e4m3fn (CPU since 2.1, CUDA): the cast is the point of
these toggles, so the same code is their CUDA form. mla_fp8_prefill_scaled hands `quantize_rows`'
values and scales to torch._scaled_mm as its row-wise scales (kernels/mla/fp8_prefill_scaled.py).

Faults (seeded mutants only): "dequant_scale_x2" dequantizes with amax/224 (twice the scale
it quantized with), "per_tensor" uses one scale for the whole tensor, "row_shifted_scale"
dequantizes row i with row i-1's scale (an off-by-one in the scale index; row 0 takes the last).
"""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
FAULTS = ("dequant_scale_x2", "per_tensor", "row_shifted_scale")


def row_scales(x: torch.Tensor, row_dims: int, *, per_tensor: bool = False) -> torch.Tensor:
    """fp32 scales, one per row: x's first `row_dims` dims index rows, the rest is the row.
    Shape [*x.shape[:row_dims], 1, ..., 1] (broadcasts against x). A zero row gets scale 1."""
    if not 0 < row_dims < x.dim():
        raise ValueError(f"row_dims must be in 1..{x.dim() - 1} for a {x.dim()}-d tensor, got {row_dims}")
    mag = x.detach().float().abs()
    if per_tensor:
        amax = mag.amax().reshape([1] * x.dim())
    else:
        amax = mag.amax(dim=tuple(range(row_dims, x.dim())), keepdim=True)
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def quantize_rows(x: torch.Tensor, row_dims: int = 1, *, per_tensor: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (q float8_e4m3fn, scale fp32) with x ~= q * scale (see the module docstring)."""
    scale = row_scales(x, row_dims, per_tensor=per_tensor)
    # clamp: x / scale can land a hair above 448 through fp32 rounding; e4m3fn has no inf
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def fp8_roundtrip(x: torch.Tensor, row_dims: int = 1, fault: str | None = None) -> torch.Tensor:
    """x through FP8 storage and back, fp32: what a consumer of the stored form reads."""
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"fp8 fault must be one of {FAULTS}, got {fault!r}")
    q, scale = quantize_rows(x, row_dims, per_tensor=fault == "per_tensor")
    if fault == "dequant_scale_x2":
        scale = scale * 2.0
    elif fault == "row_shifted_scale":
        scale = scale.flatten(0, row_dims - 1).roll(1, 0).view(scale.shape)
    return dequantize(q, scale)
