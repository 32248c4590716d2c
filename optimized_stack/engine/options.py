"""Engine and sampling options, validated on construction; results handed back per request.

Every optimization is an EngineOptions flag that defaults to off; with all of them off the
engine is the reference path. Seeded faults (mutants, negative controls for the verifier)
live apart in `faults` so that no optimization flag can switch one on by accident.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import K3Error

PREEMPT_MODES = ("recompute", "swap")
SPEC_STRATEGIES = ("copy_states", "replay_ssm")     # KDA rollback after verification (spec.py)
DRAFTERS = ("ngram", "model")                 # prompt lookup; the trained head (drafter_model.py)

# Seeded faults an EngineOptions may carry (each is registered as a mutant toggle).
FAULTS = {
    "mut_batch_plain_linear": "a forward of several requests runs on torch's plain GEMM",
    "mut_chunk_resets_conv": "a prefill chunk starting off the block grid starts with zeroed conv windows",
    "mut_chunk_aligned_resets_conv": "a prefill chunk starting on the block grid starts with zeroed conv windows",
    "mut_inside_hit_tail_short": "a hit inside a block copies the tail from the cached full block one row short",
    "mut_end_ckpt_counts_unfed": "the end-of-request checkpoint is keyed by len(tokens), counting the unfed sampled token",
    "mut_host_block_aliases": "a block evicted to the host tier is kept as a view of the device block, not a copy",
    "mut_host_ckpt_drops_conv": "a checkpoint evicted to the host tier is stored without its conv windows",
    "mut_host_take_ckpt_bf16": "a checkpoint restored from the host tier comes back with its recurrent state in bf16",
    "mut_preempt_resets_sampler": "recompute after preemption restarts the request's sampler (its generator reseeded)",
    "mut_spec_bonus_off_by_one": "when every draft is accepted the bonus token is read from the row before the last",
    "mut_restore_skips_conv": "a prefix hit restores the recurrent state but leaves the conv windows zero",
    "mut_ckpt_one_late": "the checkpoint saved for token n holds the state after n+1",
    "mut_tail_one_short": "the MLA tail stored with a checkpoint is one row short",
    "mut_projected_kv_lowp": "projected K/V rows are stored one precision step down (bf16 for fp32, fp8 for bf16)",
    "mut_stale_block_after_evict": "a block restored from the host tier keeps the device block's stale rows",
    "mut_preempt_loses_conv": "swap-in after preemption restores the recurrent state but not the conv windows",
    "mut_recompute_skips_generated": "recompute after preemption re-prefills the prompt and skips the generated tokens",
    "mut_spec_gate_recompute": "speculative replay recomputes the gate from the layer (plain GEMM) instead of reusing it",
    "mut_spec_conv_not_compacted": "after a rejection the conv windows keep the rejected draft tokens",
    "mut_spec_accept_off_by_one": "greedy acceptance also keeps the first rejected draft token",
    "mut_spec_replay_closed_form": "speculative replay uses the chunked closed form, not the sequential recurrence",
    "mut_spec_sampled_accept_sqrt": "sampled speculation accepts a draft with min(1, p/q) ** 0.5, not min(1, p/q)",
    "mut_spec_sampled_resample_from_p": "sampled speculation draws the token after a rejection from p, not from "
                                        "the residual max(0, p - q)",
    "mut_spec_model_capture_in_place": "the model drafter's hidden-state capture rescales the final-norm rows "
                                       "in place, under the target's lm_head",
    "mut_fast_pad_shares_table": "the batched decode step's padding rows use the first request's block table, "
                                 "not the scratch block",
    "mut_fast_conv_wrong_row": "the batched decode step stores request i's conv window from request i+1's input",
    "mut_fused_conv_stale_window": "the fused decode conv stores the new input but leaves the older taps unshifted",
    "mut_fused_combine_slot_order": "the fused MoE combine adds the chosen experts in slot order, not expert order",
    "mut_fused_combine_drops_last": "the fused MoE combine leaves each row's highest expert out",
    "mut_fused_situ_fast_exp": "the fused SiTU-GLU's sigmoid takes tl.exp (ex2.approx) instead of libdevice's expf",
    "mut_fused_situ_no_linear_beta": "the fused SiTU-GLU drops the linear_beta factor of its up half",
    "mut_graph_stale_input": "a replayed CUDA graph reads last replay's token ids (the input copy is skipped)",
    "mut_fast_kda_stale_value_tiles": "the batched decode step writes back only the first 64-wide value tile "
                                      "of each KDA state (inert while the value head is <= 64)",
    "mut_sorted_experts_weights_unsorted": "the sorted prefill experts take the routing weights in (row, slot) "
                                           "order while their outputs are in expert order",
    "mut_batched_mixers_window_from_next": "the batched segment mixers store each segment's new conv window "
                                           "from the next segment's rows",
}

# option -> the option it needs (one line errors name both). The one source of these rules:
# an engine toggle's `requires` is derived from it (required_options), the toggle that switches
# an option on being named after it.
REQUIRES = {
    "prefix_cache_subblock": "prefix_cache",
    "ckpt_with_mla_tail": "prefix_cache_subblock",
    "host_kv_tier": "prefix_cache",
    "preemption": "continuous_batching",
    "speculative": "continuous_batching",
    "spec_sampled": "speculative",
    # the fast step (engine/fast) attends over the projected K/V pool; it also needs the paged
    # store of continuous batching, checked in __post_init__ (one needed option per entry here)
    "batched_decode": "projected_kv_cache",
    "cuda_graphs": "batched_decode",
    "fused_kda_conv": "batched_decode",
    "fused_moe_combine": "batched_decode",
    "fused_situ": "batched_decode",
    # not needed by their code (any forward can take them; the mixers need several segments in one
    # forward_batch, which batched_decode's continuous batching gives), but they belong to the counted
    # fast stack (k3verify/serving/stack.py: the exact toggles that switch the batched decode step on)
    "prefill_sorted_experts": "batched_decode",
    "prefill_batched_mixers": "batched_decode",
}


def required_options(options: dict[str, Any]) -> tuple[str, ...]:
    """The options that the switched-on options in `options` need (REQUIRES), sorted, each once."""
    return tuple(sorted({REQUIRES[k] for k, v in options.items() if v and k in REQUIRES}))


@dataclass(frozen=True)
class EngineOptions:
    continuous_batching: bool = False
    chunked_prefill: bool = False
    token_budget: int = 256                 # tokens per step (prefill chunks + decodes)
    max_num_seqs: int = 8                   # running requests at once (continuous batching)
    prefix_cache: bool = False
    prefix_cache_subblock: bool = False
    ckpt_with_mla_tail: bool = False
    projected_kv_cache: bool = False
    host_kv_tier: bool = False
    preemption: bool = False
    preempt_mode: str = "recompute"
    block_size: int = 64                    # tokens per MLA cache block (and per hash)
    checkpoint_interval: int = 16           # tokens between sub-block KDA checkpoints
    device_cache_tokens: int | None = None  # MLA pool capacity; None -> DEFAULT_DEVICE_TOKENS
    host_cache_tokens: int | None = None    # host tier capacity; None -> unbounded
    kda_pool_slots: int | None = None       # KDA state slots; None -> max_num_seqs (or 1)
    # speculative decoding (spec.py): rollback strategy, drafts per step, drafter; greedy
    # requests only unless spec_sampled. forced_acceptance (mean tokens emitted per step) is for timing only:
    # it accepts drafts regardless of the target, so its output is NOT the greedy stream.
    speculative: str | None = None
    num_draft_tokens: int = 3
    drafter: str = "ngram"
    # drafter="model": its checkpoint directory; None -> golden/drafters/<the target's name>
    drafter_checkpoint: str | None = None
    forced_acceptance: float | None = None
    # speculation for requests with temperature > 0 too, by rejection sampling (spec_sampling.py):
    # the output distribution is the plain sampler's, the random stream is not (so not bitwise)
    spec_sampled: bool = False
    # KDA grid the engine cuts calls and reuses state on (kernels/kda/grid.py): None follows the
    # KDA path in force (64 on the GPU profile, none on the CPU reference); 0 turns it off
    kda_grid: int | None = None
    # engine/fast: plain decode steps as one static-shape forward over every running request
    # (padded to a ladder size), and that forward captured as CUDA graphs (CUDA only)
    batched_decode: bool = False
    cuda_graphs: bool = False
    # engine/fast: the step's KDA causal conv as one Triton launch per conv (kernels/kda/conv_step.py)
    fused_kda_conv: bool = False
    # engine/fast: the static experts' combine as one Triton launch (kernels/moe/combine.py)
    fused_moe_combine: bool = False
    # the routed experts' SiTU-GLU as one Triton launch where its tensors are on CUDA (kernels/moe/situ.py):
    # the batched decode step's static experts, and prefill's sorted experts when prefill_sorted_experts is on
    fused_situ: bool = False
    # the forwards outside the batched decode step (prefill chunks, verifications): routed experts
    # with one host sync per layer instead of one per expert (kernels/moe/sorted.py), bit-identical
    prefill_sorted_experts: bool = False
    # the same forwards: each KDA and MLA layer's token-wise work on every segment's rows at once, the
    # convs over one joined sequence, attention and the recurrence per segment (kernels/kda/segments.py,
    # kernels/mla/segments.py), bit-identical
    prefill_batched_mixers: bool = False
    faults: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("bool",) and not isinstance(v, bool):
                raise K3Error(f"engine option {f.name}: expected true/false, got {v!r}")
        for name in ("token_budget", "max_num_seqs", "block_size", "checkpoint_interval", "num_draft_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise K3Error(f"engine option {name}: expected an integer >= 1, got {v!r}")
        for name, low in (("device_cache_tokens", self.block_size), ("host_cache_tokens", 0),
                          ("kda_pool_slots", 1)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < low):
                raise K3Error(f"engine option {name}: expected None or an integer >= {low}, got {v!r}")
        if self.preempt_mode not in PREEMPT_MODES:
            raise K3Error(f"engine option preempt_mode: expected one of {PREEMPT_MODES}, got {self.preempt_mode!r}")
        if self.speculative is not None and self.speculative not in SPEC_STRATEGIES:
            raise K3Error(f"engine option speculative: expected None or one of {SPEC_STRATEGIES}, "
                          f"got {self.speculative!r}")
        if self.drafter not in DRAFTERS:
            raise K3Error(f"engine option drafter: expected one of {DRAFTERS}, got {self.drafter!r}")
        if self.drafter_checkpoint is not None and (self.drafter != "model"
                                                    or not isinstance(self.drafter_checkpoint, str)):
            raise K3Error(f"engine option drafter_checkpoint: expected None unless drafter='model' (then a "
                          f"directory), got {self.drafter_checkpoint!r} with drafter={self.drafter!r}")
        if self.drafter == "model" and self.speculative is None:
            raise K3Error("engine option drafter='model' requires speculative, which is off")
        fa = self.forced_acceptance
        if fa is not None:
            if isinstance(fa, bool) or not isinstance(fa, (int, float)) or not 1 <= fa <= self.num_draft_tokens + 1:
                raise K3Error(f"engine option forced_acceptance: expected None or a number in "
                              f"[1, num_draft_tokens + 1 = {self.num_draft_tokens + 1}], got {fa!r}")
            if self.speculative is None:
                raise K3Error("engine option forced_acceptance requires speculative, which is off")
        if self.kda_grid is not None and (isinstance(self.kda_grid, bool) or not isinstance(self.kda_grid, int)
                                          or self.kda_grid < 0 or (self.kda_grid and self.block_size % self.kda_grid)):
            raise K3Error(f"engine option kda_grid: expected None, 0 or a divisor of block_size {self.block_size}, "
                          f"got {self.kda_grid!r}")
        if self.block_size % self.checkpoint_interval:
            raise K3Error(f"engine option checkpoint_interval: expected a divisor of block_size "
                          f"{self.block_size}, got {self.checkpoint_interval}")
        if isinstance(self.faults, str):
            raise K3Error(f"engine option faults: expected a set of fault names, got the string {self.faults!r}")
        object.__setattr__(self, "faults", frozenset(self.faults))
        for fault in sorted(self.faults):
            if fault not in FAULTS:
                close = difflib.get_close_matches(fault, list(FAULTS), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise K3Error(f"engine option faults: unknown fault {fault!r}{hint}")
        for opt, needed in REQUIRES.items():
            if getattr(self, opt) and not getattr(self, needed):
                raise K3Error(f"engine option {opt} requires {needed}, which is off")
        if self.batched_decode and not self.continuous_batching:
            raise K3Error("engine option batched_decode requires continuous_batching, which is off")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineOptions":
        """Build from a plain dict (e.g. a toggle's `engine` field); unknown keys are named."""
        names = [f.name for f in fields(cls)]
        for key in d:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise K3Error(f"unknown engine option {key!r}{hint}")
        return cls(**d)

    @property
    def paged(self) -> bool:
        """Whether requests live in the paged MLA pool and the KDA state pool."""
        return self.continuous_batching or self.prefix_cache or self.preemption

    @property
    def checkpoint_spacing(self) -> int:
        return self.checkpoint_interval if self.prefix_cache_subblock else self.block_size


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0               # 0 -> greedy (argmax, lowest id on ties)
    seed: int | None = None                # per-request generator; None -> 0
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise K3Error(f"max_new_tokens: expected an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise K3Error(f"temperature: expected a number >= 0, got {self.temperature!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise K3Error(f"seed: expected an integer or None, got {self.seed!r}")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))


@dataclass
class RequestResult:
    prompt_ids: list[int]
    tokens: list[int]                      # generated tokens (stop token included)
    finish_reason: str                     # "stop" or "length"


@dataclass
class StepOutput:
    """What one step did for one request."""

    request_id: str
    num_tokens: int                        # tokens computed this step
    num_computed: int                      # tokens in the request's state after the step
    new_token: int | None                  # token sampled this step (None: still prefilling)
    finished: bool
    finish_reason: str | None = None
    new_tokens: tuple[int, ...] = ()       # every token emitted this step (speculation: several)
