"""Localise a divergence: replay one request on both paths with per-sublayer capture and
name the first (layer, sublayer) whose output differs.

The replay follows each path's own calling pattern (one whole-prompt forward for the
reference; the runner's split / state round trip for the candidate); when that shows nothing
it replays both as the request was served, prompt then one token per call (a fault in the
decode op, or in the state handed to it, runs only there). Either replay concatenates
every probe's rows per (layer, sublayer) across calls, so positions line up. Probe order
is execution order, so the first differing entry is where the fault entered.

Components name where a fault lives: "kda/mixer", "mla/mixer", "moe/ffn", "mlp/ffn",
"attn_res/attn_in", "attn_res/mlp_in", "attn_res/final_in", "norm/final_norm",
"head/logits", and from the state check "kda/conv" or "kda/recurrent".

Non-finite numbers come first: when either replay has a sublayer output holding NaN or
inf, the localisation names the first such sublayer (nothing before it is non-finite, so
that is where the NaN / inf entered), with the side, value and position; the first bitwise
difference, if any, stays under "first_difference". Equality is by bits (two NaNs with the
same bits are equal, as a hash sees them), not torch.equal's NaN != NaN.
"""
from __future__ import annotations

from typing import Any

import torch

from k3verify.capture.nonfinite import first_nonfinite, side_text
from k3verify.compare.tensors import compare_tensors, hash_tensor
from k3verify.run.sequential import _roundtrip
from optimized_stack import toggles as toggle_registry


def _record(model, feed) -> tuple[list[tuple[int, str]], dict[tuple[int, str], torch.Tensor]]:
    order: list[tuple[int, str]] = []
    rows: dict[tuple[int, str], list[torch.Tensor]] = {}

    def probe(layer: int, name: str, t: torch.Tensor) -> None:
        key = (layer, name)
        if key not in rows:
            order.append(key)
            rows[key] = []
        rows[key].append(t.detach().clone())
    with model.probe(probe):
        feed()
    return order, {k: torch.cat(v) for k, v in rows.items()}


def _feed(model, ids: torch.Tensor, runner_opts: dict[str, Any], decode_from: int | None = None):
    """The replay's calls: one whole forward (or the runner's chunks / round trips); with
    `decode_from`, the prompt ids[:decode_from] in one forward and then one token per forward, as
    the request ran (a fault in the decode op or in the state it is handed shows only there)."""
    chunk = runner_opts.get("prefill_chunk")
    roundtrip = bool(runner_opts.get("state_roundtrip"))

    def run() -> None:
        st = model.new_state()
        if decode_from is not None:
            pieces = [ids[:decode_from], *ids[decode_from:].split(1)]
        elif not chunk and not roundtrip:
            model.forward(ids, st)
            return
        else:
            pieces = list(ids.split(chunk or 1))
        for piece in pieces:
            model.forward(piece, st)
            if roundtrip:
                st = _roundtrip(st, bool(runner_opts.get("roundtrip_drops_conv")))
    return run


def component(model, layer: int, sublayer: str) -> str:
    if sublayer in ("attn_in", "mlp_in", "final_in"):
        return f"attn_res/{sublayer}" if model.config.attn_res_block_size is not None else f"residual/{sublayer}"
    if layer < 0:
        return {"embed": "embed/embed", "final_norm": "norm/final_norm", "logits": "head/logits"}.get(sublayer, sublayer)
    if sublayer == "mixer":
        return f"{model.config.layer_kinds[layer]}/mixer"
    if sublayer == "ffn":
        return "moe/ffn" if model.config.is_moe_layer(layer) else "mlp/ffn"
    return f"layer/{sublayer}"


def localize_request(model, toggle_name: str, ids: list[int], *, request_id: str = "",
                     state_first: dict | None = None, prompt_len: int | None = None) -> dict[str, Any]:
    """First differing (layer, sublayer) between reference and `toggle_name` on `ids`, or,
    when either replay holds NaN / inf, the first sublayer whose output does. When the whole-
    prompt replay shows no difference and `prompt_len` is given, the request is replayed again
    as it was served, prompt then one token per call (out["replay"] says which replay found it)."""
    out = _localize_once(model, toggle_name, ids, request_id, state_first, None)
    if out.get("sublayer") in (None, "state") and prompt_len is not None and 0 < prompt_len < len(ids):
        stepped = _localize_once(model, toggle_name, ids, request_id, state_first, prompt_len)
        if stepped.get("sublayer") not in (None, "state"):
            return {**stepped, "replay": f"prompt of {prompt_len} then one token per call"}
    return {**out, "replay": "whole prompt"}


def _localize_once(model, toggle_name: str, ids: list[int], request_id: str, state_first: dict | None,
                   decode_from: int | None) -> dict[str, Any]:
    ids_t = torch.tensor(ids, dtype=torch.long)
    order, ref = _record(model, _feed(model, ids_t, {}, decode_from))
    ref_nf = _first_nonfinite_probe(model, order, ref)
    with toggle_registry.applied([toggle_name]) as applied:
        if applied.engine:
            out = state_only(model, state_first, "engine toggle: replayed by state check only")
            return _nonfinite_first(order, out, ref_nf, None, request_id, len(ids))
        cand_order, cand = _record(model, _feed(model, ids_t, applied.runner, decode_from))
    cand_nf = _first_nonfinite_probe(model, cand_order, cand)
    out = _first_difference(model, order, ref, cand, request_id, len(ids), state_first)
    return _nonfinite_first(order, out, ref_nf, cand_nf, request_id, len(ids))


def _first_difference(model, order, ref, cand, request_id: str, n_ids: int, state_first) -> dict[str, Any]:
    for layer, name in order:
        a, b = ref[(layer, name)], cand.get((layer, name))
        if b is None or hash_tensor(a) != hash_tensor(b):
            f = compare_tensors(a, b, label=f"layer {layer} {name}") if b is not None else None
            first_pos = f.first_index_tuple[0] if f is not None and f.first_index_tuple else None
            out = {"request": request_id, "layer": layer, "sublayer": name,
                   "layer_kind": model.config.layer_kinds[layer] if layer >= 0 else None,
                   "component": component(model, layer, name),
                   "first_position": first_pos,
                   "max_abs": f.max_abs if f else None, "max_ulp": f.max_ulp if f else None,
                   "tokens_replayed": n_ids}
            state = _state_component(state_first)
            if state and state["layer"] == layer and name == "mixer":
                # the state check saw which state tensor went wrong first: that is finer
                out["component"], out["state"] = state["component"], state
            return out
    return state_only(model, state_first, "no sublayer output differs on a single-request replay")


def _first_nonfinite_probe(model, order, rows) -> dict[str, Any] | None:
    """Where the first sublayer output (in execution order) holding NaN / inf is."""
    for layer, name in order:
        t = rows.get((layer, name))
        nf = None if t is None else first_nonfinite(t)
        if nf is not None:
            return {"layer": layer, "sublayer": name,
                    "layer_kind": model.config.layer_kinds[layer] if layer >= 0 else None,
                    "component": component(model, layer, name),
                    "first_position": nf.index_tuple[0] if t.dim() >= 2 else None,   # rows are [T, ...]
                    "nonfinite": nf.kind, "index": nf.index, "index_tuple": list(nf.index_tuple),
                    "count": nf.count}
    return None


def _nonfinite_first(order, out: dict[str, Any], ref_nf, cand_nf, request_id: str, n_ids: int) -> dict[str, Any]:
    """A non-finite sublayer output outranks a bitwise difference: name the earliest in the
    reference's execution order (the same sublayer on both sides says so)."""
    def rank(loc: dict[str, Any]) -> int:
        key = (loc["layer"], loc["sublayer"])
        return order.index(key) if key in order else len(order)
    hits = {side: loc for side, loc in (("reference", ref_nf), ("candidate", cand_nf)) if loc is not None}
    if not hits:
        return out
    best = min(rank(loc) for loc in hits.values())
    sides = tuple(side for side, loc in hits.items() if rank(loc) == best)
    loc = hits[sides[0]]
    return {"request": request_id, **loc, "side": "+".join(sides), "tokens_replayed": n_ids,
            "reason": f"first sublayer whose output is non-finite ({loc['nonfinite']}): layer {loc['layer']} "
                      f"{loc['sublayer']} at position {loc['first_position']} {side_text(sides)}",
            "first_difference": out}


def _state_component(first: dict | None) -> dict | None:
    if first and first.get("tensor") == "mla_rows":
        return {"layer": first["layer"], "tensor": "mla_rows", "num_tokens": None, "component": "mla/cache"}
    if not first or first.get("tensor") not in ("recurrent", "conv_q", "conv_k", "conv_v"):
        return None
    part = "conv" if first["tensor"].startswith("conv") else "recurrent"
    return {"layer": first["layer"], "tensor": first["tensor"], "num_tokens": first.get("num_tokens"),
            "component": f"kda/{part}"}


def state_only(model, state_first: dict | None, note: str) -> dict[str, Any]:
    """A localisation from the state check alone (the layer and state tensor seen wrong first)."""
    state = _state_component(state_first)
    if state is None:
        return {"layer": None, "sublayer": None, "component": None, "note": note}
    return {"layer": state["layer"], "sublayer": "state",
            "layer_kind": "mla" if state["tensor"] == "mla_rows" else "kda",
            "component": state["component"], "state": state, "note": note}
