"""MoE toggles (grouped expert GEMMs and the shared expert on a side stream, both CUDA) and
the MoE mutants: each a plausible bug of that very change, so the GPU run proves the check
that judges the toggle can fail. fla / CUDA are touched only when a toggle runs."""
from __future__ import annotations

import functools

import torch

from ...model import ops
from ...toggles import EXACT, Contract, Toggle, on_bf16_cuda, register
from .grouped import routed_grouped
from .side_stream import moe_forward_side_stream

# cuBLAS picks its kernel by the GEMM's row count, so expert GEMMs on padded groups may
# round differently from the per-expert ones: a few ULP, the CPU kernels' budget.
GEMM_REGROUP = on_bf16_cuda(Contract("approx", max_kl=1e-6, min_top1=0.98, max_state_rel=1e-4,
                                      quality=("gsm8k", "needle")))
CUDA = ("cuda",)

register(Toggle(
    name="moe_grouped", contract=GEMM_REGROUP, touches=("logits",), devices=CUDA,
    description="routed experts as three batched GEMMs over tokens grouped by expert "
                "(padded [E, rows, D]) instead of a per-expert loop; combine order kept",
    ops={"moe_experts": routed_grouped}, phases=("prefill", "decode"), events=("op:moe_experts",)))

register(Toggle(
    name="shared_expert_side_stream", contract=EXACT, touches=("logits",), devices=CUDA,
    description="shared expert on a second CUDA stream, overlapping the router and routed "
                "experts; joined before the add, same kernels and shapes, so bit-identical",
    ops={"moe_block": moe_forward_side_stream}, phases=("prefill", "decode"), events=("op:moe_block",)))


# ---- mutants ----------------------------------------------------------------------------
def _router_bias_in_weights(router, x):
    """Fault: the correction bias leaks into the combine weights, not only the selection."""
    cfg = router.cfg
    scores = ops.sigmoid(ops.OPS.linear(x.float(), router.weight.float())) + router.e_score_correction_bias.float()
    _, idx = torch.topk(scores, cfg.num_experts_per_token, dim=-1)
    w = scores.gather(-1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * cfg.routed_scaling_factor


register(Toggle(
    name="mut_router_bias_in_weights", kind="mutant", contract=EXACT, touches=("logits",),
    description="MoE correction bias used in the combine weights, not only for selection",
    caught_by=("logits",), lives_in="moe/ffn", ops={"moe_route": _router_bias_in_weights},
    events=("op:moe_route",)))

register(Toggle(
    name="mut_moe_grouped_slot0_weight", kind="mutant", mutant_of="moe_grouped", contract=GEMM_REGROUP,
    touches=("logits",), devices=CUDA,
    description="grouped experts combined with the first slot's routing weight for every slot",
    caught_by=("drift_budget",), lives_in="moe/ffn",
    ops={"moe_experts": functools.partial(routed_grouped, _slot0_weight=True)}, events=("op:moe_experts",)))

# On the GPU profile every fp32 GEMM is the Triton IEEE kernel and bf16 runs with TF32 off, so
# a TF32 leak changes nothing any more (the first mutant of this toggle went void): the seeded
# fault is a wrong view of the input in the side stream's copy (row 0 for every row).
register(Toggle(
    name="mut_side_stream_row0_input", kind="mutant", mutant_of="shared_expert_side_stream", contract=EXACT,
    touches=("logits",), devices=CUDA,
    description="the side stream's shared expert reads row 0's input for every row (a broadcast view "
                "where a copy was meant)", caught_by=("logits",), lives_in="moe/ffn",
    ops={"moe_block": functools.partial(moe_forward_side_stream, _row0=True)}, events=("op:moe_block",)))
