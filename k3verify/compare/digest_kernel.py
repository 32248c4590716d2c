"""The m31x4 digest and the finiteness summary of compare/device_digest.py in one Triton launch.

device_digest's torch form costs ~20 small kernels per captured tensor (the casts, products and
remainders of the digest, then isfinite, argmax, a gather and the kind's wheres); a capture of 64
requests x 32 tokens x 9 KDA layers x 4 tensors is 73K tensors. This kernel reads each tensor once,
as its 16-bit halves for the digest and in its own dtype for finiteness, and leaves per row the 7
int64 words device_digest.summary_words defines: four lanes (partial sums, reduced mod p when read),
the non-finite count, and min(4 * flat index + kind) over non-finite elements (the first one and its
kind, in one atomic minimum). Blocks of a row add their integer partial sums atomically, exact in any
order, so the words are the torch form's bit for bit (tests/test_triton_digest.py, under Triton's
interpreter in CI).

The lanes' arithmetic (session 17): a half h < 2^16 times a constant c < 2^31 is < 2^47, so a block's
BLOCK = 4096 products sum exactly in int64 (< 2^59) and the block's sum is reduced mod p once, not each
product: sum_i (h_i c_i mod p) and sum_i h_i c_i are the same mod p, so the words read the same. The
constants are read as int32 (they are < 2^31), half the bytes of the int64 table. The form before
(a remainder per product, int64 constants, BLOCK 1024: ~38 GB/s on an H100) stays behind
`per_element_mod` so perf/capture_bench.py times both in one process.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3verify.compare import device_digest as dd

BLOCK = 4096                # products a block sums before one remainder: 4096 * 2^16 * 2^31 = 2^59 < 2^63
BLOCK_PER_ELEMENT_MOD = 1024
_C32: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _digest_rows(h_ptr, f_ptr, c_ptr, out_ptr, n_h, n_f, h_stride, f_stride, c_stride,
                 SHIFT: tl.constexpr, HAS_F: tl.constexpr, H_PER_F: tl.constexpr, UPCAST: tl.constexpr,
                 P: tl.constexpr, BLOCK: tl.constexpr, PER_ELEMENT_MOD: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_h
    h = tl.load(h_ptr + row * h_stride + offs, mask=m, other=0).to(tl.int64) + SHIFT
    h = tl.where(m, h, 0)
    out = out_ptr + row * 7
    for lane in tl.static_range(4):
        c = tl.load(c_ptr + lane * c_stride + offs, mask=m, other=0).to(tl.int64)
        if PER_ELEMENT_MOD:
            tl.atomic_add(out + lane, tl.sum((h * c) % P, axis=0))
        else:
            tl.atomic_add(out + lane, tl.sum(h * c, axis=0) % P)
    if HAS_F:
        FB: tl.constexpr = BLOCK // H_PER_F
        fo = blk * FB + tl.arange(0, FB)
        fm = fo < n_f
        x = tl.load(f_ptr + row * f_stride + fo, mask=fm, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        nan = x != x
        bad = (nan | (x == float("inf")) | (x == float("-inf"))) & fm
        tl.atomic_add(out + 4, tl.sum(bad.to(tl.int64), axis=0))
        kind = tl.where(nan, 1, tl.where(x > 0, 2, 3)).to(tl.int64)
        key = tl.where(bad, fo.to(tl.int64) * 4 + kind, 9223372036854775807)
        tl.atomic_min(out + 5, tl.min(key, axis=0))


def constants32(m: int, device: torch.device) -> torch.Tensor:
    """device_digest.constants(m, device) as int32 (every value is < 2^31), cached per device."""
    device = torch.device(device)
    table = _C32.get(device)
    if table is None or table.shape[1] < m:
        dd.constants(m, device)
        table = dd._CONSTANTS[device].to(torch.int32)      # the whole grown table, not just [:m]
        _C32[device] = table
    return table[:, :m]


def summary_words(t: torch.Tensor, rows: bool = False, per_element_mod: bool = False) -> torch.Tensor:
    """device_digest.summary_words(t, rows) in one launch: int64 [n, 7] on t's device.
    `per_element_mod`: the form before session 17 (the same words), for the bench's A/B only."""
    x = t.detach()
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    n = x.shape[0] if rows else 1
    flat = x.contiguous().reshape(n, -1)
    raw = flat.view(torch.uint8)
    if raw.storage_offset() % 2:              # int16 needs 2-byte alignment
        raw = raw.clone()
    even = raw.shape[1] % 2 == 0
    h = raw.view(torch.int16) if even else raw
    has_f = flat.is_floating_point()
    out = torch.zeros(n, 7, dtype=torch.int64, device=x.device)
    out[:, 5] = dd.NO_KEY
    block = BLOCK_PER_ELEMENT_MOD if per_element_mod else BLOCK
    grid = (n, max(1, triton.cdiv(h.shape[1], block)))
    if grid[1] > 65535 or n > 2 ** 31 - 1:          # past a launch grid's second axis: the torch form
        return dd.summary_words_torch(t, rows)
    c = dd.constants(h.shape[1], h.device) if per_element_mod else constants32(h.shape[1], h.device)
    _digest_rows[grid](h, flat if has_f else h, c, out, h.shape[1], flat.shape[1], h.stride(0),
                       flat.stride(0), c.stride(0), SHIFT=32768 if even else 0, HAS_F=has_f,
                       H_PER_F=max(1, flat.element_size() // 2) if even else 1,
                       UPCAST=flat.dtype in (torch.bfloat16, torch.float16), P=dd.P, BLOCK=block,
                       PER_ELEMENT_MOD=per_element_mod)
    return out
