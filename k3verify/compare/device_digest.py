"""Bitwise digests computed where a tensor lives: a CUDA tensor's digest without copying it out.

The capture hashes every full logits row, every KDA state point and the MLA rows of a run. On the
CPU that is blake2b over the raw bytes (compare/tensors.hash_tensor). On a GPU the same would copy
each tensor to the host and wait for it, twice per tensor with the finiteness check: for k3-small's
multi_length ~5,600 waits per capture, and for 64 requests x 32 tokens x 9 KDA layers x 4 tensors
~37 GB of copies (the capture bench that did not finish in 170 s, NOTES.md session 12). Here the
digest and the finiteness summary are reductions on the device; a Capture launches them as the run
goes and reads all of them back in one transfer (capture/capture.py).

The digest, `m31x4`: the tensor's raw bytes as 16-bit halves h_i (each in [0, 2^16) after a shift),
four lanes k of sum_i (h_i * c_{k,i} mod p) mod p, p = 2^31 - 1, with c_{k,i} fixed pseudo-random in
[1, p) (drawn in blocks of 2^16 per lane, each block from its own seed, so a constant never depends on
how far the table has grown). Integer sums are exact in any order, so the digest is the same on every
device and for every reduction order, and the same tensor on the CPU gives the same digest (a kept
tensor is checked against the digest recorded for it). Any change of one half is a change of
(h - h') * c_{k,i} mod p with 0 < |h - h'| < 2^16 < p and p prime: never zero, so a single flipped bit
is always seen; for unrelated tensors the four lanes collide with chance ~p^-4 = 2^-124. Not a
cryptographic hash (nothing here is adversarial); equal digests mean bitwise-equal tensors in the
same sense as blake2b's, and a digest string names its scheme so two schemes never compare equal.

The finiteness summary is (non-finite count, first non-finite flat index, its kind: 1 nan, 2 +inf,
3 -inf), the NonFinite of capture/nonfinite.py, computed on the device too.

    python -c "from k3verify.compare.device_digest import digest; import torch; print(digest(torch.ones(3)))"
"""
from __future__ import annotations

import os
import sys

import torch

SCHEME = "m31x4"
LANES = 4
P = 2 ** 31 - 1
MASK_SEED = 0x6B337665          # "k3ve"
DIGEST_ENV = "K3_DIGEST"        # "m31x4": the device digest for CPU tensors too (tests); default by device
NONFINITE_KINDS = {1: "nan", 2: "inf", 3: "-inf"}

_CONSTANTS: dict[torch.device, torch.Tensor] = {}
# every table ever made stays alive: a CUDA graph that captured the torch form (the engine's in-step
# digests where the kernel does not run) holds a table's address, not a reference to it
_CONSTANTS_ALL: list[torch.Tensor] = []


def on_device(t: torch.Tensor) -> bool:
    """True when t's digest is computed as m31x4 where it lives (every CUDA tensor, or every tensor
    under K3_DIGEST=m31x4); else the CPU's blake2b (compare/tensors.hash_tensor)."""
    return t.is_cuda or os.environ.get(DIGEST_ENV, "").strip().lower() == SCHEME


def scheme_of(digest: str) -> str:
    """'m31x4' or 'blake2b' (the digest string 'dtype[shape]:hex' carries no scheme name)."""
    parts = digest.split(":")
    return SCHEME if len(parts) == 3 and parts[1] == SCHEME else "blake2b"


BLOCK = 1 << 16                 # constants are drawn in blocks of this many, each from its own seed


def _block(lane: int, b: int) -> torch.Tensor:
    # one seed per (lane, block): a block's values never depend on how long the table has grown
    gen = torch.Generator().manual_seed(MASK_SEED + (lane << 32) + b)
    return torch.randint(1, P, (BLOCK,), generator=gen, dtype=torch.int64)


def constants(m: int, device: torch.device) -> torch.Tensor:
    """[LANES, m] int64 in [1, P): the first m of one fixed sequence per lane (grown as needed)."""
    device = torch.device(device)
    table = _CONSTANTS.get(device)
    if table is None or table.shape[1] < m:
        blocks = max(1, -(-m // BLOCK))
        blocks = 1 << (blocks - 1).bit_length()              # grow by doubling
        table = torch.stack([torch.cat([_block(k, b) for b in range(blocks)]) for k in range(LANES)]).to(device)
        _CONSTANTS[device] = table
        _CONSTANTS_ALL.append(table)
    return table[:, :m]


def halves(t: torch.Tensor, rows: bool = False) -> torch.Tensor:
    """t's raw bytes as int64 values in [0, 2^16) (16-bit halves; single bytes when a row's byte count
    is odd): shape [m], or [n, m] per leading row when `rows`."""
    x = t.detach()
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    x = x.contiguous().reshape(x.shape[0] if rows else 1, -1)
    raw = x.view(torch.uint8)
    if raw.storage_offset() % 2:              # a one-byte tensor sliced at an odd byte: int16 needs 2-byte alignment
        raw = raw.clone()
    if raw.shape[1] % 2 == 0:
        h = raw.view(torch.int16).to(torch.int64) + 32768
    else:
        h = raw.to(torch.int64)
    return h if rows else h[0]


def digest_lanes(t: torch.Tensor, rows: bool = False) -> torch.Tensor:
    """The m31x4 lanes on t's device, no host transfer: int64 [LANES], or [n, LANES] per row."""
    h = halves(t, rows)
    c = constants(h.shape[-1], h.device)
    if rows:
        # rows in chunks: the [rows, LANES, m] products stay a few tens of MB
        step = max(1, (1 << 22) // max(1, LANES * h.shape[1]))
        return torch.cat([((h[i:i + step, None, :] * c) % P).sum(-1) % P for i in range(0, h.shape[0], step)]) \
            if h.shape[0] else torch.zeros(0, LANES, dtype=torch.int64, device=h.device)
    return ((h[None, :] * c) % P).sum(-1) % P


def nonfinite_summary(t: torch.Tensor, rows: bool = False) -> torch.Tensor:
    """int64 [3] (or [n, 3] per row): non-finite count, first non-finite flat index (-1: none), its
    kind (0 none, 1 nan, 2 +inf, 3 -inf); no host transfer. Integer and bool tensors are all finite."""
    x = t.detach()
    n = x.shape[0] if rows else 1
    if not x.is_floating_point() or x.numel() == 0:
        out = torch.zeros(n, 3, dtype=torch.int64, device=x.device)
        out[:, 1] = -1
        return out if rows else out[0]
    flat = x.reshape(n, -1)
    bad = ~torch.isfinite(flat)
    count = bad.sum(-1)
    first = torch.argmax(bad.to(torch.uint8), dim=-1)             # the first True (0 when none)
    value = flat.gather(1, first[:, None])[:, 0]
    kind = torch.where(torch.isnan(value), 1, torch.where(value > 0, 2, 3))
    has = count > 0
    out = torch.stack([count, torch.where(has, first, -1), torch.where(has, kind, 0)], dim=-1).to(torch.int64)
    return out if rows else out[0]


NO_KEY = (1 << 63) - 1          # summary word 5 when no element is non-finite
WORDS = 7                       # summary words per tensor (or row)


def summary_words_torch(t: torch.Tensor, rows: bool = False) -> torch.Tensor:
    """int64 [n, WORDS] on t's device: the digest's LANES lanes, the non-finite count, min(4 * flat
    index + kind) over non-finite elements (NO_KEY: none), 0. The torch form (any device); the CUDA
    form, one Triton launch, is compare/digest_kernel.py (the same words: its lanes are partial sums,
    so read_words reduces them mod p)."""
    lanes = digest_lanes(t, rows=rows).reshape(-1, LANES)
    nf = nonfinite_summary(t, rows=rows).reshape(-1, 3)
    key = torch.where(nf[:, 0] > 0, nf[:, 1] * 4 + nf[:, 2], NO_KEY)
    return torch.cat([lanes, nf[:, :1], key[:, None], torch.zeros_like(key)[:, None]], dim=1)


def summary_words(t: torch.Tensor, rows: bool = False) -> torch.Tensor:
    """summary_words_torch's words, from the one-launch Triton kernel where it runs (a CUDA tensor,
    or any tensor under TRITON_INTERPRET=1), else from the torch form. One-byte floats (fp8) and
    0-dim rows take the torch form."""
    if _kernel_takes(t, rows) and _KERNEL_BROKEN is None:
        try:
            from k3verify.compare.digest_kernel import summary_words as kernel
        except ImportError:            # no triton here: the torch form
            return summary_words_torch(t, rows)
        return kernel(t, rows) if _KERNEL_CHECKED else _first_kernel_call(kernel, t, rows)
    return summary_words_torch(t, rows)


def _kernel_takes(t: torch.Tensor, rows: bool) -> bool:
    """Whether the Triton kernel digests t: a CUDA tensor, or any under TRITON_INTERPRET=1; not empty,
    not a one-byte float (fp8), and with rows to take when `rows`."""
    return ((t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and t.numel() > 0
            and not (t.is_floating_point() and t.element_size() == 1) and (t.dim() > 1 if rows else True))


_KERNEL_CHECKED = False
_KERNEL_BROKEN: str | None = None      # why the kernel could not run here (its first call failed)
_GROUPED_CHECKED = False
_GROUPED_BROKEN: str | None = None     # why the grouped form is not used here (its first call failed or differed)


def _first_kernel_call(kernel, t: torch.Tensor, rows: bool) -> torch.Tensor:
    """The kernel's first call in this process compiles it: if that fails (a Triton or driver that
    cannot build it), say so once on stderr and take the torch form, the same words, from then on."""
    global _KERNEL_CHECKED, _KERNEL_BROKEN
    try:
        out = kernel(t, rows)
    except Exception as exc:   # noqa: BLE001 - any compile or launch failure of the first call
        _KERNEL_BROKEN = f"{type(exc).__name__}: {exc}"[:300]
        print(f"k3verify: the device digest kernel could not run ({_KERNEL_BROKEN}); using its torch form",
              file=sys.stderr, flush=True)
        return summary_words_torch(t, rows)
    _KERNEL_CHECKED = True
    return out


def differing_rows(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """The rows (int64 [k]) where two [n, WORDS] summaries differ: lanes compared mod p (the kernel
    leaves partial sums), the other words as they are."""
    return (((got[:, :LANES] % P) != (want[:, :LANES] % P)).any(-1) | (got[:, LANES:] != want[:, LANES:]).any(-1)
            ).nonzero()[:, 0]


def same_words(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    """Whether two lists of summaries are the same words (shapes, then differing_rows)."""
    return len(got) == len(want) and all(a.shape == b.shape and not differing_rows(a, b).numel()
                                         for a, b in zip(got, want))


def summary_words_many(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """[summary_words(t, rows=True) for t in ts], the same words, from the kernel's grouped form where
    every tensor takes the kernel (one words buffer, one launch per up to four tensors of a kind: a
    KDA layer's four state tensors in one, where each took three launches of its own). The grouped
    form's first call in a process is checked word for word against the per-tensor calls; if it fails
    or differs, it says so once on stderr and the per-tensor form is taken from then on."""
    global _GROUPED_CHECKED, _GROUPED_BROKEN
    one_by_one = lambda: [summary_words(t, rows=True) for t in ts]          # noqa: E731
    if not (ts and _KERNEL_CHECKED and _KERNEL_BROKEN is None and _GROUPED_BROKEN is None
            and all(_kernel_takes(t, True) for t in ts) and len({t.device for t in ts}) == 1):
        return one_by_one()              # the process's first kernel call is checked per tensor first
    try:
        from k3verify.compare.digest_kernel import summary_words_many as grouped
    except ImportError:
        return one_by_one()
    if _GROUPED_CHECKED:
        return grouped(ts)
    want = one_by_one()
    try:
        problem = None if same_words(grouped(ts), want) else "its words differ from the per-tensor kernel's"
    except Exception as exc:   # noqa: BLE001 - any compile or launch failure of the first call
        problem = f"{type(exc).__name__}: {exc}"[:300]
    if problem:
        _GROUPED_BROKEN = problem
        print(f"k3verify: the grouped device digest could not be used ({problem}); digesting per tensor",
              file=sys.stderr, flush=True)
    _GROUPED_CHECKED = True
    return want


class StepDigester:
    """The capture's digest as the engine's fast decode step takes it inside the step and its CUDA graph
    (optimized_stack/engine/fast/step_digests.py): `words` launches the grouped kernel (or, where the
    kernel does not run, the torch form) and nothing else, so it can be captured; `check` is the torch
    form, the independent one, that the engine holds the first words of every graph against."""

    scheme = SCHEME

    def words(self, ts: list[torch.Tensor], index: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """summary_words(t, rows=True) for each t (for t's rows index[i] where index[i] is given, read
        in place by the kernel): [rows, WORDS] int64 each, lanes as partial sums."""
        index = index or [None] * len(ts)
        if _KERNEL_BROKEN is None and _GROUPED_BROKEN is None and all(_kernel_takes(t, True) for t in ts):
            try:
                from k3verify.compare.digest_kernel import summary_words_many as grouped
            except ImportError:
                grouped = None
            if grouped is not None:
                return grouped(ts, index)
        return [summary_words_torch(t if i is None else t.index_select(0, i), rows=True) for t, i in zip(ts, index)]

    def check(self, ts: list[torch.Tensor], words: list[torch.Tensor]) -> str | None:
        """None when `words` are the torch form's words of `ts`; else which tensor and row differ."""
        if len(words) != len(ts):
            return f"{len(words)} words tensors for {len(ts)} tensors"
        for i, (t, got) in enumerate(zip(ts, words)):
            want = summary_words_torch(t, rows=True)
            if got.shape != want.shape:
                return f"tensor {i}: words of shape {list(got.shape)}, the torch form's {list(want.shape)}"
            bad = differing_rows(got, want)
            if bad.numel():
                return (f"tensor {i} ({str(t.dtype).removeprefix('torch.')}{list(t.shape)}): row {int(bad[0])} "
                        f"and {bad.numel() - 1} more differ from the torch form's words")
        return None


def read_words(words: list[int]) -> tuple[list[int], tuple[int, int, int] | None]:
    """One row of summary words -> (the LANES lanes, (count, first index, kind code) or None)."""
    lanes = [int(v) % P for v in words[:LANES]]
    count, key = int(words[LANES]), int(words[LANES + 1])
    return lanes, (None if count == 0 else (count, key // 4, key % 4))


def format_digest(dtype: torch.dtype, shape: tuple[int, ...], lanes: list[int]) -> str:
    head = f"{str(dtype).removeprefix('torch.')}[{','.join(map(str, shape))}]"
    return f"{head}:{SCHEME}:" + "".join(f"{int(v):08x}" for v in lanes)


def digest(t: torch.Tensor) -> str:
    """The m31x4 digest string of t, computed on t's device (one launch on CUDA, one small transfer)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"digest needs a torch.Tensor, got {type(t).__name__}")
    lanes, _ = read_words(summary_words(t)[0].tolist())
    return format_digest(t.dtype, tuple(t.shape), lanes)
