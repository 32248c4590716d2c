"""`k3verify info`: what model is this? Config, layer map, parameter counts, where it came from."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from rich.table import Table

from k3verify.commands import add_json_flag, add_model_flag, console, emit_json, model_load_options

NAME = "info"
HELP = "show a model's config, layer map (K=KDA, M=MLA), parameter counts and checkpoint hash"

# A routed expert's weights live under "...experts..." (per-expert modules or stacked
# [E, ...] tensors); "shared_experts" and the latent "routed_expert_*_proj" are always active.
_ROUTED_RE = re.compile(r"(^|\.)experts(\.|$)")


def add_arguments(parser) -> None:
    add_model_flag(parser)
    add_json_flag(parser)


def run(args) -> int:
    from optimized_stack import load_model  # torch import is slow; only commands that need it pay

    model = load_model(args.model, **model_load_options(args))
    source = describe_source(args.model)
    source["loaded"] = getattr(model, "source", None)
    source["stored_dtype"] = getattr(model, "stored_dtype", None)     # the checkpoint's, before any cast
    cfg = model.config
    params = count_parameters(model)
    layer_map = cfg.layer_map()

    out = console()
    out.print(_config_table(cfg, layer_map))
    out.print(_params_table(params))
    out.print(_source_table(source))
    if args.json:
        emit_json(
            {
                "command": NAME,
                "source": source,
                "layer_map": layer_map,
                "params": params,
                "config": _config_dict(cfg),
            }
        )
    return 0


def count_parameters(model) -> dict:
    """Total, routed-expert and active-per-token parameter counts.

    Active per token = everything except the routed experts a token does not select:
    the routed experts contribute routed * top_k / num_experts (each expert the same size).
    """
    total = routed = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if _ROUTED_RE.search(name):
            routed += p.numel()
    cfg = model.config
    active_routed = routed * cfg.num_experts_per_token // cfg.num_experts if cfg.num_experts else routed
    return {"total": total, "routed_experts": routed, "active_per_token": total - routed + active_routed}


def describe_source(model_arg: str | None) -> dict:
    """Where the weights come from, and the checkpoint's sha256 when a file backs them."""
    from optimized_stack import DEFAULT_MODEL
    from optimized_stack.checkpoint import WEIGHTS, file_sha256

    if model_arg is None:
        directory, kind = Path(DEFAULT_MODEL), "embedded"
    elif Path(model_arg).is_dir():
        directory, kind = Path(model_arg), "directory"
    else:
        # load_model has accepted it and it is not a directory: a preset, seeded random weights.
        return {"kind": "preset", "name": model_arg, "path": None, "sha256": None}
    ckpt = directory / WEIGHTS
    return {
        "kind": kind,
        "name": model_arg,
        "path": str(directory.resolve()),
        "sha256": file_sha256(ckpt) if ckpt.is_file() else None,
    }


def _config_dict(cfg) -> dict:
    d = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg))
    d["layer_kinds"] = list(cfg.layer_kinds)
    return d


def _config_table(cfg, layer_map: str) -> Table:
    t = Table(title="config", show_header=True)
    t.add_column("field")
    t.add_column("value", overflow="fold")
    t.add_row("layer_map", layer_map)
    for key, value in _config_dict(cfg).items():
        if key != "layer_kinds":  # shown as the layer map
            t.add_row(key, str(value))
    return t


def _params_table(params: dict) -> Table:
    t = Table(title="parameters")
    t.add_column("count")
    t.add_column("value", justify="right")
    for key in ("total", "routed_experts", "active_per_token"):
        t.add_row(key, f"{params[key]:,}")
    return t


def _source_table(source: dict) -> Table:
    t = Table(title="source")
    t.add_column("field")
    t.add_column("value", overflow="fold")
    for key in ("kind", "name", "path", "sha256", "stored_dtype", "loaded"):
        t.add_row(key, "-" if source.get(key) is None else str(source[key]))
    return t
