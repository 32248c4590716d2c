"""`load_model`: a checkpoint directory, a preset name, or the embedded default."""
from __future__ import annotations

import difflib
from pathlib import Path

import torch

from .checkpoint import load_weights, read_state_dict, stored_dtype
from .config import K3Config
from .errors import K3Error
from .model.model import K3Model
from .presets import PRESETS, init_model, preset_config

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "golden"
DEFAULT_MODEL = GOLDEN_DIR / "k3-mini"


def load_model(path_or_preset: str | Path | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0, *, allow_nonfinite: bool = False,
               allow_dtype_cast: bool = False) -> K3Model:
    """Load a K3 / Kimi Linear model.

    None -> the embedded default (golden/k3-mini); a directory -> its config.json and
    safetensors; a preset name (k3-mini, k3-mini-9, k3-small) -> seeded random init.
    A checkpoint's weights must be finite float32/bfloat16: allow_nonfinite=True loads NaN/inf
    (a poisoned model for run-time checks), allow_dtype_cast=True casts float16/float64.
    `model.stored_dtype` records the checkpoint's dtype(s) as stored (None for a preset).
    """
    src = DEFAULT_MODEL if path_or_preset is None else path_or_preset
    path = Path(src)
    if path.is_dir():
        cfg = K3Config.from_file(path)
        model = K3Model(cfg)
        tensors = read_state_dict(path)
        load_weights(model, tensors, allow_nonfinite=allow_nonfinite, allow_dtype_cast=allow_dtype_cast)
        model.source = str(path)
        model.stored_dtype = stored_dtype(tensors)
    elif isinstance(src, str) and src in PRESETS:
        model = init_model(preset_config(src), seed=seed)
        model.source = f"preset:{src}:seed{seed}"
        model.stored_dtype = None
    else:
        close = difflib.get_close_matches(str(src), list(PRESETS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise K3Error(f"model {str(src)!r}: expected a checkpoint directory or a preset "
                      f"({', '.join(PRESETS)}), got neither{hint}")
    model.eval()
    return model.to(device=device, dtype=dtype)
