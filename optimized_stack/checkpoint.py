"""HF-format checkpoints: config.json + model.safetensors (or sharded with an index json).

Weight names are the HF ones (`model.layers.N.self_attn.q_proj.weight`, ...); the module
tree in optimized_stack.model uses the same names, so loading is a strict name match.
A missing, unexpected or mis-shaped tensor fails with one line naming it.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import K3Config
from .errors import CheckpointError
from .model.model import K3Model

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded via the index json)."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return load_file(str(path / WEIGHTS))
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{path / INDEX}: expected JSON with a 'weight_map', got {exc!r}") from None
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise CheckpointError(f"checkpoint shard {shard!r} named in {INDEX} is missing")
            out.update(load_file(str(path / shard)))
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise CheckpointError(f"tensor {missing[0]!r} is in {INDEX} but in none of its shards")
        return out
    raise CheckpointError(f"no weights in {path}: expected {WEIGHTS} or {INDEX}")


def _fit(name: str, tensor: torch.Tensor, target: torch.Tensor, cfg: K3Config) -> torch.Tensor:
    """Layout variants that are the same tensor: A_log as [H], (1,1,H,1) or padded [max(H,K)]."""
    if tensor.shape == target.shape:
        return tensor
    if name.endswith("self_attn.A_log"):
        flat = tensor.reshape(-1)
        if flat.numel() >= cfg.kda_num_heads:
            fixed = torch.zeros_like(target)
            fixed[:cfg.kda_num_heads] = flat[:cfg.kda_num_heads]
            return fixed
    if name.endswith("dt_bias") and tensor.numel() == target.numel():
        return tensor.reshape(target.shape)
    raise CheckpointError(f"tensor {name!r}: expected shape {tuple(target.shape)}, "
                          f"got {tuple(tensor.shape)}")


def _canonical_names(tensors: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
    """transformers' KimiLinear save_pretrained writes dense (non-MoE) layers as
    `block_sparse_moe.{gate,up,down}_proj`; real checkpoints use `mlp.*`. Map the former."""
    out = {}
    for name, t in tensors.items():
        alt = name.replace(".block_sparse_moe.", ".mlp.")
        if name not in params and alt in params and alt not in tensors:
            name = alt
        out[name] = t
    return out


def load_weights(model: K3Model, tensors: dict[str, torch.Tensor]) -> None:
    """Strictly copy tensors into model; every parameter must be provided exactly once."""
    params = dict(model.named_parameters())
    tensors = _canonical_names(tensors, params)
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise CheckpointError(f"tensor {missing[0]!r} is missing from the checkpoint "
                              f"({len(missing)} missing)")
    unexpected = sorted(set(tensors) - set(params))
    if unexpected:
        raise CheckpointError(f"tensor {unexpected[0]!r} in the checkpoint is not a parameter of "
                              f"this config ({len(unexpected)} unexpected)")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(_fit(name, tensors[name], p, model.config).to(p.dtype))


def save_checkpoint(model: K3Model, directory: str | Path) -> str:
    """Write config.json and model.safetensors atomically; returns the weights' sha256."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.named_parameters()}
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o644)            # mkstemp makes it 0600; checkpoints are shared files
        os.replace(tmp, directory / WEIGHTS)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    cfg_tmp = directory / "config.json.tmp"
    cfg_tmp.write_text(json.dumps(model.config.to_hf(), indent=2) + "\n")
    os.replace(cfg_tmp, directory / "config.json")
    return file_sha256(directory / WEIGHTS)


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
