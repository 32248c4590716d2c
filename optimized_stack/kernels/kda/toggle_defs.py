"""KDA kernel toggles (CPU chunked form, fla-core's CUDA kernels), the lossy bf16-state
control, and the KDA mutants: each a plausible real bug, switched in from outside the model
exactly like an optimization, so `k3verify selftest` proves the check that should catch it does.
"""
from __future__ import annotations

import functools

import torch

from ...model import ops
from ...model.kda import kda_recurrent
from ...toggles import EXACT, Contract, Toggle, on_bf16_cuda, register
from . import fla
from .chunked import kda_chunked

# Budgets: measured drift on k3-mini is ~1e-6 of max|logit| (NOTES.md); KL 1e-6 nats and
# 98% teacher-forced argmax agreement leave two orders of magnitude of headroom while a
# structural bug (mutants below) lands far outside. The final KDA state drifts 4e-7..1.2e-6
# of max|state| under these kernels, a bf16 state 8e-3: 1e-4 sits between.
APPROX_KERNEL = on_bf16_cuda(Contract("approx", max_kl=1e-6, min_top1=0.98, max_state_rel=1e-4,
                                      quality=("gsm8k", "needle")))
# fla's chunk kernels take tl.dot in TF32 on fp32 inputs (10-bit mantissa): logits KL 7.6e-6
# on the H200 (NOTES.md), far above the CPU kernels' 1e-11. A dropped state lands at KL >=
# 1e-2, a bf16 state at 1.6e-2; a transposed state shows in the state itself (O(1) of max).
FLA_KERNEL = on_bf16_cuda(Contract("approx", max_kl=1e-4, min_top1=0.98, max_state_rel=1e-2,
                                    quality=("gsm8k", "needle")))
# fused_recurrent_kda does fp32 FMAs (no tensor cores): KL 6.5e-12 measured, the CPU budget.
FLA_RECURRENT = on_bf16_cuda(Contract("approx", max_kl=1e-6, min_top1=0.98, max_state_rel=1e-4,
                                      quality=("gsm8k", "needle")))
CUDA = ("cuda",)


def both(fn) -> dict:
    """The slots of a KDA form that serves prompt chunks and decode steps alike."""
    return {"kda_prefill": fn, "kda_decode": fn}


BOTH = ("op:kda_prefill", "op:kda_decode")         # the path events of a form in both slots


register(Toggle(
    name="kda_chunked", contract=APPROX_KERNEL, touches=("logits", "kda_state"),
    description="KDA prefill in the chunked UT form (C=64, one triangular solve per chunk) "
                "instead of the token recurrence", ops={"kda_prefill": kda_chunked}, events=("op:kda_prefill",)))

register(Toggle(
    name="kda_fla_chunk", contract=FLA_KERNEL, touches=("logits", "kda_state"), devices=CUDA,
    description="KDA prefill and decode through fla-core's chunk_kda Triton kernel "
                "(chunks of 64; a prefill split at a multiple of 64 is bit-identical)",
    ops=both(fla.fla_chunk), phases=("prefill",), events=BOTH))

# How a serving engine uses the two kernels: prompts through chunk_kda in one call (its tail off
# the 64-token grid included), decode steps through the reference's decode op. Measured on the
# H200 (NOTES.md 2026-12-01): decoding through chunk_kda (kda_fla_chunk) does not accumulate
# error (1e-3 of max|state| after 1 and after 256 one-token calls), and both forms fail the bf16
# budget on `single` alike (mean KL 0.055): one near-tie row of 57 that chunk_kda's rounding
# flips (KL 3.13 there; torch's default form, also whole-prompt chunk_kda, flips the same).
register(Toggle(
    name="kda_fla_chunk_prefill", contract=FLA_KERNEL, touches=("logits", "kda_state"), devices=CUDA,
    description="KDA prompts through fla-core's chunk_kda in one call (off the 64-token grid too), "
                "decode steps as the reference does them",
    ops={"kda_prefill": fla.fla_chunk}, events=("op:kda_prefill",)))

register(Toggle(
    name="kda_fla_recurrent", contract=FLA_RECURRENT, touches=("logits", "kda_state"), devices=CUDA,
    description="KDA through fla-core's fused_recurrent_kda (one kernel per call, the state "
                "kept in registers across tokens): the decode-step kernel",
    ops=both(fla.fla_recurrent), phases=("decode",), events=BOTH))


# ---- faults -------------------------------------------------------------------------------
def _recurrent_bf16_state(q, k, v, g, beta, initial_state=None):
    """The recurrent state kept in bf16 between tokens (the lossy control and a mutant)."""
    state = None if initial_state is None else initial_state.to(torch.bfloat16).float()
    outs = []
    for t in range(q.shape[0]):
        o, state = kda_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        state = state.to(torch.bfloat16).float()
        outs.append(o)
    return torch.cat(outs), state


def _recurrent_decay_after_delta(q, k, v, g, beta, initial_state=None):
    """Fault: the decay is applied after the delta-rule write instead of before it."""
    h, kd = q.shape[1], q.shape[2]
    # on the inputs' device: the H200 release run errored here (a CPU state beside CUDA inputs)
    state = (torch.zeros(h, kd, v.shape[-1], device=q.device) if initial_state is None
             else initial_state.float().clone())
    out = torch.empty(q.shape[0], h, v.shape[-1], device=q.device)
    decay = ops.exp(g.float())
    for t in range(q.shape[0]):
        kv = (state * k[t].unsqueeze(-1)).sum(1)
        u = beta[t].unsqueeze(-1) * (v[t] - kv)
        state = (state + k[t].unsqueeze(-1) * u.unsqueeze(1)) * decay[t].unsqueeze(-1)
        out[t] = (state * q[t].unsqueeze(-1)).sum(1)
    return out, state


# The deliberately lossy approx toggle, the quality gates' positive control: a bf16 state
# halves the state memory a serving engine holds per request and per prefix checkpoint, a
# real trade-off. It claims the same budget as kda_chunked and must FAIL it (and, on a model
# with quality to lose, the GSM8K / needle gates): if it ever passes, the gates have gone
# blind. Registered as kind "mutant" (a control that must be rejected), so selftest and
# `k3verify all` demand that it is caught rather than that it passes.
register(Toggle(
    name="kda_state_bf16", contract=APPROX_KERNEL, touches=("logits", "kda_state"),
    description="KDA recurrent state stored in bf16 between tokens (halves state memory; "
                "deliberately lossy: must fail its drift budget and the quality gates)",
    kind="mutant", caught_by=("drift_budget",), lives_in="kda/mixer", ops=both(_recurrent_bf16_state), events=BOTH))

register(Toggle(
    name="mut_kda_state_bf16", kind="mutant", contract=EXACT, touches=("kda_state", "logits"),
    description="KDA recurrent state accumulated in bf16", caught_by=("kda_state", "logits"),
    lives_in="kda/recurrent", ops=both(_recurrent_bf16_state), events=BOTH))

register(Toggle(
    name="mut_kda_decode_bf16_state", kind="mutant", contract=EXACT, touches=("kda_state", "logits"),
    description="KDA recurrent state kept in bf16 in the decode-step slot only", caught_by=("kda_state", "logits"),
    lives_in="kda/recurrent", ops={"kda_decode": _recurrent_bf16_state}, events=("op:kda_decode",)))

register(Toggle(
    name="mut_kda_decay_after_delta", kind="mutant", contract=EXACT, touches=("kda_state", "logits"),
    description="KDA decay applied after the delta-rule write", caught_by=("kda_state", "logits"),
    lives_in="kda/recurrent", ops=both(_recurrent_decay_after_delta), events=BOTH))

register(Toggle(
    name="mut_kda_chunk_off_by_one", kind="mutant", mutant_of="kda_chunked", contract=APPROX_KERNEL,
    touches=("logits", "kda_state"), description="chunked KDA with an exclusive (off-by-one) decay cumsum",
    caught_by=("drift_budget",), lives_in="kda/mixer",
    ops={"kda_prefill": functools.partial(kda_chunked, _gamma_shift=1)}, events=("op:kda_prefill",)))

register(Toggle(
    name="mut_fla_chunk_drops_state", kind="mutant", mutant_of="kda_fla_chunk", contract=FLA_KERNEL,
    touches=("logits", "kda_state"), devices=CUDA,
    description="chunk_kda called without the cached initial_state (each call starts from zeros)",
    caught_by=("drift_budget",), lives_in="kda/mixer",
    ops=both(functools.partial(fla.fla_chunk, _drop_state=True)), events=BOTH))

register(Toggle(
    name="mut_fla_chunk_beta_sigmoid_twice", kind="mutant", mutant_of="kda_fla_chunk_prefill",
    contract=FLA_KERNEL, touches=("logits", "kda_state"), devices=CUDA,
    description="chunk_kda told to apply the sigmoid to beta (use_beta_sigmoid_in_kernel) that the "
                "model already applied: every write strength squashed into (0.5, 0.73)",
    caught_by=("drift_budget",), lives_in="kda/mixer",
    ops={"kda_prefill": functools.partial(fla.fla_chunk, _beta_sigmoid_again=True)}, events=("op:kda_prefill",)))

register(Toggle(
    name="mut_fla_recurrent_state_transposed", kind="mutant", mutant_of="kda_fla_recurrent",
    contract=FLA_RECURRENT, touches=("logits", "kda_state"), devices=CUDA,
    description="the cached state handed to fused_recurrent_kda as [V, K] (a layout mix-up that "
                "square heads hide)", caught_by=("drift_budget",),
    # read back in the same wrong layout, so no output differs: only the stored state shows it
    lives_in="kda/recurrent",
    ops=both(functools.partial(fla.fla_recurrent, _transpose_state=True)), events=BOTH))
