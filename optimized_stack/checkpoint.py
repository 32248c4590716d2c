"""HF-format checkpoints: config.json + model.safetensors (or sharded with an index json).

Weight names are the HF ones (`model.layers.N.self_attn.q_proj.weight`, ...); the module
tree in optimized_stack.model uses the same names, so loading is a strict name match.
A missing, unexpected or mis-shaped tensor, a file that is not (or no longer) safetensors,
an index its shards disagree with, a non-float dtype, a float16/float64 tensor (unless a
cast is asked for) and a NaN or inf (unless allowed) each fail with one line naming it.
Loading only reads: nothing on disk is written or touched.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from . import safe_load
from .config import K3Config
from .errors import CheckpointError
from .model.model import K3Model

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Real K3 ships bf16 (a few fp32 tensors: router, dt_bias); our checkpoints are fp32. Both
# load into the fp32 model exactly. float16/float64 would be converted: only when asked.
ACCEPTED_DTYPES = (torch.float32, torch.bfloat16)
CASTABLE_DTYPES = (torch.float16, torch.float64)


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded via the index json)."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return _load_file(path / WEIGHTS)
    if (path / INDEX).is_file():
        shards = _read_index(path)
        out: dict[str, torch.Tensor] = {}
        for shard, names in shards.items():
            tensors = _load_file(path / shard)
            extra = sorted(set(tensors) - names)
            if extra:
                where = [s for s, n in shards.items() if extra[0] in n]
                listed = f"lists it under {where[0]!r}" if where else "does not list it"
                raise CheckpointError(f"shard {shard!r} holds tensor {extra[0]!r}, but {INDEX} {listed}")
            missing = sorted(names - set(tensors))
            if missing:
                raise CheckpointError(f"tensor {missing[0]!r} is mapped to shard {shard!r} in {INDEX}, "
                                      f"but that shard does not hold it ({len(missing)} missing)")
            out.update(tensors)
        return out
    raise CheckpointError(f"no weights in {path}: expected {WEIGHTS} or {INDEX}")


def _read_index(path: Path) -> dict[str, set[str]]:
    """shard file -> the tensor names the index maps to it; shards must exist inside path."""
    index = path / INDEX
    try:
        weight_map = safe_load.read_json(index, error=CheckpointError)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: expected JSON with a 'weight_map', got {exc!r}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: expected 'weight_map' to map tensor names to shard file names, "
                              f"got {type(weight_map).__name__}")
    shards: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, set()).add(name)
    for shard in sorted(shards):
        if Path(shard).name != shard:
            raise CheckpointError(f"{INDEX}: expected shard file names inside {path}, got {shard!r}")
        if not (path / shard).is_file():
            raise CheckpointError(f"checkpoint shard {shard!r} named in {INDEX} is missing")
    return dict(sorted(shards.items()))


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: {_what_is_wrong(file, exc)}") from None


def _what_is_wrong(file: Path, exc: Exception) -> str:
    """Why safetensors refused the file, in words: empty, truncated, or not safetensors at all.

    The format: an 8-byte little-endian header length N, N bytes of JSON, then the tensor
    bytes, which the header's data_offsets must cover exactly.
    """
    size = file.stat().st_size
    if size == 0:
        return "expected a safetensors file, got an empty file (0 bytes)"
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"expected a safetensors file (8-byte header length first), got {size} bytes"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return (f"expected a safetensors file, got one whose first 8 bytes declare a {n:,}-byte header "
                    f"but only {size - 8:,} bytes follow (not safetensors, or truncated inside the header)")
        try:
            header = safe_load.loads_json(f.read(n), str(file))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "expected a safetensors file, got a header that is not safetensors JSON"
    if end > size - 8 - n:
        return (f"truncated: the header needs {end:,} bytes of tensor data, the file has {size - 8 - n:,} "
                f"({size:,} bytes in all)")
    return f"not a readable safetensors file ({' '.join(str(exc).split())})"


def check_tensor(name: str, tensor: torch.Tensor, allow_nonfinite: bool = False,
                 allow_dtype_cast: bool = False) -> None:
    """A stored tensor must be fp32/bf16 (fp16/fp64 only with allow_dtype_cast) and finite
    (unless allow_nonfinite: a deliberately poisoned model for the run-time NaN checks)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.dtype in CASTABLE_DTYPES and not allow_dtype_cast:
        raise CheckpointError(f"tensor {name!r}: expected float32 or bfloat16, got {dtype} (not converted "
                              "silently: pass allow_dtype_cast=True, CLI --allow-weight-cast, to cast it)")
    if tensor.dtype not in ACCEPTED_DTYPES + CASTABLE_DTYPES:
        raise CheckpointError(f"tensor {name!r}: expected a float32 or bfloat16 tensor, got {dtype}")
    if allow_nonfinite:
        return
    bad = ~torch.isfinite(tensor)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise CheckpointError(
            f"tensor {name!r}: expected finite values, got {int(bad.sum())} of {tensor.numel()} non-finite, "
            f"first {tensor[idx].item()} at index {idx} (pass allow_nonfinite=True, CLI "
            "--allow-nonfinite-weights, to load it anyway)")


def stored_dtype(tensors: dict[str, torch.Tensor]) -> str | None:
    """The checkpoint's dtype(s) as stored: 'bfloat16', or 'bfloat16+float32' when mixed."""
    names = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    return "+".join(names) or None


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


def load_weights(model: K3Model, tensors: dict[str, torch.Tensor], allow_nonfinite: bool = False,
                 allow_dtype_cast: bool = False) -> None:
    """Strictly copy tensors into model; every parameter must be provided exactly once, each
    passing check_tensor. All checks run before the first copy."""
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
    fitted = {}
    for name, p in params.items():
        check_tensor(name, tensors[name], allow_nonfinite, allow_dtype_cast)
        fitted[name] = _fit(name, tensors[name], p, model.config)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(fitted[name].to(p.dtype))


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
