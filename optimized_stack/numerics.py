"""Machine-independent CPU reference bits: pin MKL's conditional numerical reproducibility.

torch's CPU GEMMs (`mm`, `bmm`: every linear of the reference path) run in Intel MKL,
which picks its kernels at run time by the processor it finds. Measured on the dev CPU
(Intel Xeon, AVX-512, torch 2.13.0+cpu, MKL 2024.2): with `MKL_ENABLE_INSTRUCTIONS=AVX2`
(what MKL's dispatch does on many non-Intel CPUs) the reference path's golden hashes
differ at position 0 of every scenario, the exact symptom a newcomer saw on an AMD EPYC
with the same torch, SIMD level and thread count. MKL's CNR mode fixes the code branch:
`COMPATIBLE` (SSE2 without the approximate reciprocals) is the one branch MKL documents as
giving the same results on Intel and compatible processors (AVX2 and above fall back to
MKL's own dispatch on non-Intel CPUs). On the dev CPU it costs nothing measurable: the
reference's GEMMs are 8-row tiles, dispatch-bound (NOTES.md, 2026-12-01).

The branch must be chosen before MKL's first call, so `optimized_stack` pins it at import
(ctypes into the MKL that torch links statically; the environment variable for children).
`K3_MKL_CBWR` picks another branch, or `off` to leave MKL's dispatch alone (the negative
control of tests/test_numerics_pin.py). `mkl_state()` says what is in force; the golden
hashes' numerics key and every report's fingerprint record it.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

# mkl_cbwr.h: what = MKL_CBWR_BRANCH; branch codes; status codes
_WHAT_BRANCH = 1
BRANCHES = {"OFF": 1, "AUTO": 2, "COMPATIBLE": 3, "SSE2": 4, "SSE4_2": 8, "AVX": 9, "AVX2": 10,
            "AVX512_MIC": 11, "AVX512": 12, "AVX512_MIC_E1": 13, "AVX512_E1": 14, "AVX512_E2": 16,
            "AVX512_E3": 17, "AVX512_E4": 18, "AVX2_E1": 19, "AVX512_E5": 20}
_NAMES = {v: k for k, v in BRANCHES.items()}
_STATUS = {0: "success", -1: "invalid settings", -2: "invalid input", -3: "branch not supported by this CPU",
           -4: "unknown branch", -8: "MKL was already in use (the branch must be set before its first call)"}
DEFAULT_BRANCH = "COMPATIBLE"
ENV = "K3_MKL_CBWR"

_state: dict[str, object] = {}


def _mkl():
    """The library exporting MKL's service functions (torch links MKL statically), or None."""
    try:
        import torch
    except ImportError:
        return None
    lib_dir = Path(torch.__file__).resolve().parent / "lib"
    for name in ("libtorch_cpu.so", "libmkl_rt.so", "libmkl_rt.so.2"):
        path = lib_dir / name
        try:
            lib = ctypes.CDLL(str(path) if path.exists() else name)
        except OSError:
            continue
        if hasattr(lib, "mkl_serv_cbwr_set"):
            for fn in ("mkl_serv_cbwr_set", "mkl_serv_cbwr_get"):
                getattr(lib, fn).argtypes = [ctypes.c_int]
                getattr(lib, fn).restype = ctypes.c_int
            lib.mkl_serv_cbwr_get_auto_branch.restype = ctypes.c_int
            return lib
    return None


def pin_mkl_branch(branch: str | None = None) -> dict[str, object]:
    """Set MKL's CNR branch (default: $K3_MKL_CBWR or COMPATIBLE; 'off' leaves MKL alone).

    Idempotent: the first call decides (MKL cannot change branch once used)."""
    if _state:
        return dict(_state)
    wanted = (branch or os.environ.get(ENV) or DEFAULT_BRANCH).strip().upper()
    lib = _mkl()
    if lib is None:
        _state.update(blas="no-mkl", requested=wanted, status="this torch has no MKL")
        return dict(_state)
    if wanted != "OFF":
        code = BRANCHES.get(wanted)
        if code is None:
            # never raise at import: the CLI turns this into its one-line error (exit 2)
            _state.update(requested=wanted, status="invalid", error=f"{ENV}: expected one of "
                          f"{', '.join(['off', *(b for b in BRANCHES if b != 'OFF')])}, got {wanted!r}", **_read(lib))
            return dict(_state)
        rc = lib.mkl_serv_cbwr_set(code)
        _state["status"] = _STATUS.get(rc, f"error {rc}")
        if rc == 0:
            os.environ.setdefault("MKL_CBWR", wanted)      # children that use MKL before importing us
    else:
        _state["status"] = f"not pinned ({ENV}=off)"
    _state["requested"] = wanted
    _state.update(_read(lib))
    return dict(_state)


def _read(lib) -> dict[str, object]:
    active = lib.mkl_serv_cbwr_get(_WHAT_BRANCH)
    auto = lib.mkl_serv_cbwr_get_auto_branch()
    name = _NAMES.get(active, str(active))
    return {"cnr_branch": name, "auto_branch": _NAMES.get(auto, str(auto)),
            # what decides the bits: a pinned branch, or MKL's own dispatch ("auto")
            "blas": "mkl-auto" if name in ("OFF", "AUTO") else f"mkl-{name.lower()}"}


def mkl_state() -> dict[str, object]:
    """{'blas': 'mkl-compatible' | 'mkl-auto' | 'no-mkl', 'cnr_branch', 'auto_branch', 'status', 'requested'}
    (+ 'error' when $K3_MKL_CBWR names no branch)."""
    return dict(_state) if _state else pin_mkl_branch()
