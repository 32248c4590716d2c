"""CUDA-only toggles: fla-core's KDA kernels, grouped expert GEMMs, the shared expert on a
side stream. Each comes with a mutant (a plausible bug of that very change) so the GPU run
proves the check that judges the toggle can fail.

All are registered with devices=("cuda",): on a CPU they are listed and skipped with that
reason. fla is imported inside the ops, so this module imports on a machine without it.
"""
from __future__ import annotations

import functools

from ..model import moe
from ..toggles import EXACT, Contract, Toggle, register
from . import cuda_ops
from .toggle_defs import _ops, _patch_attr

# fla's chunk kernels take tl.dot in TF32 on fp32 inputs (10-bit mantissa): logits KL 7.6e-6
# on the H200 (NOTES.md), far above the CPU kernels' 1e-11. A dropped state lands at KL >=
# 1e-2, a bf16 state at 1.6e-2; a transposed state shows in the state itself (O(1) of max).
FLA_KERNEL = Contract("approx", max_kl=1e-4, min_top1=0.98, max_state_rel=1e-2, quality=("gsm8k", "needle"))
# fused_recurrent_kda does fp32 FMAs (no tensor cores): KL 6.5e-12 measured, the CPU budget.
FLA_RECURRENT = Contract("approx", max_kl=1e-6, min_top1=0.98, max_state_rel=1e-4, quality=("gsm8k", "needle"))
# cuBLAS picks its kernel by the GEMM's row count, so expert GEMMs on padded groups may
# round differently from the per-expert ones: a few ULP, the CPU kernels' budget.
GEMM_REGROUP = Contract("approx", max_kl=1e-6, min_top1=0.98, max_state_rel=1e-4, quality=("gsm8k", "needle"))
CUDA = ("cuda",)

register(Toggle(
    name="kda_fla_chunk", contract=FLA_KERNEL, touches=("logits", "kda_state"), devices=CUDA,
    description="KDA prefill and decode through fla-core's chunk_kda Triton kernel "
                "(chunks of 64; a prefill split at a multiple of 64 is bit-identical)",
    patch=_ops(kda_prefill=cuda_ops.fla_chunk)))

register(Toggle(
    name="kda_fla_recurrent", contract=FLA_RECURRENT, touches=("logits", "kda_state"), devices=CUDA,
    description="KDA through fla-core's fused_recurrent_kda (one kernel per call, the state "
                "kept in registers across tokens): the decode-step kernel",
    patch=_ops(kda_prefill=cuda_ops.fla_recurrent)))

register(Toggle(
    name="moe_grouped", contract=GEMM_REGROUP, touches=("logits",), devices=CUDA,
    description="routed experts as three batched GEMMs over tokens grouped by expert "
                "(padded [E, rows, D]) instead of a per-expert loop; combine order kept",
    patch=functools.partial(_patch_attr, moe.MoE, "routed", cuda_ops.routed_grouped)))

register(Toggle(
    name="shared_expert_side_stream", contract=EXACT, touches=("logits",), devices=CUDA,
    description="shared expert on a second CUDA stream, overlapping the router and routed "
                "experts; joined before the add, same kernels and shapes, so bit-identical",
    patch=functools.partial(_patch_attr, moe.MoE, "forward", cuda_ops.moe_forward_side_stream)))

# ---- mutants ----------------------------------------------------------------------------
register(Toggle(
    name="mut_fla_chunk_drops_state", kind="mutant", mutant_of="kda_fla_chunk", contract=FLA_KERNEL,
    touches=("logits", "kda_state"), devices=CUDA,
    description="chunk_kda called without the cached initial_state (each call starts from zeros)",
    caught_by=("drift_budget",), lives_in="kda/mixer",
    patch=_ops(kda_prefill=functools.partial(cuda_ops.fla_chunk, _drop_state=True))))

register(Toggle(
    name="mut_fla_recurrent_state_transposed", kind="mutant", mutant_of="kda_fla_recurrent",
    contract=FLA_RECURRENT, touches=("logits", "kda_state"), devices=CUDA,
    description="the cached state handed to fused_recurrent_kda as [V, K] (a layout mix-up that "
                "square heads hide)", caught_by=("drift_budget",), lives_in="kda/mixer",
    patch=_ops(kda_prefill=functools.partial(cuda_ops.fla_recurrent, _transpose_state=True))))

register(Toggle(
    name="mut_moe_grouped_slot0_weight", kind="mutant", mutant_of="moe_grouped", contract=GEMM_REGROUP,
    touches=("logits",), devices=CUDA,
    description="grouped experts combined with the first slot's routing weight for every slot",
    caught_by=("drift_budget",), lives_in="moe/ffn",
    patch=functools.partial(_patch_attr, moe.MoE, "routed",
                            functools.partialmethod(cuda_ops.routed_grouped, _slot0_weight=True))))

register(Toggle(
    name="mut_side_stream_tf32", kind="mutant", mutant_of="shared_expert_side_stream", contract=EXACT,
    touches=("logits",), devices=CUDA,
    description="the side stream's shared expert runs with TF32 matmuls allowed (a helper that "
                "flips torch.backends.cuda.matmul.allow_tf32)", caught_by=("logits",), lives_in="moe/ffn",
    patch=functools.partial(_patch_attr, moe.MoE, "forward",
                            functools.partialmethod(cuda_ops.moe_forward_side_stream, _tf32=True))))
