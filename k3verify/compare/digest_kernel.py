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
# every table ever handed out stays alive: a CUDA graph that captured a launch holds its address, not a
# reference, and would read freed memory after the table grew (the engine's in-step digests)
_C32_ALL: list[torch.Tensor] = []


@triton.jit
def _row_block(h_ptr, f_ptr, c_ptr, out, n_h, n_f, h_stride, f_stride, c_stride, row, blk,
               SHIFT: tl.constexpr, HAS_F: tl.constexpr, H_PER_F: tl.constexpr, UPCAST: tl.constexpr,
               P: tl.constexpr, BLOCK: tl.constexpr, PER_ELEMENT_MOD: tl.constexpr, WIDE: tl.constexpr):
    """Block `blk` of row `row`: its lanes' partial sums and finiteness into out[0:7] (atomics).
    WIDE: the half and the constant kept as int32 (both fit) and widened only for the product, so
    the compiler may take a 32 x 32 -> 64-bit multiply instead of a full 64-bit one; the same
    integers, so the same words (module docstring)."""
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_h
    if WIDE:
        h = tl.load(h_ptr + row * h_stride + offs, mask=m, other=0).to(tl.int32) + SHIFT     # < 2^16
    else:
        h = tl.load(h_ptr + row * h_stride + offs, mask=m, other=0).to(tl.int64) + SHIFT
    h = tl.where(m, h, 0)
    for lane in tl.static_range(4):
        if WIDE:
            c = tl.load(c_ptr + lane * c_stride + offs, mask=m, other=0)                     # int32, < 2^31
            tl.atomic_add(out + lane, tl.sum(h.to(tl.int64) * c.to(tl.int64), axis=0) % P)
        else:
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


@triton.jit
def _digest_rows(h_ptr, f_ptr, c_ptr, out_ptr, n_h, n_f, h_stride, f_stride, c_stride,
                 SHIFT: tl.constexpr, HAS_F: tl.constexpr, H_PER_F: tl.constexpr, UPCAST: tl.constexpr,
                 P: tl.constexpr, BLOCK: tl.constexpr, PER_ELEMENT_MOD: tl.constexpr):
    row = tl.program_id(0)
    _row_block(h_ptr, f_ptr, c_ptr, out_ptr + row * 7, n_h, n_f, h_stride, f_stride, c_stride, row,
               tl.program_id(1), SHIFT, HAS_F, H_PER_F, UPCAST, P, BLOCK, PER_ELEMENT_MOD, False)


@triton.jit
def _digest_slot(h_ptr, f_ptr, i_ptr, c_ptr, out_ptr, n_h, n_f, h_stride, f_stride, c_stride, g, first, last,
                 SHIFT: tl.constexpr, HAS_F: tl.constexpr, H_PER_F: tl.constexpr, UPCAST: tl.constexpr,
                 INDEXED: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """Global row g, if it is one of this slot's (rows first..last-1) and its block holds data. INDEXED:
    the slot's row j is the tensor's row i_ptr[j] (a pool read in place, no gathered copy)."""
    blk = tl.program_id(1)
    if (g >= first) & (g < last) & (blk * BLOCK < n_h):
        row = g - first
        if INDEXED:
            row = tl.load(i_ptr + row)
        _row_block(h_ptr, f_ptr, c_ptr, out_ptr + g * 7, n_h, n_f, h_stride, f_stride, c_stride, row,
                   blk, SHIFT, HAS_F, H_PER_F, UPCAST, P, BLOCK, False, WIDE)


@triton.jit
def _digest_many_ranges(h0, f0, i0, nh0, nf0, hs0, fs0, h1, f1, i1, nh1, nf1, hs1, fs1,
                        h2, f2, i2, nh2, nf2, hs2, fs2, h3, f3, i3, nh3, nf3, hs3, fs3,
                        a0, b0, a1, b1, a2, b2, a3, b3, lo, c_ptr, c_stride, out_ptr,
                        SHIFT: tl.constexpr, HAS_F: tl.constexpr, H_PER_F: tl.constexpr, UPCAST: tl.constexpr,
                        INDEXED: tl.constexpr, SLOTS: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr,
                        ROWS: tl.constexpr, WIDE: tl.constexpr):
    """Up to four tensors of one kind (the same constexprs) in one launch. Program (i, blk) takes
    block blk of rows g = lo + i * ROWS + r (r < ROWS) of the words buffer, each in the slot whose rows
    [a_s, b_s) hold it: the ROWS rows read the same block of constants (64 KB at BLOCK 4096), which
    the program's first row brings into its SM's L1 for the others."""
    for r in range(ROWS):
        g = lo + tl.program_id(0) * ROWS + r
        _digest_slot(h0, f0, i0, c_ptr, out_ptr, nh0, nf0, hs0, fs0, c_stride, g, a0, b0,
                     SHIFT, HAS_F, H_PER_F, UPCAST, INDEXED, P, BLOCK, WIDE)
        if SLOTS > 1:
            _digest_slot(h1, f1, i1, c_ptr, out_ptr, nh1, nf1, hs1, fs1, c_stride, g, a1, b1,
                         SHIFT, HAS_F, H_PER_F, UPCAST, INDEXED, P, BLOCK, WIDE)
        if SLOTS > 2:
            _digest_slot(h2, f2, i2, c_ptr, out_ptr, nh2, nf2, hs2, fs2, c_stride, g, a2, b2,
                         SHIFT, HAS_F, H_PER_F, UPCAST, INDEXED, P, BLOCK, WIDE)
        if SLOTS > 3:
            _digest_slot(h3, f3, i3, c_ptr, out_ptr, nh3, nf3, hs3, fs3, c_stride, g, a3, b3,
                         SHIFT, HAS_F, H_PER_F, UPCAST, INDEXED, P, BLOCK, WIDE)


def constants32(m: int, device: torch.device) -> torch.Tensor:
    """device_digest.constants(m, device) as int32 (every value is < 2^31), cached per device."""
    device = torch.device(device)
    table = _C32.get(device)
    if table is None or table.shape[1] < m:
        dd.constants(m, device)
        table = dd._CONSTANTS[device].to(torch.int32)      # the whole grown table, not just [:m]
        _C32[device] = table
        _C32_ALL.append(table)
    return table[:, :m]


class _Prepared:
    """A tensor as the kernel reads it: h (its 16-bit halves, or bytes when a row's byte count is odd),
    flat (its own dtype, for finiteness), n rows, and the kernel's constexprs for it. With `index`
    (int64 [n] on t's device) the rows digested are t's rows index[0..n-1], read where they lie."""

    def __init__(self, t: torch.Tensor, rows: bool, index: torch.Tensor | None = None) -> None:
        x = t.detach()
        if x.dtype == torch.bool:
            x = x.to(torch.uint8)
        self.index = None if index is None else index.to(torch.int64).contiguous()
        self.n = x.shape[0] if rows else 1
        self.flat = x.contiguous().reshape(self.n, -1)
        if self.index is not None:
            self.n = self.index.shape[0]
        raw = self.flat.view(torch.uint8)
        if raw.storage_offset() % 2:              # int16 needs 2-byte alignment
            raw = raw.clone()
        even = raw.shape[1] % 2 == 0
        self.h = raw.view(torch.int16) if even else raw
        self.has_f = self.flat.is_floating_point()
        self.key = (32768 if even else 0, self.has_f,
                    max(1, self.flat.element_size() // 2) if even else 1,
                    self.flat.dtype in (torch.bfloat16, torch.float16), self.index is not None)

    def blocks(self, block: int) -> int:
        return max(1, triton.cdiv(self.h.shape[1], block))

    def args(self) -> tuple:
        f = self.flat if self.has_f else self.h
        idx = self.index if self.index is not None else self.h        # unread unless INDEXED
        return (self.h, f, idx, self.h.shape[1], self.flat.shape[1], self.h.stride(0), self.flat.stride(0))


def _words_buffer(rows: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(rows, 7, dtype=torch.int64, device=device)
    out[:, 5] = dd.NO_KEY
    return out


def summary_words(t: torch.Tensor, rows: bool = False, per_element_mod: bool = False) -> torch.Tensor:
    """device_digest.summary_words(t, rows) in one launch: int64 [n, 7] on t's device.
    `per_element_mod`: the form before session 17 (the same words), for the bench's A/B only."""
    p = _Prepared(t, rows)
    block = BLOCK_PER_ELEMENT_MOD if per_element_mod else BLOCK
    grid = (p.n, p.blocks(block))
    if grid[1] > 65535 or p.n > 2 ** 31 - 1:          # past a launch grid's second axis: the torch form
        return dd.summary_words_torch(t, rows)
    out = _words_buffer(p.n, p.h.device)
    c = dd.constants(p.h.shape[1], p.h.device) if per_element_mod else constants32(p.h.shape[1], p.h.device)
    shift, has_f, h_per_f, upcast, _ = p.key
    h, f, _, n_h, n_f, h_stride, f_stride = p.args()
    _digest_rows[grid](h, f, c, out, n_h, n_f, h_stride, f_stride, c.stride(0), SHIFT=shift, HAS_F=has_f,
                       H_PER_F=h_per_f, UPCAST=upcast, P=dd.P, BLOCK=block, PER_ELEMENT_MOD=per_element_mod)
    return out


SLOTS = 4      # tensors one launch of _digest_many takes
# Rows a program of the grouped launch digests, one after another, for the same block. The words are
# exact integer sums, the same in any grouping. Eight rows a program were to fetch a block's 64 KB of
# int32 constants from L2 once per eight rows, not once a row (session 23's guess that L2 bound the
# 0.87 ms). Measured on the H100 (session 24, capture_bench digest_cost, the step's 321 MB in place):
# one row a program 0.87 ms of device time, up to eight 1.49 ms. The constants were not the bound, and
# a program walking its rows in turn hides less latency; one row a program it is. The bench keeps the
# eight-row form as an arm (`in_step_eight_rows`).
ROWS_PER_PROGRAM = 1      # at most: a small launch takes fewer (_rows_a_program), so every SM has work
# The products as 32 x 32 -> 64-bit multiplies (_row_block's WIDE). The step's in-place digests cost
# 0.87 ms of device time for 321 MB on the H100 (session 25: 370 GB/s, far from the bandwidth), and
# four full 64-bit multiplies a half are a suspect. Off until the bench's `in_step_wide` arm measures
# it beside the default in one process; the words are the same either way (test_triton_digest.py).
WIDE_PRODUCTS = False


def summary_words_many(ts: list[torch.Tensor], index: list[torch.Tensor | None] | None = None,
                       rows_per_program: int = ROWS_PER_PROGRAM, wide: bool = WIDE_PRODUCTS) -> list[torch.Tensor]:
    """[summary_words(t, rows=True) for t in ts], the same words, with one words buffer for all of
    them and one launch per up to SLOTS tensors of one kind (dtype class and byte parity), not three
    launches per tensor: a step's capture launches were its cost (NOTES.md, session 21). A tensor past
    the launch grid's limits takes its own call (the torch form). `index[i]` (int64 [n], or None): the
    words of ts[i]'s rows index[i] read in place, as summary_words(ts[i][index[i]], rows=True) gives
    them without the gathered copy (the engine's in-step digests over its state pool).
    `rows_per_program`: ROWS_PER_PROGRAM, or another count for the bench's A/B (the same words);
    `wide`: WIDE_PRODUCTS, or the other product form for the bench's A/B (the same words)."""
    if not ts:
        return []
    index = index or [None] * len(ts)
    preps = [_Prepared(t, rows=True, index=i) for t, i in zip(ts, index)]
    device = preps[0].h.device
    out = _words_buffer(sum(p.n for p in preps), device)
    starts, at = [], 0
    for p in preps:
        starts.append(at)
        at += p.n
    result = [out[s:s + p.n] for s, p in zip(starts, preps)]
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(preps):
        if p.blocks(BLOCK) > 65535 or p.n > 2 ** 31 - 1:
            rows = ts[i] if index[i] is None else ts[i].index_select(0, index[i])
            result[i] = dd.summary_words_torch(rows, rows=True)
        else:
            groups.setdefault(p.key, []).append(i)
    c = constants32(max(p.h.shape[1] for p in preps), device)
    for key, members in groups.items():
        for k in range(0, len(members), SLOTS):
            _launch_group([preps[i] for i in members[k:k + SLOTS]], [starts[i] for i in members[k:k + SLOTS]],
                          key, c, out, rows_per_program, wide)
    return result


def _rows_a_program(rows: int, blocks: int, most: int, device: torch.device) -> int:
    """Rows a program for a launch of rows x blocks: up to `most`, a power of two, but never so many
    that the launch has fewer than ~4 programs an SM (a B = 64 logits launch has 64 x 16 blocks:
    eight rows a program would leave 128 programs for 132 SMs). The words do not depend on it."""
    if most < 1:
        raise ValueError(f"rows_per_program must be >= 1, got {most}")
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    r = 1
    while r * 2 <= most and rows * blocks // (r * 2) >= 4 * sms:
        r *= 2
    return r


def _launch_group(preps: list[_Prepared], starts: list[int], key: tuple, c: torch.Tensor,
                  out: torch.Tensor, rows_per_program: int = ROWS_PER_PROGRAM, wide: bool = False) -> None:
    """One launch for 1..SLOTS prepared tensors of one kind, whose rows start at `starts` in `out`.
    The launch spans out's rows from the first slot's start to the last slot's end; a row in between
    that belongs to another group lies in no slot's range and is left to that group's launch."""
    shift, has_f, h_per_f, upcast, indexed = key
    slots = [p.args() for p in preps]
    ranges = [(s, s + p.n) for s, p in zip(starts, preps)]
    lo, hi = ranges[0][0], ranges[-1][1]
    while len(slots) < SLOTS:                       # unused slots: an empty range, never taken
        slots.append(slots[0])
        ranges.append((0, 0))
    blocks = max(p.blocks(BLOCK) for p in preps)
    rows_per_program = _rows_a_program(hi - lo, blocks, rows_per_program, out.device)
    grid = (triton.cdiv(hi - lo, rows_per_program), blocks)
    _digest_many_ranges[grid](*[a for slot in slots for a in slot], *[r for rg in ranges for r in rg], lo, c,
                              c.stride(0), out, SHIFT=shift, HAS_F=has_f, H_PER_F=h_per_f, UPCAST=upcast,
                              INDEXED=indexed, SLOTS=len(preps), P=dd.P, BLOCK=BLOCK, ROWS=rows_per_program,
                              WIDE=wide)
