"""Toggles that swap a kernel, runner-level exact toggles, and the model-level mutants.

Each mutant is a plausible real bug, switched in from outside the model exactly like an
optimization, so `k3verify selftest` can prove the check that should catch it does.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from ..model import attn_res, moe, ops
from ..model.kda import kda_recurrent
from ..toggles import EXACT, Contract, Toggle, register
from .kda_chunked import kda_chunked
from .mla_absorbed import mla_absorbed
from .mla_sdpa import sdpa_attention


def _ops(**changes):
    return functools.partial(ops.override, **changes)


@contextlib.contextmanager
def _patch_attr(owner, name: str, value) -> Iterator[None]:
    """Replace owner.name for the block; always restored."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


# ---- approx kernel toggles ------------------------------------------------------------
# Budgets: measured drift on k3-mini is ~1e-6 of max|logit| (NOTES.md); KL 1e-6 nats and
# 98% teacher-forced argmax agreement leave two orders of magnitude of headroom while a
# structural bug (mutants below) lands far outside. The final KDA state drifts 4e-7..1.2e-6
# of max|state| under these kernels, a bf16 state 8e-3: 1e-4 sits between.
APPROX_KERNEL = Contract("approx", max_kl=1e-6, min_top1=0.98, max_state_rel=1e-4, quality=("gsm8k", "needle"))

register(Toggle(
    name="kda_chunked", contract=APPROX_KERNEL, touches=("logits", "kda_state"),
    description="KDA prefill in the chunked UT form (C=64, one triangular solve per chunk) "
                "instead of the token recurrence",
    patch=_ops(kda_prefill=kda_chunked)))

register(Toggle(
    name="mla_absorbed", contract=APPROX_KERNEL, touches=("logits",),
    description="MLA attention over latent cache rows with kv_b_proj absorbed into q and "
                "the output (reads each row once; no K/V decompression)",
    patch=_ops(mla_absorbed=mla_absorbed)))

register(Toggle(
    name="mla_sdpa", contract=APPROX_KERNEL, touches=("logits",),
    description="MLA causal softmax in torch's fused SDPA kernel (O(T) memory; long prefills on CPU)",
    patch=_ops(mla_attention=sdpa_attention)))

# ---- exact toggles of the incremental path (the verifier's sequential runner) --------
register(Toggle(
    name="prefill_step_api", contract=EXACT, touches=("logits", "kda_state", "kda_conv", "mla_rows"),
    description="prompt fed through the one-token step API instead of one whole-prompt forward",
    runner={"prefill_chunk": 1}, devices=("cpu",)))

register(Toggle(
    name="state_offload_roundtrip", contract=EXACT, touches=("kda_state", "kda_conv", "mla_rows"),
    description="after every step each request's KDA state and MLA rows are serialised to "
                "bytes and restored into fresh tensors (what a host tier or swap does)",
    runner={"state_roundtrip": True}))


# ---- mutants ----------------------------------------------------------------------------
def _recurrent_bf16_state(q, k, v, g, beta, initial_state=None):
    """Fault: the recurrent state is kept in bf16 between tokens."""
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
    state = (torch.zeros(h, kd, v.shape[-1]) if initial_state is None else initial_state.float().clone())
    out = torch.empty(q.shape[0], h, v.shape[-1])
    decay = ops.exp(g.float())
    for t in range(q.shape[0]):
        kv = (state * k[t].unsqueeze(-1)).sum(1)
        u = beta[t].unsqueeze(-1) * (v[t] - kv)
        state = (state + k[t].unsqueeze(-1) * u.unsqueeze(1)) * decay[t].unsqueeze(-1)
        out[t] = (state * q[t].unsqueeze(-1)).sum(1)
    return out, state


def _router_bias_in_weights(self, x):
    """Fault: the correction bias leaks into the combine weights, not only the selection."""
    cfg = self.cfg
    scores = ops.sigmoid(ops.OPS.linear(x.float(), self.weight.float())) + self.e_score_correction_bias.float()
    _, idx = torch.topk(scores, cfg.num_experts_per_token, dim=-1)
    w = scores.gather(-1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * cfg.routed_scaling_factor


_reference_mix = attn_res.AttnResRead.mix


def _mix_dropping_first_snapshot(candidates, norm_w, proj_w, eps):
    """Fault: once two snapshots exist, the oldest (the embeddings) is dropped from the mix."""
    if len(candidates) >= 3:
        candidates = candidates[1:]
    return _reference_mix(candidates, norm_w, proj_w, eps)


register(Toggle(
    name="mut_kda_state_bf16", kind="mutant", contract=EXACT, touches=("kda_state", "logits"),
    description="KDA recurrent state accumulated in bf16", caught_by=("kda_state", "logits"),
    lives_in="kda/recurrent", patch=_ops(kda_prefill=_recurrent_bf16_state)))

register(Toggle(
    name="mut_kda_decay_after_delta", kind="mutant", contract=EXACT, touches=("kda_state", "logits"),
    description="KDA decay applied after the delta-rule write", caught_by=("kda_state", "logits"),
    lives_in="kda/recurrent", patch=_ops(kda_prefill=_recurrent_decay_after_delta)))

register(Toggle(
    name="mut_router_bias_in_weights", kind="mutant", contract=EXACT, touches=("logits",),
    description="MoE correction bias used in the combine weights, not only for selection",
    caught_by=("logits",), lives_in="moe/ffn",
    patch=functools.partial(_patch_attr, moe.Router, "forward", _router_bias_in_weights)))

register(Toggle(
    name="mut_attnres_drop_snapshot", kind="mutant", contract=EXACT, touches=("logits",),
    description="AttnRes read drops the oldest block snapshot once two exist",
    caught_by=("logits",), lives_in="attn_res/mlp_in",
    patch=functools.partial(_patch_attr, attn_res.AttnResRead, "mix",
                            staticmethod(_mix_dropping_first_snapshot))))

register(Toggle(
    name="mut_kda_chunk_off_by_one", kind="mutant", mutant_of="kda_chunked", contract=APPROX_KERNEL,
    touches=("logits", "kda_state"), description="chunked KDA with an exclusive (off-by-one) decay cumsum",
    caught_by=("drift_budget",), lives_in="kda/mixer",
    patch=_ops(kda_prefill=functools.partial(kda_chunked, _gamma_shift=1))))

register(Toggle(
    name="mut_mla_absorbed_scale", kind="mutant", mutant_of="mla_absorbed", contract=APPROX_KERNEL,
    touches=("logits",), description="absorbed MLA with the softmax scale applied twice",
    caught_by=("drift_budget",), lives_in="mla/mixer",
    patch=_ops(mla_absorbed=functools.partial(mla_absorbed, _scale_mult=24 ** -0.5))))

register(Toggle(
    name="mut_roundtrip_drops_conv", kind="mutant", mutant_of="state_offload_roundtrip", contract=EXACT,
    touches=("kda_conv",), description="state round trip restores the recurrent state but not the conv windows",
    caught_by=("kda_state",), lives_in="kda/conv",
    runner={"state_roundtrip": True, "roundtrip_drops_conv": True}))
