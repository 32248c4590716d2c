"""Non-finite numbers (NaN, +inf, -inf): found once at capture time, failed loudly everywhere.

A hash cannot see them: a NaN logits row hashes alike on both sides of a comparison, and
a tolerance comparison counts NaN vs NaN as equal, so a model with NaN weights used to
pass every bitwise check. The capture therefore records, per captured tensor, the first
non-finite element (`first_nonfinite`: one reduction when all is well), and
every check kind turns a recorded one, on either side, into a failure with its location:

    non-finite (nan) in logits of r0 at position 17, vocab index 5 (reference side)

This module holds the detector, the location of the first non-finite item of one
request's capture per check, and the picking of the earliest of the two sides.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# the exact checks that own captured tensors (logits rows, KDA state points, MLA rows)
CHECKS = ("logits", "kda_state", "mla_rows")
SIDES = ("reference", "candidate")
_KDA_ORDER = ("recurrent", "conv_q", "conv_k", "conv_v")      # capture.KDA_TENSORS


@dataclass(frozen=True)
class NonFinite:
    """The first non-finite element of a tensor (flat order) and how many there are."""

    kind: str                       # "nan", "inf" or "-inf": the value found there
    index: int                      # flat index
    index_tuple: tuple[int, ...]    # the same index into the tensor's shape
    count: int                      # non-finite elements in the whole tensor

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "index": self.index, "index_tuple": list(self.index_tuple), "count": self.count}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "NonFinite":
        return cls(str(d["kind"]), int(d["index"]), tuple(int(i) for i in d["index_tuple"]), int(d["count"]))


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A flat index into `shape` as an index tuple."""
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def first_nonfinite(t: torch.Tensor, *, allow_neg_inf: bool = False) -> NonFinite | None:
    """None when every element is finite; else the first NaN / +-inf element (flat order).

    The finite case costs one reduction: a float sum is finite only if every term is (NaN
    and inf propagate through any summation order), and a sum of finite terms that
    overflows falls through to the exact search. `isfinite(t).all()` gives the same answer
    at 3-4x the cost on the capture's small tensors and 50x on a K3-vocab row (measured on
    the 2-core dev CPU, one thread: [4,16,16] 22.6 vs 6.1 us, [163840] 1278 vs 23 us).
    `allow_neg_inf` accepts -inf as a value (a masked token's log-probability) and
    reports NaN and +inf only. Integer and bool tensors are always finite.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"first_nonfinite needs a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        return None
    t = t.detach()
    if math.isfinite(float(t.sum())):
        return None
    flat = t.reshape(-1)
    bad = (torch.isnan(flat) | (flat == math.inf)) if allow_neg_inf else ~torch.isfinite(flat)
    where = bad.nonzero()
    if where.numel() == 0:
        return None
    i = int(where[0, 0])
    x = float(flat[i])
    kind = "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return NonFinite(kind, i, unravel(i, tuple(t.shape)), int(where.shape[0]))


def side_text(sides: tuple[str, ...]) -> str:
    return f"({sides[0]} side)" if len(sides) == 1 else "(reference and candidate sides)"


def _location(nf: NonFinite, rid: str, **where: Any) -> dict[str, Any]:
    return {"request": rid, **where, "nonfinite": nf.kind, "index": nf.index,
            "index_tuple": list(nf.index_tuple), "count": nf.count}


def _kda_order(key: tuple[int, str]) -> tuple[int, int]:
    layer, name = key
    return layer, _KDA_ORDER.index(name) if name in _KDA_ORDER else len(_KDA_ORDER)


def request_firsts(rc) -> dict[str, tuple[tuple, dict[str, Any], str]]:
    """check -> (order key, location, message without the side) of the first non-finite
    item in one request's capture (a capture.RequestCapture). Order keys compare within a
    check: (position,); (tokens, layer, tensor); (layer, flat index)."""
    out: dict[str, tuple[tuple, dict[str, Any], str]] = {}
    rid = rc.request_id
    bad_logits = [(p, rc.logits[p].nonfinite) for p in sorted(rc.logits) if rc.logits[p].nonfinite]
    if bad_logits:
        p, nf = bad_logits[0]
        out["logits"] = ((p,), _location(nf, rid, position=p, step=p - rc.prompt_len + 1, tensor="logits"),
                         f"non-finite ({nf.kind}) in logits of {rid} at position {p}, vocab index {nf.index}")
    bad_kda = [(n, key, rc.kda[n][key].nonfinite) for n in sorted(rc.kda)
               for key in sorted(rc.kda[n], key=_kda_order) if rc.kda[n][key].nonfinite]
    if bad_kda:
        n, (layer, name), nf = bad_kda[0]
        out["kda_state"] = ((n, *_kda_order((layer, name))),
                            _location(nf, rid, num_tokens=n, step=n - rc.prompt_len, tensor=name, layer=layer),
                            f"non-finite ({nf.kind}) in KDA layer {layer} {name} of {rid} after {n} tokens, "
                            f"index {nf.index_tuple}")
    bad_mla = [(layer, rc.mla[layer].nonfinite) for layer in sorted(rc.mla) if rc.mla[layer].nonfinite]
    if bad_mla:
        layer, nf = bad_mla[0]
        row = nf.index_tuple[0]                                  # rows [S, R]: the row is the position
        out["mla_rows"] = ((layer, nf.index), _location(nf, rid, position=row, tensor="mla_rows", layer=layer),
                           f"non-finite ({nf.kind}) in MLA layer {layer} cache rows of {rid} at row {row}, "
                           f"index {nf.index_tuple}")
    return out


def first_per_check(ref, cand, scenario: str) -> dict[str, dict[str, Any]]:
    """check -> {"reason", "sides", "first"} for the first non-finite item of either capture
    (capture.Capture), in CHECKS order. Requests in the reference's order, then the
    candidate's own; in a request the earlier location wins, and the same location on both
    sides says so."""
    rids = list(ref.requests) + [r for r in cand.requests if r not in ref.requests]
    out: dict[str, dict[str, Any]] = {}
    for rid in rids:
        firsts = {side: request_firsts(cap.requests[rid]) for side, cap in zip(SIDES, (ref, cand))
                  if rid in cap.requests}
        for check in CHECKS:
            hits = {side: f[check] for side, f in firsts.items() if check in f}
            if check in out or not hits:
                continue
            key = min(hit[0] for hit in hits.values())
            sides = tuple(side for side, hit in hits.items() if hit[0] == key)
            _, loc, text = hits[sides[0]]
            out[check] = {"reason": f"{text} {side_text(sides)}", "sides": list(sides),
                          "first": {"scenario": scenario, **loc, "side": "+".join(sides)}}
    return {c: out[c] for c in CHECKS if c in out}


def stopped_request(cap) -> str | None:
    """The request a stopped run was on: the first without a finish reason."""
    return next((rid for rid, rc in cap.requests.items() if rc.finish_reason is None), None)
