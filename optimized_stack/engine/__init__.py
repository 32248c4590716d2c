"""The serving engine over the K3 model: scheduler, paged MLA cache, KDA state pool,
prefix cache with KDA checkpoints, host tier, preemption. See engine.py."""
from .engine import Engine, EngineObserver
from .metrics import EngineMetrics
from .options import FAULTS, EngineOptions, RequestResult, SamplingParams, StepOutput

__all__ = ["Engine", "EngineObserver", "EngineOptions", "SamplingParams", "RequestResult",
           "StepOutput", "EngineMetrics", "FAULTS"]
