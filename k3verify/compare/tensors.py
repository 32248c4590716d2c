"""One comparison helper for every numeric finding: bitwise, ULP, tolerance, logits.

Bit-exact is tolerance zero, not a separate code path: `compare_tensors` with
atol = rtol = 0 and no ULP budget compares raw bit patterns, so -0.0 vs +0.0
and two NaNs with different payloads count as differences. With any non-zero
tolerance an element matches when its bits are equal, both sides are NaN (any
payload), |ref - cand| <= atol + rtol * |ref|, or its ULP distance is within
`max_ulp`.

ULP distances come from compare/ulp.py.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from k3verify.compare.ulp import INT_VIEW, ULP_MAX, ulp_distance, ulp_histogram


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def _bits_hex(t: torch.Tensor) -> str:
    if t.dtype in INT_VIEW:
        nbits = torch.finfo(t.dtype).bits
        raw = int(t.reshape(1).view(INT_VIEW[t.dtype]).item()) & ((1 << nbits) - 1)
        return f"0x{raw:0{nbits // 4}x}"
    return ""


def _value_str(t: torch.Tensor) -> str:
    """Shortest round-trip text for a 0-d tensor in its own dtype."""
    if t.dtype == torch.float16:
        return str(np.float16(t.item()))
    if t.dtype in (torch.float32, torch.bfloat16) or t.dtype in INT_VIEW and t.element_size() == 1:
        return str(np.float32(t.float().item()))
    return repr(t.item())


def _json_num(x: Any) -> Any:
    """JSON has no inf/NaN: spell them as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def _fmt_index(idx: tuple[int, ...] | None) -> str:
    return str(idx)  # Python tuple text, as torch.testing prints it: (2,) and (1, 7)


@dataclass
class Finding:
    """What one comparison found. Counts are elements; indices are into `shape`."""

    what: str
    shape: tuple[int, ...]
    dtype: str
    mode: str  # "bitwise" or "tolerance"
    atol: float
    rtol: float
    max_ulp_allowed: int | None
    n_total: int
    n_mismatched: int  # elements failing the tolerance (bitwise mode: differing bits)
    n_bit_different: int  # elements whose bits differ, whatever the tolerance
    n_nan_mismatch: int  # NaN on exactly one side
    equal: bool  # every element bit-identical
    passed: bool
    problem: str | None = None  # structural mismatch (shape, dtype); values were not compared
    max_ulp: int | None = None
    max_ulp_index: tuple[int, ...] | None = None
    median_ulp: int | None = None  # lower median over mismatched elements
    ulp_histogram: list[tuple[str, int]] = field(default_factory=list)
    max_abs: float | None = None
    max_abs_index: tuple[int, ...] | None = None
    max_rel: float | None = None
    max_rel_index: tuple[int, ...] | None = None
    first_index: int | None = None  # first flat index whose bits differ
    first_index_tuple: tuple[int, ...] | None = None
    first_ref: str | None = None  # values there, as shortest text plus raw bits
    first_cand: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("bitwise", "tolerance"):
            raise ValueError(f"mode must be 'bitwise' or 'tolerance', got {self.mode!r}")
        if not 0 <= self.n_mismatched <= self.n_bit_different <= self.n_total:
            raise ValueError(
                "need 0 <= n_mismatched <= n_bit_different <= n_total, got "
                f"{self.n_mismatched}, {self.n_bit_different}, {self.n_total}"
            )
        if self.equal != (self.n_bit_different == 0 and self.problem is None):
            raise ValueError(f"equal={self.equal} contradicts n_bit_different={self.n_bit_different}")
        if self.passed and (self.problem is not None or self.n_mismatched):
            raise ValueError("passed=True with a structural problem or mismatched elements")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, tuple):
                value = list(value)
            elif name == "ulp_histogram":
                value = [[label, count] for label, count in value]
            out[name] = _json_num(value)
        return out

    def _value_lines(self) -> list[str]:
        allowed_ulp = "" if self.max_ulp_allowed is None else f" (up to {self.max_ulp_allowed} allowed)"
        pct = self.n_mismatched / self.n_total if self.n_total else 0.0
        lines = [f"Mismatched elements: {self.n_mismatched} / {self.n_total} ({pct:.1%})"]
        if self.n_nan_mismatch:
            lines.append(f"NaN on one side only: {self.n_nan_mismatch}")
        if self.max_abs is not None:
            lines.append(
                f"Greatest absolute difference: {self.max_abs:.1e} at index "
                f"{_fmt_index(self.max_abs_index)} (up to {self.atol:g} allowed)"
            )
        if self.max_rel is not None:
            lines.append(
                f"Greatest relative difference: {self.max_rel:.1e} at index "
                f"{_fmt_index(self.max_rel_index)} (up to {self.rtol:g} allowed)"
            )
        if self.max_ulp is not None:
            shown = "NaN vs number" if self.max_ulp == ULP_MAX else str(self.max_ulp)
            lines.append(
                f"Greatest ULP distance: {shown} at index {_fmt_index(self.max_ulp_index)}{allowed_ulp}"
            )
            if self.median_ulp is not None:
                lines.append(f"Median ULP distance of mismatched: {self.median_ulp}")
            bins = [f"{label}: {n}" for label, n in self.ulp_histogram if n]
            lines.append("ULP histogram: " + " | ".join(bins))
        if self.first_index is not None:
            lines.append(
                f"First difference at index {_fmt_index(self.first_index_tuple)} "
                f"(flat {self.first_index}): ref {self.first_ref} vs cand {self.first_cand}"
            )
        return lines

    def message(self) -> str:
        """torch.testing-style text; one summary line when nothing failed."""
        where = f"'{self.what}' {list(self.shape)} {self.dtype}"
        if self.problem is not None:
            return f"Tensor-likes are not comparable!\n\n{self.problem}\n\nThe failure occurred for {where}."
        if self.passed:
            if self.equal:
                return f"{where}: bitwise equal ({self.n_total} elements)"
            return (
                f"{where}: close within tolerance ({self.n_bit_different} / {self.n_total} "
                f"elements differ, greatest ULP distance {self.max_ulp})"
            )
        head = "Tensor-likes are not equal!" if self.mode == "bitwise" else "Tensor-likes are not close!"
        body = "\n".join(self._value_lines())
        return f"{head}\n\n{body}\n\nThe failure occurred for {where}."


def _structure_problem(ref: torch.Tensor, cand: torch.Tensor) -> str | None:
    if ref.shape != cand.shape:
        return f"The values for attribute 'shape' do not match: {list(ref.shape)} != {list(cand.shape)}."
    if ref.dtype != cand.dtype:
        return f"The values for attribute 'dtype' do not match: {ref.dtype} != {cand.dtype}."
    if ref.is_complex():
        return f"Complex tensors are not supported, got {ref.dtype}."
    return None


def compare_tensors(
    ref: torch.Tensor,
    cand: torch.Tensor,
    *,
    label: str,
    atol: float = 0.0,
    rtol: float = 0.0,
    max_ulp: int | None = None,
) -> Finding:
    """Compare `cand` against `ref`; structure (shape, dtype) first, then values.

    Zero tolerance (atol = rtol = 0, max_ulp None or 0) is bitwise. Integer and
    bool tensors get exact/atol comparison and no ULP fields.
    """
    for name, t in (("ref", ref), ("cand", cand)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if atol < 0 or rtol < 0 or (max_ulp is not None and max_ulp < 0):
        raise ValueError(f"tolerances must be >= 0, got atol={atol}, rtol={rtol}, max_ulp={max_ulp}")
    bitwise = atol == 0 and rtol == 0 and not max_ulp
    common = dict(
        what=label, shape=tuple(ref.shape), dtype=str(ref.dtype).removeprefix("torch."),
        mode="bitwise" if bitwise else "tolerance", atol=float(atol), rtol=float(rtol),
        max_ulp_allowed=max_ulp,
    )
    problem = _structure_problem(ref, cand)
    if problem is not None:
        return Finding(**common, n_total=ref.numel(), n_mismatched=0, n_bit_different=0,
                       n_nan_mismatch=0, equal=False, passed=False, problem=problem)

    ref = ref.detach().cpu().contiguous()
    cand = cand.detach().cpu().contiguous()
    shape, n_total = tuple(ref.shape), ref.numel()
    is_float = ref.dtype in INT_VIEW
    r, c = ref.reshape(-1), cand.reshape(-1)

    if is_float:
        same_bits = r.view(INT_VIEW[r.dtype]) == c.view(INT_VIEW[c.dtype])
        r_nan, c_nan = torch.isnan(r), torch.isnan(c)
        both_nan, one_nan = r_nan & c_nan, r_nan != c_nan
    else:
        same_bits = r == c
        both_nan = one_nan = torch.zeros_like(same_bits)

    # float64 holds every value of the narrower dtypes exactly.
    r64, c64 = r.to(torch.float64), c.to(torch.float64)
    abs_diff = torch.where(same_bits | both_nan, 0.0, (r64 - c64).abs())  # inf-inf of equal infs is masked
    abs_diff = torch.where(one_nan, math.nan, abs_diff)
    ref_mag = r64.abs()
    rel_diff = torch.where(abs_diff == 0, 0.0, abs_diff / ref_mag)  # x/0 -> inf

    ulps = ulp_distance(r, c) if is_float else None
    if bitwise:
        matched = same_bits
    else:
        matched = same_bits | both_nan | (abs_diff <= atol + rtol * ref_mag)
        if ulps is not None and max_ulp is not None:
            matched |= ulps <= max_ulp
    mismatched = ~matched

    n_bit_different = int((~same_bits).sum())
    n_mismatched = int(mismatched.sum())
    fields: dict[str, Any] = dict(
        n_total=n_total, n_mismatched=n_mismatched, n_bit_different=n_bit_different,
        n_nan_mismatch=int(one_nan.sum()), equal=n_bit_different == 0, passed=n_mismatched == 0,
    )
    if n_total == 0:
        return Finding(**common, **fields)

    comparable = ~torch.isnan(abs_diff)
    if comparable.any():
        # argmax returns the first maximum, so ties report the lowest index.
        i = int(torch.where(comparable, abs_diff, -1.0).argmax())
        fields.update(max_abs=float(abs_diff[i]), max_abs_index=_unravel(i, shape))
        j = int(torch.where(comparable, rel_diff, -1.0).argmax())
        fields.update(max_rel=float(rel_diff[j]), max_rel_index=_unravel(j, shape))
    if ulps is not None:
        k = int(ulps.argmax())
        fields.update(max_ulp=int(ulps[k]), max_ulp_index=_unravel(k, shape),
                      ulp_histogram=ulp_histogram(ulps))
        if n_mismatched:
            fields["median_ulp"] = int(ulps[mismatched].median())
    if n_bit_different:
        f = int((~same_bits).nonzero()[0, 0])
        rv, cv = r[f], c[f]
        fields.update(
            first_index=f, first_index_tuple=_unravel(f, shape),
            first_ref=f"{_value_str(rv)} ({_bits_hex(rv)})" if is_float else _value_str(rv),
            first_cand=f"{_value_str(cv)} ({_bits_hex(cv)})" if is_float else _value_str(cv),
        )
    return Finding(**common, **fields)


@dataclass
class LogitFinding(Finding):
    """A Finding over [N, V] next-token logits, plus distribution-level distances."""

    n_rows: int = 0
    argmax_flips: int = 0
    first_flip_row: int | None = None
    first_flip_tokens: tuple[int, int] | None = None  # (ref argmax, cand argmax) there
    kl_max: float | None = None  # KL(softmax(ref) || softmax(cand)), nats, float64
    kl_max_row: int | None = None
    kl_mean: float | None = None
    top1_agreement: float | None = None  # fraction of rows with the same argmax

    def _value_lines(self) -> list[str]:
        lines = super()._value_lines()
        if self.kl_max is None:
            return lines
        if self.argmax_flips:
            ref_tok, cand_tok = self.first_flip_tokens
            lines.append(
                f"Argmax flips: {self.argmax_flips} / {self.n_rows} rows "
                f"(first at row {self.first_flip_row}: ref {ref_tok} vs cand {cand_tok})"
            )
        else:
            lines.append(f"Argmax flips: 0 / {self.n_rows} rows")
        lines.append(f"KL(ref || cand): max {self.kl_max:.3e} at row {self.kl_max_row}, mean {self.kl_mean:.3e}")
        lines.append(f"Top-1 agreement: {self.top1_agreement:.2%}")
        return lines


def _kl_rows(ref_logits: torch.Tensor, cand_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p_cand) per row in float64; terms where p_ref = 0 contribute 0."""
    log_p = torch.log_softmax(ref_logits.to(torch.float64), dim=-1)
    log_q = torch.log_softmax(cand_logits.to(torch.float64), dim=-1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), 0.0)
    return terms.sum(dim=-1)


def compare_logits(
    ref_logits: torch.Tensor,
    cand_logits: torch.Tensor,
    *,
    label: str,
    atol: float = 0.0,
    rtol: float = 0.0,
    max_ulp: int | None = None,
) -> LogitFinding:
    """Compare [N, V] next-token logit rows: element finding plus argmax flips, KL, top-1.

    `passed` follows the element tolerance (bitwise by default); the distribution
    fields are evidence for approximate contracts and do not change it.
    """
    for name, t in (("ref_logits", ref_logits), ("cand_logits", cand_logits)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 2-D [N, V] tensor, got {got}")
    base = compare_tensors(ref_logits, cand_logits, label=label, atol=atol, rtol=rtol, max_ulp=max_ulp)
    fields = {name: getattr(base, name) for name in Finding.__dataclass_fields__}
    n_rows = ref_logits.shape[0]
    if base.problem is not None or ref_logits.numel() == 0 or not ref_logits.is_floating_point():
        return LogitFinding(**fields, n_rows=n_rows)

    ref = ref_logits.detach().cpu()
    cand = cand_logits.detach().cpu()
    ref_top, cand_top = ref.argmax(dim=-1), cand.argmax(dim=-1)  # first maximum on ties
    flips = (ref_top != cand_top).nonzero().reshape(-1)
    kl = _kl_rows(ref, cand)
    first = int(flips[0]) if len(flips) else None
    return LogitFinding(
        **fields,
        n_rows=n_rows,
        argmax_flips=len(flips),
        first_flip_row=first,
        first_flip_tokens=None if first is None else (int(ref_top[first]), int(cand_top[first])),
        kl_max=float(kl.max()),
        kl_max_row=int(kl.argmax()),
        kl_mean=float(kl.mean()),
        top1_agreement=1.0 - len(flips) / n_rows,
    )


def first_divergence(ref_tokens: Sequence[int] | torch.Tensor, cand_tokens: Sequence[int] | torch.Tensor) -> int | None:
    """First step where the token streams part; a stream that stops early parts at its length.

    None when both streams are identical.
    """
    ref = ref_tokens.tolist() if isinstance(ref_tokens, torch.Tensor) else list(ref_tokens)
    cand = cand_tokens.tolist() if isinstance(cand_tokens, torch.Tensor) else list(cand_tokens)
    for step, (a, b) in enumerate(zip(ref, cand)):
        if a != b:
            return step
    return None if len(ref) == len(cand) else min(len(ref), len(cand))


def hash_tensor(t: torch.Tensor) -> str:
    """'dtype[shape]:hex' over the raw bytes; equal hashes mean bitwise-equal tensors.

    A CUDA tensor's hash is computed where it lives (compare/device_digest.py, 'dtype[shape]:m31x4:hex':
    no copy to the host); a CPU tensor's is blake2b. The scheme is in the string, so a digest is
    only ever equal to one of its own scheme; hash_like recomputes a tensor under a given digest's.
    Equal hashes say nothing about finiteness: a NaN row hashes alike on both sides of a
    comparison. k3verify.capture.nonfinite is the check for that, recorded beside every hash."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"hash_tensor needs a torch.Tensor, got {type(t).__name__}")
    from k3verify.compare import device_digest
    if device_digest.on_device(t):
        return device_digest.digest(t)
    return _blake2b(t)


def hash_like(t: torch.Tensor, digest: str) -> str:
    """t's hash under the scheme `digest` was made with (a kept CPU copy of a CUDA tensor against the
    device digest recorded for it)."""
    from k3verify.compare import device_digest
    return device_digest.digest(t) if device_digest.scheme_of(digest) == device_digest.SCHEME else _blake2b(t)


def _blake2b(t: torch.Tensor) -> str:
    flat = t.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    h = hashlib.blake2b(digest_size=16)
    head = f"{str(t.dtype).removeprefix('torch.')}[{','.join(map(str, t.shape))}]"
    h.update(head.encode())
    h.update(memoryview(raw.numpy()))
    return f"{head}:{h.hexdigest()}"
