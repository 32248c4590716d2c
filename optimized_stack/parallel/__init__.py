"""Tensor parallelism for the K3 engine on torch.distributed (gloo on CPU, NCCL on GPU).

    from optimized_stack.parallel import RankPool, TPModel, TPOptions
    tp = TPModel(model, Comm(rank, world_size), TPOptions(dedup=True))   # on each rank
    logits = tp.forward(ids, tp.new_state())                              # [T, V], every rank

The TP toggles (tp_dedup_router, moe_output_shard, fused_allreduce_residual, dcp_mla and
their mutants) are registered by `optimized_stack.parallel.toggle_defs`.
"""
from .launch import Comm, RankContext, RankPool, launch, shard_range, split_sizes
from .tp_model import FAULTS, TPModel, TPOptions
from .tp_shards import dcp_attention

__all__ = ["Comm", "RankContext", "RankPool", "launch", "shard_range", "split_sizes",
           "TPModel", "TPOptions", "FAULTS", "dcp_attention"]
