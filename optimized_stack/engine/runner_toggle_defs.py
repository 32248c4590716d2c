"""Exact toggles of the incremental path, run by the verifier's plain sequential runner
(k3verify/run/sequential.py reads their `runner` options), and the mutant of the state round trip."""
from __future__ import annotations

from ..toggles import EXACT, Toggle, register

STEP_API_NOT_EXACT = {"cuda": "one-token steps run KDA through the decode kernel (fused_recurrent_kda) where "
                              "the GPU reference prefill runs chunk_kda on the 64-aligned part; the two agree "
                              "only to rounding (exact with K3_GPU_KDA=recurrent, which recurs every call)"}

register(Toggle(
    name="prefill_step_api", contract=EXACT, touches=("logits", "kda_state", "kda_conv", "mla_rows"),
    description="prompt fed through the one-token step API instead of one whole-prompt forward",
    runner={"prefill_chunk": 1}, not_exact_on=STEP_API_NOT_EXACT, events=("prompt_via_step_api",)))

register(Toggle(
    name="mut_step_api_resets_conv", kind="mutant", mutant_of="prefill_step_api", contract=EXACT,
    touches=("logits", "kda_state", "kda_conv"), description="each step-API call after the first starts from "
    "zeroed conv windows (as if a new sequence)", caught_by=("kda_state", "logits"), lives_in="kda/conv",
    runner={"prefill_chunk": 1, "step_api_resets_conv": True}, not_exact_on=STEP_API_NOT_EXACT,
    events=("prompt_via_step_api",)))

register(Toggle(
    name="state_offload_roundtrip", contract=EXACT, touches=("kda_state", "kda_conv", "mla_rows"),
    description="after every step each request's KDA state and MLA rows are serialised to "
                "bytes and restored into fresh tensors (what a host tier or swap does)",
    runner={"state_roundtrip": True}, events=("state_roundtrip",)))

register(Toggle(
    name="mut_roundtrip_drops_conv", kind="mutant", mutant_of="state_offload_roundtrip", contract=EXACT,
    touches=("kda_conv",), description="state round trip restores the recurrent state but not the conv windows",
    caught_by=("kda_state",), lives_in="kda/conv",
    runner={"state_roundtrip": True, "roundtrip_drops_conv": True}, events=("state_roundtrip",)))
