"""Localise a divergence: replay one request on both paths with per-sublayer capture and
name the first (layer, sublayer) whose output differs.

The replay follows each path's own calling pattern (one whole-prompt forward for the
reference; the runner's split / state round trip for the candidate), and concatenates
every probe's rows per (layer, sublayer) across calls, so positions line up. Probe order
is execution order, so the first differing entry is where the fault entered.

Components name where a fault lives: "kda/mixer", "mla/mixer", "moe/ffn", "mlp/ffn",
"attn_res/attn_in", "attn_res/mlp_in", "attn_res/final_in", "norm/final_norm",
"head/logits", and from the state check "kda/conv" or "kda/recurrent".
"""
from __future__ import annotations

from typing import Any

import torch

from optimized_stack import toggles as toggle_registry

from .compare import compare_tensors
from .runner import _roundtrip


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


def _feed(model, ids: torch.Tensor, runner_opts: dict[str, Any]):
    chunk = runner_opts.get("prefill_chunk")
    roundtrip = bool(runner_opts.get("state_roundtrip"))

    def run() -> None:
        st = model.new_state()
        if not chunk and not roundtrip:
            model.forward(ids, st)
            return
        step = chunk or 1
        for piece in ids.split(step):
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
                     state_first: dict | None = None) -> dict[str, Any]:
    """First differing (layer, sublayer) between reference and `toggle_name` on `ids`."""
    ids_t = torch.tensor(ids, dtype=torch.long)
    order, ref = _record(model, _feed(model, ids_t, {}))
    with toggle_registry.applied([toggle_name]) as applied:
        if applied.engine:
            return _state_only(model, state_first, "engine toggle: replayed by state check only")
        _, cand = _record(model, _feed(model, ids_t, applied.runner))
    for layer, name in order:
        a, b = ref[(layer, name)], cand.get((layer, name))
        if b is None or not torch.equal(a, b):
            f = compare_tensors(a, b, label=f"layer {layer} {name}") if b is not None else None
            diff_rows = (a != b).reshape(a.shape[0], -1).any(-1).nonzero() if b is not None and a.shape == b.shape else None
            out = {"request": request_id, "layer": layer, "sublayer": name,
                   "layer_kind": model.config.layer_kinds[layer] if layer >= 0 else None,
                   "component": component(model, layer, name),
                   "first_position": int(diff_rows[0]) if diff_rows is not None and diff_rows.numel() else None,
                   "max_abs": f.max_abs if f else None, "max_ulp": f.max_ulp if f else None,
                   "tokens_replayed": len(ids)}
            state = _state_component(state_first)
            if state and state["layer"] == layer and name == "mixer":
                # the state check saw which state tensor went wrong first: that is finer
                out["component"], out["state"] = state["component"], state
            return out
    return _state_only(model, state_first, "no sublayer output differs on a single-request replay")


def _state_component(first: dict | None) -> dict | None:
    if first and first.get("tensor") == "mla_rows":
        return {"layer": first["layer"], "tensor": "mla_rows", "num_tokens": None, "component": "mla/cache"}
    if not first or first.get("tensor") not in ("recurrent", "conv_q", "conv_k", "conv_v"):
        return None
    part = "conv" if first["tensor"].startswith("conv") else "recurrent"
    return {"layer": first["layer"], "tensor": first["tensor"], "num_tokens": first.get("num_tokens"),
            "component": f"kda/{part}"}


def _state_only(model, state_first: dict | None, note: str) -> dict[str, Any]:
    state = _state_component(state_first)
    if state is None:
        return {"layer": None, "sublayer": None, "component": None, "note": note}
    return {"layer": state["layer"], "sublayer": "state",
            "layer_kind": "mla" if state["tensor"] == "mla_rows" else "kda",
            "component": state["component"], "state": state, "note": note}
