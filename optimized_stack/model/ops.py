"""Row-stable primitives of the reference path, and the op table toggles swap.

Row-stable means: the bits of one output row depend only on that row's inputs, never
on how many other rows share the call. That is what lets scheduling toggles
(continuous batching, chunked prefill, prefix reuse, speculation) be bit-exact
against the whole-prompt reference.

Why it is needed (measured on the 2-core dev CPU, torch 2.13.0+cpu): fp32
`x @ W.T` gives different bits for a row when the batch has 1-3 rows than when it
has 8+, and for large K even 8/9/16/17/64 rows differ from 300 rows. A GEMM whose
shape is always the same gives the same bits per row, whatever the row's position
in the tile (checked for tiles of 8: every row, every offset, K up to 1024). So
`row_linear` pads rows to tiles of 8 and runs one batched GEMM of shape [8, K] x
[K, N] per tile.

Transcendentals (exp, sigmoid, silu, tanh, softplus) have the same problem in another
form: torch's vectorised loop handles the last (numel mod 32) elements with the scalar
libm function, whose bits differ from the SIMD one (measured: sigmoid of the last rows
of a [150, 4] tensor differs from the same rows in an [80, 4] tensor), and threads split
long tensors at arbitrary points. `_pointwise` runs them on 64-aligned, zero-padded slices
of at most 32768 elements (below torch's parallel grain), so every element goes through
the SIMD path. Correctly rounded ops (+, -, *, /, sqrt) need no such care.

Shape letters: T tokens, D hidden, N output features.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, fields
from typing import Callable, Iterator

import torch

ROW_TILE = 8  # rows per fixed-shape GEMM tile; see module docstring
# Output features are padded to a multiple of this with zero weight rows. Under MKL's
# pinned COMPATIBLE branch (optimized_stack/numerics.py) a single-tile `mm` and a multi-tile
# `bmm` give a row different bits when N is not a multiple of 16 (measured on the dev CPU:
# N = 1, 2, 8, 12, 24, 40 at every K tried; 16, 32, 48, 64, ... never), so N = 8 (the router)
# or 24 (an MLA cache row) would make decode differ from prefill. The padded columns are
# sliced off; they only make every GEMM take the full-width kernel.
COL_TILE = 16


_GPU_REFERENCE = None
_GPU_DEFAULTS = None
GPU_PROFILE_ENV = "K3_GPU_PROFILE"


def gpu_reference():
    """optimized_stack.kernels.gpu_reference: the CUDA forms of the reference primitives (the
    GPU reference profile), imported on first CUDA use; a CPU run never imports it.
    K3_GPU_PROFILE=torch hands out kernels/gpu_defaults.py instead (torch's own, NOT invariant:
    side B of the price-of-exactness measurement), read at every call so one process can
    interleave both."""
    global _GPU_REFERENCE, _GPU_DEFAULTS
    if _GPU_REFERENCE is None:
        from ..kernels import gpu_defaults, gpu_reference as module
        _GPU_REFERENCE, _GPU_DEFAULTS = module, gpu_defaults
    choice = os.environ.get(GPU_PROFILE_ENV, "invariant")
    if choice == "torch":
        return _GPU_DEFAULTS
    if choice != "invariant":
        from ..errors import K3Error
        raise K3Error(f"{GPU_PROFILE_ENV} must be 'invariant' or 'torch', got {choice!r}")
    return _GPU_REFERENCE


def row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x @ weight.T, computed so each row's bits are independent of the batch. x [.., D]."""
    if x.device.type != "cpu":
        if x.is_cuda:
            # the GPU profile: cuBLAS bf16 (row-invariant, re-proved by k3verify/invariance.py)
            # or the fixed-tile Triton GEMM (fp32, or K3_GPU_GEMM=triton); see gpu_reference.py
            return gpu_reference().linear(x, weight)
        return torch.nn.functional.linear(x, weight)
    return tiled_row_linear(x, weight)


def tiled_row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T as fixed-shape [8, D] tiles on any device: one GEMM shape whatever the
    batch, so a row's bits cannot depend on its neighbours."""
    lead, d = x.shape[:-1], x.shape[-1]
    n_out = weight.shape[0]
    if n_out % COL_TILE:
        weight = torch.cat([weight, weight.new_zeros(-n_out % COL_TILE, d)])   # [N', D]
    x2 = x.reshape(-1, d)                                  # [T, D]
    t = x2.shape[0]
    n_tiles = max(1, -(-t // ROW_TILE))
    pad = n_tiles * ROW_TILE - t
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, d)])
    if n_tiles == 1:        # decode: one tile; mm of the same [8, D] shape gives the same bits
        return torch.mm(x2, weight.t())[:t, :n_out].reshape(*lead, n_out)
    tiles = x2.view(n_tiles, ROW_TILE, d)                  # [n, 8, D]
    w_t = weight.t().unsqueeze(0).expand(n_tiles, d, weight.shape[0])   # [n, D, N']
    y = torch.bmm(tiles, w_t).reshape(n_tiles * ROW_TILE, -1)[:t, :n_out]   # [T, N]
    return y.reshape(*lead, n_out)


_LANES = 64          # pad to a multiple of this many elements: whole SIMD iterations
_SLICE = 32768       # torch's parallel grain: a slice this size runs on one thread


def _pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) with every element on the SIMD path (see module docstring)."""
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    padded = -(-n // _LANES) * _LANES
    if padded != n:
        flat = torch.cat([flat, flat.new_zeros(padded - n)])
    else:
        flat = flat.contiguous()
    out = torch.empty_like(flat)
    for i in range(0, padded, _SLICE):
        out[i:i + _SLICE] = fn(flat[i:i + _SLICE])
    return out[:n].view(x.shape)


def exp(x: torch.Tensor) -> torch.Tensor:
    return _pointwise(torch.exp, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _pointwise(torch.sigmoid, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _pointwise(torch.nn.functional.silu, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return _pointwise(torch.nn.functional.softplus, x)


def tanh(x: torch.Tensor) -> torch.Tensor:
    return _pointwise(torch.tanh, x)


def plain_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch's own GEMM, whose row bits depend on the batch it sits in: MKL on the CPU; on CUDA
    fp32 cuBLAS with TF32 allowed (bf16 cuBLAS measured row-invariant on the H200, so it would be
    no fault there). The seeded faults that need a non-invariant GEMM use this."""
    if x.is_cuda:
        matmul = torch.backends.cuda.matmul
        saved = matmul.allow_tf32
        matmul.allow_tf32 = True
        try:
            return torch.nn.functional.linear(x.float(), weight.float()).to(x.dtype)
        finally:
            matmul.allow_tf32 = saved
    return torch.nn.functional.linear(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Normalise in fp32, cast back, then multiply by the gain (used as is, no 1+w).
    On CUDA: one Triton program per row (kernels/norm/rows.py), unless autograd needs a graph."""
    if x.is_cuda and not gpu_reference().needs_autograd(x, weight):
        return gpu_reference().rms_norm(x, weight, eps)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(x.dtype)
    return y if weight is None else y * weight


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum x^2 + eps): eps inside the root on the sum of squares (as fla).
    On CUDA: one Triton program per row (kernels/norm/rows.py), unless autograd needs a graph."""
    if x.is_cuda and not gpu_reference().needs_autograd(x):
        return gpu_reference().l2_norm(x, eps)
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1, keepdim=True), row-invariant: torch's own sum on the CPU; on CUDA, where
    torch's reduction splits a row differently by the row count, one Triton program per row."""
    if x.is_cuda and not gpu_reference().needs_autograd(x):
        return gpu_reference().row_sum(x)
    return x.sum(-1, keepdim=True)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU: beta*tanh(g/beta)*sigmoid(g) * lb*tanh(u/lb), in fp32."""
    g, u = gate.float(), up.float()
    out = beta * tanh(g / beta) * sigmoid(g) * (linear_beta * tanh(u / linear_beta))
    return out.to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu(gate) * up


@dataclass
class OpTable:
    """The swappable implementations the model calls, one slot per role. None (and
    `row_linear`) is the reference; the model resolves a None slot to its own plain code.

    A toggle replaces slots with `override(...)` and the old entries come back in `finally`,
    so the model code has no fast-path `if`s. Prefill and decode are separate roles: a call
    that appends one token is a decode, anything longer a prefill (or a verify chunk).
    """

    # y = x @ W.T for every projection: x [.., D], W [N, D]
    linear: Callable[..., torch.Tensor] = row_linear
    # KDA sequence op: (q, k, v, g, beta, state) -> (o [T, H, V] fp32, state [H, K, V] fp32);
    # None: the recurrence (model/kda.py kda_recurrent)
    kda_prefill: Callable[..., object] | None = None
    kda_decode: Callable[..., object] | None = None
    # MLA attention over the cache rows: (layer, q [T, H, C], rows [S, R], q_pos [T]) -> [T, H, Vd]
    # fp32; None: decompress the rows, then `attention`
    mla_prefill: Callable[..., torch.Tensor] | None = None
    mla_decode: Callable[..., torch.Tensor] | None = None
    # causal softmax attention over decompressed K/V: (q, k, v, q_pos, scale) -> [T, H, Vd] fp32;
    # None: the blocked exact-softmax reference (model/mla.py blocked_attention)
    attention: Callable[..., torch.Tensor] | None = None
    # MoE: the router (router, x) -> (idx, w); the routed experts (moe, h, idx, w) -> [T, De]
    # fp32; the whole block (moe, x) -> [T, D]; None: model/moe.py's plain code
    moe_route: Callable[..., object] | None = None
    moe_experts: Callable[..., torch.Tensor] | None = None
    moe_block: Callable[..., torch.Tensor] | None = None
    # AttnRes read: (candidates, norm_w, proj_w, eps) -> [T, D]; None: AttnResRead.mix
    attn_res_mix: Callable[..., torch.Tensor] | None = None
    # a layer's KDA / MLA mixer over every segment of a forward_batch at once: (attn, layer index,
    # x [T, D], bounds [(a, b)], states) -> [T, D]; None: one call per segment (model.py _mixer)
    kda_segments: Callable[..., torch.Tensor] | None = None
    mla_segments: Callable[..., torch.Tensor] | None = None


OPS = OpTable()


@contextlib.contextmanager
def override(**changes: Callable | None) -> Iterator[OpTable]:
    """Swap op-table entries for the duration of the block; always restored."""
    names = {f.name for f in fields(OpTable)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise KeyError(f"unknown op {unknown[0]!r}; known ops: {', '.join(sorted(names))}")
    saved = {k: getattr(OPS, k) for k in changes}
    try:
        for k, v in changes.items():
            setattr(OPS, k, v)
        yield OPS
    finally:
        for k, v in saved.items():
            setattr(OPS, k, v)
