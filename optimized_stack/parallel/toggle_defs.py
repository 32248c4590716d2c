"""The tensor-parallel toggles and their mutants (world sizes 2, 4, 8).

Each sets `runner` options that the TP runner (k3verify/run/tp.py) turns into
`TPOptions`; the reference for a TP toggle is the same world size without it.

Contracts, and why (measured on gloo, NOTES.md / the TP report):
- tp_dedup_router, exact: the work every rank repeated (AttnRes reads, norms, the
  router, the low-rank a-projections, the latent up-projection) is computed once, each
  rank on its own row range, then all-gathered. The per-row ops are the reference's
  row-stable ones, so a row's bits do not depend on which rank or batch computed it.
- moe_output_shard, approx: the routed output enters the shared expert's partial before
  the all-reduce, so it is summed in another order (y + (s0 + s1) -> (s0 + y) + s1).
- fused_allreduce_residual, approx: the fused op sums the partials in rank order (one
  shot) and adds the residual in the same pass. At W = 2 that is bit-identical to the
  all-reduce (a two-term sum has one order), but gloo's ring all-reduce (and NCCL's ring
  or tree) reduce each chunk starting at a different rank, so at W >= 4 some elements
  are summed in another order (measured: 375 of 4096 elements differ at W = 4, 1290 at
  W = 8). The contract must hold at every world size it is declared for: approx.
- dcp_mla, approx: the softmax over the history is split into W partials and merged by
  log-sum-exp: another association of the same sums.
- dcp_fp8_allgather (with dcp_mla), approx: prefill attends over the context all-gathered in
  FP8 (parallel/dcp_fp8.py): e4m3 rounding of the latent rows, its own budget below.
Budgets: on k3-mini at W = 2 and 4 the approx toggles measure max KL <= 3e-13 nats and
top-1 agreement 1.0 against the same W without them; KL 1e-6 nats and 98% top-1 leave
orders of magnitude of headroom while every mutant below lands at KL >= 6e-3.
"""
from __future__ import annotations

from ..toggles import EXACT, Contract, Toggle, register

TP_WORLD_SIZES = (2, 4, 8)
# No quality gate is named: the gates run the single-process model, on which a TP
# toggle has nothing to switch; the drift budget is the whole contract here.
APPROX_TP = Contract("approx", max_kl=1e-6, min_top1=0.98)
ALL = ("logits", "kda_state", "kda_conv", "mla_rows")


# the runner option -> the path event its code counts on rank 0 (tp_model.py, tp_shards.py)
EVENT_OF = {"tp_dedup": "tp_dedup_gather", "moe_output_shard": "moe_shard_add",
            "fused_allreduce_residual": "fused_allreduce", "dcp_mla": "dcp_merge",
            "dcp_fp8_allgather": "dcp_fp8_gather"}


def _tp(name: str, description: str, contract: Contract, runner: dict, touches=ALL, **kw) -> Toggle:
    events = tuple(EVENT_OF[k] for k in runner if k in EVENT_OF)
    return register(Toggle(name=name, description=description, contract=contract, touches=touches,
                           world_sizes=TP_WORLD_SIZES, runner=runner, events=events, **kw))


_tp("tp_dedup_router", "router, norms, AttnRes reads and the low-rank projections computed once: "
    "row-sharded across TP ranks, then all-gathered", EXACT, {"tp_dedup": True})
_tp("moe_output_shard", "routed experts' output column-sharded across ranks, added to the shared "
    "expert's partial and completed by the existing all-reduce", APPROX_TP, {"moe_output_shard": True},
    touches=("logits", "kda_state"))
_tp("fused_allreduce_residual", "row-parallel all-reduce fused with the residual add (one-shot "
    "rank-order sum, residual added in the same pass)", APPROX_TP, {"fused_allreduce_residual": True},
    touches=("logits", "kda_state"))
_tp("dcp_mla", "decode context parallel: MLA history rows split across ranks (position mod W), "
    "partial attention merged by log-sum-exp", APPROX_TP, {"dcp_mla": True},
    touches=("logits", "kda_state", "mla_rows"))
# dcp_fp8_allgather requires dcp_mla; the runner's reference is the same W with no toggle, so
# its measured drift also holds dcp_mla's own (KL <= 3e-13 above: nothing at this scale).
# Declared before measuring: the prefill context's latent rows carry e4m3's ~2.5% RMS noise
# (at most 2^-4 of a value), K and V inherit it through kv_b, and attention averages it over
# the keys; prefill calls only. Predicted: mean KL 1e-4-2e-3, max KL 0.02-0.2, top-1 >= 0.98,
# final KDA state 0.01-0.05 of max. The same budget as mla_fp8_prefill's (FP8 attention
# inputs), which has Q in FP8 as well.
# Measured 2026-12-02 at W = 2 (embedded k3-mini; NOTES.md): mean KL 8e-5-2.4e-3, top-1 >= 0.995,
# max KL 0.0036 (single), 0.047 (multi_length), 0.85 (boundaries, row 386: over the declared 0.5,
# the toggle FAILS there, the same near-tie row as mla_fp8_prefill). Left as declared.
FP8_DCP = Contract("approx", max_kl=0.5, mean_kl=0.01, min_top1=0.97, max_state_rel=0.1)
_tp("dcp_fp8_allgather", "DCP prefill: the rank-sharded MLA context all-gathered as float8 e4m3 rows "
    "with one scale per row, dequantized, then attended per head", FP8_DCP, {"dcp_fp8_allgather": True},
    touches=("logits", "kda_state", "mla_rows"), requires=("dcp_mla",))


# ---- mutants: plausible bugs of each, caught by the check named --------------------------
_tp("mut_tp_dedup_gather_order", "dedup all-gather concatenates the row shards in reverse rank order",
    EXACT, {"tp_dedup": True, "faults": ("dedup_gather_reversed",)}, kind="mutant",
    mutant_of="tp_dedup_router", caught_by=("logits", "kda_state"))
_tp("mut_moe_shard_full_add", "every rank adds the whole routed output to its partial (counted W times)",
    APPROX_TP, {"moe_output_shard": True, "faults": ("moe_shard_full_on_every_rank",)}, kind="mutant",
    mutant_of="moe_output_shard", caught_by=("drift_budget",))
_tp("mut_fused_allreduce_twice", "fused all-reduce + residual reduces the partials twice",
    APPROX_TP, {"fused_allreduce_residual": True, "faults": ("allreduce_twice",)}, kind="mutant",
    mutant_of="fused_allreduce_residual", caught_by=("drift_budget",))
_tp("mut_dcp_merge_no_rescale", "DCP merge sums the partials without rescaling by exp(m_r - max m)",
    APPROX_TP, {"dcp_mla": True, "faults": ("dcp_merge_no_rescale",)}, kind="mutant",
    mutant_of="dcp_mla", caught_by=("drift_budget",))
# A per-shard (per-tensor) scale is not registered as a mutant: at W = 2 it measured inside the
# budget and no worse than per-row (single: mean KL 8.7e-5 vs 8.5e-5; boundaries: max KL 0.463
# vs 0.847): the latent rows are RMS-normed, one magnitude, so per-row scaling is judged by
# tests/test_fp8_toggles.py directly, not by the drift budget.
_tp("mut_dcp_fp8_dequant_scale_x2", "DCP FP8 gather dequantized with amax/224 instead of amax/448",
    FP8_DCP, {"dcp_fp8_allgather": True, "faults": ("dcp_fp8_dequant_scale_x2",)}, kind="mutant",
    mutant_of="dcp_fp8_allgather", caught_by=("drift_budget",), requires=("dcp_mla",),
    touches=("logits", "kda_state", "mla_rows"))
