"""Capture: what a run produced, per request, as hashes (and tensors when asked).

A Capture is an engine observer (the same four methods the optimized stack's engine and
the verifier's sequential runner call):
- on_logits(request, start_pos, rows [n, V])  -> one hash per position's full fp32 row
- on_kda_state(request, num_tokens, layer, state) -> hashes of recurrent state and conv windows
- on_finish(request, result, mla_rows {layer: [S, R]}) -> the token stream and MLA row hashes
- on_step(step, scheduled)                   -> step count
and the engine's batched forms of the first two (on_logits_rows, on_kda_states: every request of a
step in one call, so on the device one digest launch covers all of them). Where its digests are the
device's (m31x4), a capture also offers the engine a digester to run inside the fast decode step and
its CUDA graph (step_digester, on_step_words: optimized_stack/engine/fast/step_digests.py), so a
watched step adds no launches of its own; `in_step=False` keeps the calls after the step (the bench's
other arm). The items are the same either way (tests/test_step_digests.py).

Hash by default (cheap); `keep=True` also keeps the tensors, which the comparator needs
to turn a hash mismatch into ULP / KL findings. Beside every hash the capture records the
tensor's first non-finite element (k3verify.capture.nonfinite: one reduction per tensor, one per
logits block), because a hash cannot tell a NaN row from a good one. A run the
sampler stopped (a NaN / +inf row it refuses to pick a token from) keeps what it captured
and says why in `stopped`. `events` holds the run's path counters (optimized_stack/events.py:
what fired, how often; the gate holds a toggle's declared events against them) and `metrics`
the engine's reuse statistics (theoretical reusable prefix vs prefix hits). The file format is versioned JSON: v2 adds "finite_checked",
"stopped" and per request "nonfinite" (only the non-finite items); v1 files (golden
hashes recorded before v2) still load, with finiteness unknown.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3verify.capture.nonfinite import NonFinite, first_nonfinite, unravel
from k3verify.compare import device_digest
from k3verify.compare.tensors import hash_tensor
from k3verify.io import atomic_write_json

CAPTURE_FORMAT = "k3verify.capture"
CAPTURE_VERSION = 2
READABLE_VERSIONS = (1, 2)
KDA_TENSORS = ("recurrent", "conv_q", "conv_k", "conv_v")


class Item:
    """One captured tensor: its hash, its first non-finite element (None: all finite, or
    not recorded when the capture's finite_checked is False) and, when kept, the tensor.

    A CUDA tensor's item starts pending: its digest and finiteness summary are reductions already
    launched on the device (compare/device_digest.py), read back with every other pending item of
    the capture in one transfer the first time any of them is asked for."""

    __slots__ = ("_digest", "tensor", "_nonfinite", "_pending")

    def __init__(self, digest: str | None = None, tensor: torch.Tensor | None = None,
                 nonfinite: NonFinite | None = None, pending: "_Pending | None" = None):
        self._digest, self.tensor, self._nonfinite, self._pending = digest, tensor, nonfinite, pending

    @property
    def digest(self) -> str:
        if self._pending is not None:
            self._pending.resolve()
        return self._digest

    @property
    def nonfinite(self) -> NonFinite | None:
        if self._pending is not None:
            self._pending.resolve()
        return self._nonfinite

    def __repr__(self) -> str:
        return f"Item({self.digest!r}, nonfinite={self.nonfinite!r}, kept={self.tensor is not None})"


class _Pending:
    """Device digests and finiteness summaries launched, not yet read: groups of (items, dtype,
    shape of one item, summary words [k, WORDS]); resolve() reads them all in one transfer."""

    LIMIT = 4096            # groups held before a resolve (their small device tensors, bounded)

    def __init__(self) -> None:
        self.groups: list[tuple[list[Item], torch.dtype, tuple[int, ...], torch.Tensor, torch.Tensor]] = []

    def add(self, t: torch.Tensor, rows: bool) -> list[Item]:
        """Items for t (one per leading row when `rows`), their reductions launched on t's device."""
        return self.register(device_digest.summary_words(t, rows=rows), t.dtype,
                             tuple(t.shape[1:] if rows else t.shape))

    def register(self, words: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> list[Item]:
        """Items for summary words already launched (one per row of `words`, each of `shape`)."""
        items = [Item(pending=self) for _ in range(words.shape[0])]
        self.groups.append((items, dtype, shape, words))
        if len(self.groups) >= self.LIMIT:
            self.resolve()
        return items

    def resolve(self) -> None:
        if not self.groups:
            return
        groups, self.groups = self.groups, []
        every = torch.cat([g[3] for g in groups]).tolist()          # the one transfer
        i = 0
        for items, dtype, shape, _ in groups:
            for item in items:
                lanes, bad = device_digest.read_words(every[i])
                i += 1
                item._digest = device_digest.format_digest(dtype, shape, lanes)
                item._nonfinite = None if bad is None else NonFinite(
                    device_digest.NONFINITE_KINDS[bad[2]], bad[1], unravel(bad[1], shape), bad[0])
                item._pending = None


@dataclass
class RequestCapture:
    request_id: str
    prompt_len: int = 0
    tokens: list[int] = field(default_factory=list)              # generated tokens
    finish_reason: str | None = None
    logits: dict[int, Item] = field(default_factory=dict)        # position -> row
    kda: dict[int, dict[tuple[int, str], Item]] = field(default_factory=dict)   # num_tokens -> (layer, tensor)
    mla: dict[int, Item] = field(default_factory=dict)           # layer -> all rows at finish


class Capture:
    """Collects hashes (and optionally tensors) of every logit row and state point of a run."""

    def __init__(self, *, keep: bool = False, label: str = "", in_step: bool = True):
        self.keep = keep
        self.in_step = in_step              # offer the engine's fast step a digester (see the docstring)
        self._pending = _Pending()
        self.label = label
        self._requests: dict[str, RequestCapture] = {}
        # the batched calls' launched digests, not yet filed per request: (kind, points, layer, name,
        # dtype, row shape, words). Filing B x 37 items a step in Python cost ~7 ms a step at B = 64
        # (session 17, the CPU); the engine's step now only launches and appends, and the items are
        # filed the first time `requests` is read (or every _Pending.LIMIT calls, memory bounded).
        # A fast step's words come as one entry, ("step", layout, logits points, state points, words),
        # expanded into its layout's groups only when filed: per step one append, not one a tensor.
        self._deferred: list[tuple] = []
        self._deferred_groups = 0           # groups the entries hold (the memory bound counts these)
        self.steps = 0
        self.finite_checked = True          # False: loaded from a v1 file, finiteness unknown
        self.stopped: str | None = None     # why the run stopped early (the sampler refused a row)
        self.events: dict[str, int] = {}     # path counters of the run (name -> times fired)
        self.metrics: dict[str, float] = {}  # engine reuse statistics (EngineMetrics.to_dict)

    def _item(self, t: torch.Tensor, check: bool = True) -> Item:
        t = t.detach()
        if device_digest.on_device(t) and not self.keep:
            return self._pending.add(t, rows=False)[0]
        return Item(hash_tensor(t), t.clone().cpu() if self.keep else None,
                    first_nonfinite(t) if check else None)

    @property
    def requests(self) -> dict[str, RequestCapture]:
        """Per request what the run produced (the deferred batched calls filed first)."""
        self._flush()
        return self._requests

    def request(self, request_id: str) -> RequestCapture:
        self._flush()                 # a per-request call files after every batched call before it
        return self._request(request_id)

    def _request(self, request_id: str) -> RequestCapture:
        rc = self._requests.get(request_id)
        if rc is None:
            rc = self._requests[request_id] = RequestCapture(request_id)
        return rc

    def _defer(self, kind: str, points: list, layer: int, name: str, t: torch.Tensor,
               words: torch.Tensor | None = None) -> None:
        if words is None:
            words = device_digest.summary_words(t, rows=True)
        self._defer_words(kind, points, layer, name, t.dtype, tuple(t.shape[1:]), words)

    def _defer_words(self, kind: str, points: list, layer: int, name: str, dtype: torch.dtype,
                     shape: tuple[int, ...], words: torch.Tensor) -> None:
        self._deferred.append((kind, points, layer, name, dtype, shape, words))
        self._deferred_groups += 1
        if self._deferred_groups >= _Pending.LIMIT:
            self._flush()

    def _flush(self) -> None:
        """File the deferred batched calls' items in the order the calls came (a later call's item
        for the same key replaces an earlier one's, as the direct calls do)."""
        if not self._deferred:
            return
        batches, self._deferred, self._deferred_groups = self._deferred, [], 0
        for kind, points, layer, name, dtype, shape, words in self._expanded(batches):
            items = self._pending.register(words, dtype, shape)
            if kind == "logits":
                for (rid, pos), item in zip(points, items):
                    self._request(rid).logits[pos] = item
            else:
                key = (layer, name)
                for (rid, n), item in zip(points, items):
                    self._request(rid).kda.setdefault(n, {})[key] = item

    @staticmethod
    def _expanded(batches: list[tuple]):
        """The deferred entries as (kind, points, layer, name, dtype, shape, words) groups, a step's
        entry as its layout's groups in layout order (what on_step_words filed one by one before)."""
        for entry in batches:
            if entry[0] != "step":
                yield entry
                continue
            _, layout, logits_points, state_points, words = entry
            for e, w in zip(layout, words.unbind(0)):
                if e.kind == "logits":
                    yield "logits", logits_points, -1, "", e.dtype, e.shape, w
                else:
                    yield "kda", state_points, e.layer, e.name, e.dtype, e.shape, w

    # ---- observer API -----------------------------------------------------------------
    def on_request(self, request_id: str, prompt_len: int) -> None:
        self._request(request_id).prompt_len = prompt_len         # no deferred item shares its keys

    def on_logits(self, request_id: str, start_pos: int, rows: torch.Tensor) -> None:
        rc = self.request(request_id)
        if device_digest.on_device(rows) and not self.keep and rows.shape[0]:
            # the block's rows digested in one batched reduction on the device, read back later
            for i, item in enumerate(self._pending.add(rows.detach(), rows=True)):
                rc.logits[start_pos + i] = item
            return
        block_finite = first_nonfinite(rows) is None            # one reduction for the [n, V] block
        for i in range(rows.shape[0]):
            rc.logits[start_pos + i] = self._item(rows[i], check=not block_finite)

    def on_logits_rows(self, points: list[tuple[str, int]], rows: torch.Tensor) -> None:
        """The engine's batched form: rows[i] is the logits row of points[i] = (request, position).
        On the device one reduction digests every row (one launch a step, not one per request)."""
        if device_digest.on_device(rows) and not self.keep and rows.shape[0]:
            self._defer("logits", points, -1, "", rows.detach())
            return
        for i, (rid, pos) in enumerate(points):
            self.on_logits(rid, pos, rows[i:i + 1])

    def on_kda_states(self, points: list[tuple[str, int]], layer: int, stacked: dict[str, torch.Tensor]) -> None:
        """The engine's batched form: stacked[name][i] is `layer`'s tensor `name` for points[i] =
        (request, num_tokens), a copy the engine made for the observers. Each row's item is the one
        on_kda_state would record for it (a row of the stack has the request tensor's bytes and shape)."""
        device = [name for name in KDA_TENSORS
                  if device_digest.on_device(stacked[name]) and not self.keep and stacked[name].shape[0]]
        # the layer's tensors digested together: one words buffer and one launch per kind of tensor
        words = dict(zip(device, device_digest.summary_words_many([stacked[n].detach() for n in device])))
        for name in KDA_TENSORS:
            t = stacked[name].detach()
            if name in words:
                self._defer("kda", points, layer, name, t, words[name])
                continue
            items = [self._item(t[i]) for i in range(t.shape[0])]
            for (rid, n), item in zip(points, items):
                self.request(rid).kda.setdefault(n, {})[(layer, name)] = item

    def step_digester(self, device: torch.device):
        """The digester the engine's fast step may run inside itself (and its graph) for this capture:
        the device digest's, where this capture would take m31x4 digests of tensors on `device` and
        keeps no tensors; else None (the engine then makes the calls after the step)."""
        if self.keep or not self.in_step or not device_digest.on_device(torch.empty(0, device=device)):
            return None
        return device_digest.StepDigester()

    def on_step_words(self, layout: list, logits_points: list[tuple[str, int]],
                      state_points: list[tuple[str, int]], words: torch.Tensor) -> None:
        """The fast step's own digests: words[j][i] are the summary words of layout[j]'s row i, the
        logits row of logits_points[i] or KDA layer layout[j].layer's tensor of state_points[i]; filed
        as on_logits_rows / on_kda_states file theirs (the same items)."""
        if words.shape[0] != len(layout):
            raise ValueError(f"on_step_words: {words.shape[0]} words rows for a layout of {len(layout)} tensors")
        self._deferred.append(("step", layout, logits_points, state_points, words))
        self._deferred_groups += len(layout)
        if self._deferred_groups >= _Pending.LIMIT:
            self._flush()

    def on_kda_state(self, request_id: str, num_tokens: int, layer: int, state: Any) -> None:
        point = self.request(request_id).kda.setdefault(num_tokens, {})
        for name in KDA_TENSORS:
            point[(layer, name)] = self._item(getattr(state, name))

    def on_finish(self, request_id: str, result: Any, mla_rows: dict[int, torch.Tensor]) -> None:
        rc = self._request(request_id)        # tokens and MLA rows: no deferred item shares their keys
        rc.tokens = [int(t) for t in result.tokens]
        rc.finish_reason = getattr(result, "finish_reason", None)
        if not rc.prompt_len:
            rc.prompt_len = len(result.prompt_ids)
        for layer, rows in mla_rows.items():
            rc.mla[layer] = self._item(rows)

    def on_step(self, step_index: int, scheduled: list) -> None:
        self.steps += 1

    # ---- file format ----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": CAPTURE_FORMAT, "version": CAPTURE_VERSION, "label": self.label,
            "steps": self.steps, "finite_checked": self.finite_checked, "stopped": self.stopped,
            "events": dict(sorted(self.events.items())), "metrics": dict(self.metrics),
            "requests": {
                rid: {"prompt_len": rc.prompt_len, "tokens": rc.tokens, "finish_reason": rc.finish_reason,
                      "logits": {str(p): it.digest for p, it in sorted(rc.logits.items())},
                      "kda": {str(n): {f"{layer}:{name}": it.digest for (layer, name), it in sorted(pt.items())}
                              for n, pt in sorted(rc.kda.items())},
                      "mla": {str(layer): it.digest for layer, it in sorted(rc.mla.items())},
                      "nonfinite": _nonfinite_json(rc)}
                for rid, rc in self.requests.items()},
        }

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(path, self.to_json())

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Capture":
        version = data.get("version")
        if data.get("format") != CAPTURE_FORMAT or version not in READABLE_VERSIONS:
            raise ValueError(f"capture: expected format {CAPTURE_FORMAT} v{CAPTURE_VERSION} (or v1), "
                             f"got {data.get('format')!r} v{version!r}")
        cap = cls(label=data.get("label", ""))
        cap.steps = data.get("steps", 0)
        cap.finite_checked = version >= 2 and bool(data.get("finite_checked", True))
        cap.stopped = data.get("stopped")
        cap.events = {str(k): int(v) for k, v in data.get("events", {}).items()}
        cap.metrics = dict(data.get("metrics", {}))
        for rid, r in data["requests"].items():
            rc = cap.request(rid)
            rc.prompt_len, rc.tokens, rc.finish_reason = r["prompt_len"], r["tokens"], r["finish_reason"]
            nf = r.get("nonfinite", {})
            rc.logits = {int(p): Item(d, nonfinite=_nf(nf.get("logits", {}).get(p))) for p, d in r["logits"].items()}
            for n, pt in r["kda"].items():
                marks = nf.get("kda", {}).get(n, {})
                rc.kda[int(n)] = {(int(k.split(":")[0]), k.split(":")[1]): Item(d, nonfinite=_nf(marks.get(k)))
                                  for k, d in pt.items()}
            rc.mla = {int(layer): Item(d, nonfinite=_nf(nf.get("mla", {}).get(layer)))
                      for layer, d in r["mla"].items()}
        return cap


def _nf(d: dict[str, Any] | None) -> NonFinite | None:
    return None if d is None else NonFinite.from_json(d)


def _nonfinite_json(rc: RequestCapture) -> dict[str, Any]:
    """Only the non-finite items (a finite run writes {}), keyed like the digests."""
    out: dict[str, Any] = {}
    logits = {str(p): it.nonfinite.to_json() for p, it in sorted(rc.logits.items()) if it.nonfinite}
    kda = {str(n): marks for n, pt in sorted(rc.kda.items())
           if (marks := {f"{layer}:{name}": it.nonfinite.to_json()
                         for (layer, name), it in sorted(pt.items()) if it.nonfinite})}
    mla = {str(layer): it.nonfinite.to_json() for layer, it in sorted(rc.mla.items()) if it.nonfinite}
    for key, value in (("logits", logits), ("kda", kda), ("mla", mla)):
        if value:
            out[key] = value
    return out
