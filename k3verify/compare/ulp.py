"""ULP distance between floats of one dtype, and its histogram (compare/tensors.py reports both).

ULP distance maps each float's bits to an integer that preserves the order of
the real line (sign-magnitude -> two's complement, with -0 and +0 both at 0),
so adjacent floats are 1 apart, -tiny vs +tiny is 2 apart and +inf sits one
past the largest finite value. NaN vs a number has distance ULP_MAX.
"""
from __future__ import annotations

import torch

# Distance reported for NaN vs a number, and the saturation value for float64.
ULP_MAX = torch.iinfo(torch.int64).max

# Integer view with the same width as each float dtype.
INT_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):  # present in every torch we support, but be safe
    if hasattr(torch, _name):
        INT_VIEW[getattr(torch, _name)] = torch.int8

# ULP histogram edges: 0 | 1 | 2-3 | 4-7 | ... | 2^19..2^20-1 | >=2^20.
_HIST_EDGES = [1 << k for k in range(21)]
HIST_LABELS = ["0"] + [
    str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi in zip(_HIST_EDGES, _HIST_EDGES[1:])
] + [f">={_HIST_EDGES[-1]}"]


def _check_float(t: torch.Tensor, name: str) -> None:
    if t.dtype not in INT_VIEW:
        known = ", ".join(str(d).removeprefix("torch.") for d in INT_VIEW)
        raise ValueError(f"{name} must be a float tensor ({known}), got {t.dtype}")


def _ordered_key(t: torch.Tensor) -> torch.Tensor:
    """int64 key with key(x) < key(y) iff x < y for non-NaN floats; -0 and +0 both map to 0."""
    bits = t.contiguous().view(INT_VIEW[t.dtype]).to(torch.int64)
    nbits = torch.finfo(t.dtype).bits
    magnitude = bits & ((1 << (nbits - 1)) - 1)  # drop the sign bit
    return torch.where(bits < 0, -magnitude, magnitude)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place, as int64 of the inputs' shape.

    NaN vs NaN with the same bits is 0; different NaN payloads get their key
    distance (non-zero); NaN vs a number is ULP_MAX. Float64 distances that do
    not fit in int64 saturate at ULP_MAX.
    """
    _check_float(a, "a")
    _check_float(b, "b")
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(
            f"ulp_distance needs equal dtype and shape, got {a.dtype}{list(a.shape)} "
            f"and {b.dtype}{list(b.shape)}"
        )
    a, b = a.detach().cpu(), b.detach().cpu()
    ka, kb = _ordered_key(a), _ordered_key(b)
    d = ka - kb  # wraps on overflow; only reachable for float64
    overflow = ((ka < 0) != (kb < 0)) & ((d < 0) != (ka < 0))
    dist = torch.where(overflow | (d == torch.iinfo(torch.int64).min), ULP_MAX, d.abs())
    one_nan = torch.isnan(a) != torch.isnan(b)
    return torch.where(one_nan, ULP_MAX, dist)


def ulp_histogram(ulps: torch.Tensor) -> list[tuple[str, int]]:
    """Counts per bin (labels in HIST_LABELS), all bins present so reports line up."""
    edges = torch.tensor(_HIST_EDGES, dtype=torch.int64)
    idx = torch.bucketize(ulps.reshape(-1), edges, right=True)
    counts = torch.bincount(idx, minlength=len(HIST_LABELS)).tolist()
    return list(zip(HIST_LABELS, counts))
