"""Speculative decoding toggles (both exact) and their seeded faults (mutants).

Both toggles run on continuous batching (the paged store keeps the pre-step KDA state in
the pool slot until commit, which is the replay checkpoint). They apply to every scenario
(a non-greedy request simply decodes without drafts) and are exercised by the "spec"
scenarios: spec_repetitive (prompt-lookup drafts mostly accepted) and spec_random (mostly
rejected). The forced-acceptance timing mode is deliberately not a toggle: its output is
not the greedy stream, so it only exists as an engine option for benchmarks.
"""
from __future__ import annotations

from ..toggles import EXACT, Toggle, register
from .options import required_options

ALL = ("logits", "kda_state", "kda_conv", "mla_rows")
NUM_DRAFT_TOKENS = 3
CB = {"continuous_batching": True}
COPY = {**CB, "speculative": "copy_states", "num_draft_tokens": NUM_DRAFT_TOKENS}
REPLAY = {**CB, "speculative": "replay_ssm", "num_draft_tokens": NUM_DRAFT_TOKENS}
# the trained draft model (engine/drafter_model.py, golden/drafters/<target>) instead of prompt lookup
MODEL_COPY = {**COPY, "drafter": "model"}
MODEL_REPLAY = {**REPLAY, "drafter": "model"}


# every verification outcome: all drafts kept (no rollback), some kept, none kept
SPEC_EVENTS = ("spec_accept_all", "spec_accept_partial", "spec_reject_all")


def _opt(name: str, description: str, engine: dict, events: tuple[str, ...] = SPEC_EVENTS) -> None:
    register(Toggle(name=name, description=description, contract=EXACT, touches=ALL, engine=engine,
                    requires=required_options(engine), exercised_by=("spec",), events=events))


def _mut(name: str, of: str, description: str, engine: dict, caught_by: tuple[str, ...], lives_in: str,
         events: tuple[str, ...]) -> None:
    register(Toggle(name=name, description=description, contract=EXACT, touches=ALL, kind="mutant",
                    engine={**engine, "faults": (name,)}, caught_by=caught_by, lives_in=lives_in,
                    mutant_of=of, exercised_by=("spec",), events=events))


_opt("spec_copy_states", f"speculative decoding, {NUM_DRAFT_TOKENS} prompt-lookup drafts per step verified "
     "in one forward; KDA rollback by keeping the state after every verified token", COPY)
_opt("spec_replay_ssm", f"speculative decoding, {NUM_DRAFT_TOKENS} prompt-lookup drafts per step verified "
     "in one forward; KDA rollback by replaying the accepted tokens' stored (k, u, g) from one checkpoint "
     "(ReplaySSM)", REPLAY)

_mut("mut_spec_gate_recompute", "spec_replay_ssm", "replay recomputes the gate from the layer input on "
     "torch's plain GEMM instead of reusing the stored gate (outputs may survive, the state drifts)",
     REPLAY, ("kda_state",), "kda/recurrent", ("spec_accept_partial",))
_mut("mut_spec_conv_not_compacted", "spec_replay_ssm", "after a rejection the conv windows keep the "
     "rejected draft tokens", REPLAY, ("kda_state", "logits"), "kda/conv", ("spec_accept_partial",))
_mut("mut_spec_accept_off_by_one", "spec_copy_states", "greedy acceptance also keeps the first rejected "
     "draft token", COPY, ("tokens",), "engine/spec", ("spec_reject_all",))
_mut("mut_spec_bonus_off_by_one", "spec_copy_states", "when every draft is accepted the bonus token is "
     "read from the row before the last", COPY, ("tokens",), "engine/spec", ("spec_accept_all",))
_mut("mut_spec_replay_closed_form", "spec_replay_ssm", "replay via the chunked closed form "
     "(kernels/kda/chunked.py: cumulative gates, triangular solve) instead of the sequential recurrence", REPLAY, ("kda_state",), "kda/recurrent",
     ("spec_accept_partial",))

# The draft model's toggles: the same verification and rollbacks, drafts from a small head over
# the target's final-norm state (captured in the forward the engine runs anyway). Its events add
# evidence that the model, not prompt lookup, drafted.
_opt("spec_model_copy_states", f"speculative decoding, {NUM_DRAFT_TOKENS} drafts per step from the trained "
     "draft model (an MLP over the target's last hidden state) verified in one forward; KDA rollback by "
     "keeping the state after every verified token", MODEL_COPY, SPEC_EVENTS + ("spec_model_drafts",))
_opt("spec_model_replay_ssm", f"speculative decoding, {NUM_DRAFT_TOKENS} drafts per step from the trained "
     "draft model verified in one forward; KDA rollback by replaying the accepted tokens (ReplaySSM)",
     MODEL_REPLAY, SPEC_EVENTS + ("spec_model_drafts",))
# Reading the target's hidden state from inside its forward is the new risk: a capture that writes
# to what it observes changes the target's own logits (a wrong-position read only costs acceptance
# and is no contract violation: tests/test_drafter_model.py holds that one to the acceptance metric).
# The tokens survive (a positive per-row scale keeps every argmax): only the logits check sees it, and
# the engine trace localises it where the altered rows enter, the lm_head (head/logits).
_mut("mut_spec_model_capture_in_place", "spec_model_replay_ssm", "the draft model's hidden-state capture "
     "RMS-scales the final-norm rows in place, i.e. the tensor the target's lm_head reads next",
     MODEL_REPLAY, ("logits",), "head/logits", ("spec_model_drafts",))
