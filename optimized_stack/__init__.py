"""A compact Kimi K3 inference engine: a plain reference path plus named optimization toggles.

    from optimized_stack import load_model
    model = load_model(path_or_preset, device="cpu", dtype=torch.float32)
    logits = model.logits(input_ids)        # 1-D LongTensor of one sequence -> [T, vocab] fp32
"""
from .config import K3Config
from .errors import CheckpointError, ConfigError, K3Error
from .loading import DEFAULT_MODEL, load_model
from .model.model import K3Model, RequestState

__all__ = ["K3Config", "K3Model", "RequestState", "load_model", "DEFAULT_MODEL",
           "K3Error", "ConfigError", "CheckpointError"]
