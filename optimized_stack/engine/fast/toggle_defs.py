"""The fast decode path's toggles (both exact) and their seeded faults (mutants).

- batched_decode: every plain decode step as one static-shape forward over all running requests
  (KDA over the state pool in place, MLA over the paged projected K/V, experts on fixed-capacity
  buffers, greedy sampling on the device), padded to the CUDA-graph ladder; on the reference
  path's own row-invariant primitives, so exact on the CPU and on the GPU profile;
- cuda_graphs: that step captured per ladder size and replayed (CUDA only).
Each mutant is a plausible bug of the change it shadows and a real fault where it can run:
padding rows that write through a request's block table (fires whenever a batch is padded),
a conv window stored from the neighbouring row's input, a graph replayed on stale token ids.
"""
from __future__ import annotations

import functools

from ...kernels.moe.toggle_defs import GEMM_REGROUP
from ...toggles import EXACT, Toggle, register
from ..options import required_options
from .moe_static import routed_static_grouped

ALL = ("logits", "kda_state", "kda_conv", "mla_rows")
BATCHED = {"continuous_batching": True, "projected_kv_cache": True, "batched_decode": True}
GRAPHS = {**BATCHED, "cuda_graphs": True}
CUDA = ("cuda",)
# scenario tags whose decodes run several requests at once, so batches pad (3, 5, 6, 7 -> 4, 8); the
# selftest takes the cheapest of them, multi_length (the preemption scenario's 4-block pool runs at
# most two requests at once: no padding, and the padding fault could not fire there)
EXERCISED_BY = ("batching", "prefix")


def _requires(engine: dict, name: str) -> tuple[str, ...]:
    """The options an engine form requires, its own option `name` left out."""
    return tuple(r for r in required_options(engine) if r != name)


def _mut(name: str, of: str, description: str, engine: dict, caught_by: tuple[str, ...], lives_in: str,
         events: tuple[str, ...], devices: tuple[str, ...] = ("cpu", "cuda")) -> None:
    register(Toggle(name=name, description=description, contract=EXACT, touches=ALL, kind="mutant",
                    engine={**engine, "faults": (name,)}, caught_by=caught_by, lives_in=lives_in,
                    mutant_of=of, devices=devices, exercised_by=EXERCISED_BY, events=events))


register(Toggle(
    name="batched_decode", contract=EXACT, touches=ALL, engine=BATCHED,
    requires=required_options(BATCHED), exercised_by=EXERCISED_BY,
    events=("fast_decode_rows", "fast_padded_rows"),
    description="plain decode steps as one static-shape forward over every running request: KDA over "
                "the state pool in place, MLA over the paged projected K/V, experts on fixed-capacity "
                "buffers, greedy sampling on the device, padded to the graph ladder"))

register(Toggle(
    name="cuda_graphs", contract=EXACT, touches=ALL, engine=GRAPHS, devices=CUDA,
    requires=_requires(GRAPHS, "cuda_graphs"), exercised_by=EXERCISED_BY,
    events=("fast_decode_rows", "graph_replay"),
    description="the batched decode step captured as CUDA graphs at ladder sizes (1, 2, 4, ... 256) and "
                "replayed, a batch padded to the next size"))

_mut("mut_fast_pad_shares_table", "batched_decode", "padding rows of the batched decode step read and write "
     "through the first request's block table (its row 0 is overwritten) instead of the spare block",
     BATCHED, ("logits", "mla_rows"), "mla/cache", ("fast_padded_rows",))
_mut("mut_fast_conv_wrong_row", "batched_decode", "the batched decode step stores request i's conv "
     "window from request i+1's input", BATCHED, ("kda_state", "logits"), "kda/conv", ("fast_decode_rows",))
_mut("mut_fast_kda_stale_value_tiles", "batched_decode", "the batched decode step writes back only the first "
     "64-wide value tile of each KDA state (the real-dims fault class: inert at k3-mini's value head of 16, "
     "wrong at K3's 128)", BATCHED, ("kda_state", "logits"), "kda/recurrent", ("fast_kda_value_tiles",))
# exact: the step's KDA conv as one Triton launch per conv instead of ~10 torch kernels (~270 of a
# k3-small step's ~1,100 small kernels on the H200), the same roundings in the same order
# (kernels/kda/conv_step.py; interpreter tests bit for bit against conv_step)
FUSED_CONV = {**BATCHED, "fused_kda_conv": True}
register(Toggle(
    name="fused_kda_conv", contract=EXACT, touches=ALL, engine=FUSED_CONV, devices=CUDA,
    requires=_requires(FUSED_CONV, "fused_kda_conv"), exercised_by=EXERCISED_BY,
    events=("fast_fused_conv_rows",),
    description="the batched decode step's KDA causal conv (window gather, taps, window shift) as one "
                "Triton launch per conv, bf16/fp16, the torch form's roundings in its order"))
_mut("mut_fused_conv_stale_window", "fused_kda_conv", "the fused decode conv stores the new input but "
     "leaves the older taps of the window unshifted", FUSED_CONV, ("kda_state", "logits"), "kda/conv",
     ("fast_fused_conv_rows",), devices=CUDA)
# exact: the static experts' combine (k gathers and adds from zeros, in ascending expert index) as
# one Triton launch, the same fp32 products and sums in the same order, FMA contraction off
# (kernels/moe/combine.py: ~240 of a k3-small step's ~1,100 small kernels on the H200)
FUSED_COMBINE = {**BATCHED, "fused_moe_combine": True}
register(Toggle(
    name="fused_moe_combine", contract=EXACT, touches=ALL, engine=FUSED_COMBINE, devices=CUDA,
    requires=_requires(FUSED_COMBINE, "fused_moe_combine"),
    exercised_by=EXERCISED_BY, events=("fast_fused_combine_rows",),
    description="the batched decode step's routed-expert combine (per row, from zeros, w * out in "
                "ascending expert index, fp32) as one Triton launch per MoE layer"))
_mut("mut_fused_combine_slot_order", "fused_moe_combine", "the fused MoE combine adds each row's experts "
     "in slot (router) order instead of ascending expert index: the same sum, other fp32 roundings",
     FUSED_COMBINE, ("logits",), "engine/fast_step", ("fast_fused_combine_three_plus",), devices=CUDA)
_mut("mut_fused_combine_drops_last", "fused_moe_combine", "the fused MoE combine's loop stops one expert short: "
     "each row's highest expert is left out", FUSED_COMBINE, ("logits",), "engine/fast_step",
     ("fast_fused_combine_rows",), devices=CUDA)
_mut("mut_graph_stale_input", "cuda_graphs", "a replayed CUDA graph reads the token ids of its first "
     "replay (the copy into the static input is skipped)", GRAPHS, ("logits", "tokens"), "engine/graphs",
     ("graph_replay",), devices=CUDA)

# exact: the forwards outside the batched decode step (prefill) with the routed experts' rows from
# one sort, one host sync per MoE layer instead of a `nonzero` per expert, and ~5 launches per
# active expert instead of ~30 (kernels/moe/sorted.py); the reference's GEMM calls on the same rows
# in the same order, the activation elementwise, the combine in its order. Any device.
SORTED = {**BATCHED, "prefill_sorted_experts": True}
register(Toggle(
    name="prefill_sorted_experts", contract=EXACT, touches=ALL, engine=SORTED,
    requires=_requires(SORTED, "prefill_sorted_experts"),
    # no `phases`: gpu_suite times op-table forms on the model; this engine option is timed by
    # perf/step_profile (--prefill-stacks +fused,+sorted), the engine step side by side
    exercised_by=EXERCISED_BY, events=("prefill_sorted_experts",),
    description="prefill's routed experts with one host sync per MoE layer: rows from one stable sort by "
                "expert, the reference's GEMMs on them, the activation once, the combine in its order"))
_mut("mut_sorted_experts_weights_unsorted", "prefill_sorted_experts", "the sorted prefill experts multiply "
     "the expert-ordered outputs by routing weights still in (row, slot) order", SORTED, ("logits",),
     "ops/moe_experts", ("prefill_sorted_experts",))

# exact: the routed experts' SiTU-GLU (model/ops.py situ: 12 torch kernels over [rows, F] in fp32) as one
# Triton launch running torch's CUDA ops in torch's order (kernels/moe/situ.py), in the batched decode
# step's static experts and in the sorted prefill experts. The toggle switches the sorted experts on with
# it so that its own verdict judges both forms the kernel runs in (without them a prefill keeps the
# reference's experts and the prefill form would be judged nowhere); a scenario's prefill runs first,
# so a fault in the kernel shows first in the sorted experts' op slot. CUDA only: on the CPU the torch
# form runs and the event stays silent.
FUSED_SITU = {**SORTED, "fused_situ": True}
register(Toggle(
    name="fused_situ", contract=EXACT, touches=ALL, engine=FUSED_SITU, devices=CUDA,
    requires=_requires(FUSED_SITU, "fused_situ"), exercised_by=EXERCISED_BY, events=("fused_situ",),
    description="the routed experts' SiTU-GLU activation as one Triton launch (libdevice tanhf / expf, "
                "IEEE division, no FMA, torch's order and bf16 rounding), in the batched decode step's "
                "static experts and the sorted prefill experts"))
# a few ULP in the sigmoid, in fp32, before the bf16 rounding: only the GPU's bitwise check sees it (the
# interpreter has no libdevice), and in bf16 only through enough activations to cross a rounding
# boundary: judged where the experts are wider than 64 (k3-small), not applicable at k3-mini's 32
# (events.py DIMS_NEEDED fused_situ_wide)
_mut("mut_fused_situ_fast_exp", "fused_situ", "the fused SiTU-GLU's sigmoid takes tl.exp (ex2.approx of "
     "x * log2 e) instead of libdevice's expf: a few fp32 ULP", FUSED_SITU, ("logits",), "ops/moe_experts",
     ("fused_situ_wide",), devices=CUDA)
_mut("mut_fused_situ_no_linear_beta", "fused_situ", "the fused SiTU-GLU leaves out the linear_beta factor "
     "of its up half (tanh(u / lb) unscaled)", FUSED_SITU, ("logits",), "ops/moe_experts", ("fused_situ",),
     devices=CUDA)

# exact: the forwards over several requests with each KDA and MLA layer's token-wise work (projections,
# gates, norms, the convs over one joined sequence, o_proj) on every segment's rows at once, the
# recurrence and the attention per segment (kernels/kda/segments.py, kernels/mla/segments.py): ~45
# launches a KDA layer per segment become ~45 plus the scan's per segment. Row-invariant primitives:
# bit-identical. Any device. In the counted fast stack since session 24: a served stack's KVV run must
# see every counted toggle's event, and this one fires only where one step prefills several prompts;
# KVV's batch.concurrent_equals_alone sends six at once, and the tenth GPU release run's served stack
# prefilled them in one forward (batched_forward=1), as the CPU's does.
MIXERS = {**BATCHED, "prefill_batched_mixers": True}
register(Toggle(
    name="prefill_batched_mixers", contract=EXACT, touches=ALL, engine=MIXERS,
    requires=_requires(MIXERS, "prefill_batched_mixers"),
    exercised_by=EXERCISED_BY, events=("prefill_batched_mixers",),
    description="each KDA and MLA layer of a forward over several prompts: the token-wise work on all "
                "rows at once, the convs over one joined sequence, the recurrence and attention per prompt"))
_mut("mut_batched_mixers_window_from_next", "prefill_batched_mixers", "the batched mixers store each "
     "segment's new conv window from the next segment's rows", MIXERS, ("kda_state", "logits"), "kda/conv",
     ("prefill_batched_mixers",))

# approx: the static placement with one batched GEMM per projection over every expert (capturable,
# unlike moe_grouped, whose capacity is read on the host); judged like moe_grouped
register(Toggle(
    name="moe_grouped_static", contract=GEMM_REGROUP, touches=("logits",), devices=CUDA,
    description="routed experts on fixed-capacity [E, T, D] buffers as three batched GEMMs (torch.bmm), "
                "capturable in a CUDA graph; combine order kept",
    ops={"moe_experts": routed_static_grouped}, events=("op:moe_experts",)))
register(Toggle(
    name="mut_moe_grouped_static_drop_last", kind="mutant", mutant_of="moe_grouped_static", contract=GEMM_REGROUP,
    touches=("logits",), devices=CUDA, description="static grouped experts combined without each row's "
    "highest expert", caught_by=("drift_budget",), lives_in="moe/ffn",
    ops={"moe_experts": functools.partial(routed_static_grouped, _drop_last=True)}, events=("op:moe_experts",)))
