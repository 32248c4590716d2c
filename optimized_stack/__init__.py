"""A compact Kimi K3 inference engine: a plain reference path plus named optimization toggles.

    from optimized_stack import load_model
    model = load_model(path_or_preset, device="cpu", dtype=torch.float32)
    logits = model.logits(input_ids)        # 1-D LongTensor of one sequence -> [T, vocab] fp32
"""
# First, before anything can call MKL: the CPU reference's bits must not depend on which
# kernels MKL would pick for this processor (numerics.py says why and what it costs).
from .numerics import mkl_state, pin_mkl_branch

pin_mkl_branch()

from .config import K3Config  # noqa: E402
from .errors import CheckpointError, ConfigError, K3Error  # noqa: E402
from .loading import DEFAULT_MODEL, load_model  # noqa: E402
from .model.model import K3Model, RequestState  # noqa: E402

__all__ = ["K3Config", "K3Model", "RequestState", "load_model", "DEFAULT_MODEL",
           "K3Error", "ConfigError", "CheckpointError", "mkl_state"]
