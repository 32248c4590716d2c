"""Path events: named counters that prove an optimization's own code ran.

A toggle declares the events of its path (Toggle.events); the engine, its store, host tier,
scheduler and speculator, the verifier's runners and the op table count them while a
scenario runs, and the gate refuses to call an exact (or in-budget) verdict a pass on a
scenario where a declared event never fired: it is `not exercised`, with the event named.

Two families of names:
- the fixed names below (EVENTS), each counted at one place in the code (named beside it);
- `op:<slot>` (OP_PREFIX): calls of the implementation a toggle put into an op-table slot
  (model/ops.py OpTable), counted by the wrapper `toggles.applied` installs.
"""
from __future__ import annotations

import difflib
from collections import Counter

from .errors import K3Error

OP_PREFIX = "op:"

# name -> what fired it (and where it is counted)
EVENTS = {
    # engine.py / scheduler.py
    "batched_forward": "a forward ran more than one request's rows (engine._run_plan)",
    "chunk_cut_on_grid": "a prefill chunk was cut on the 64-token block grid (scheduler.place)",
    "chunk_cut_off_grid": "a prefill chunk was cut off the 64-token block grid (scheduler.place)",
    # store.py: prefix hits by kind, checkpoints
    "prefix_hit_block": "a prefix hit ending on a block boundary",
    "prefix_hit_inside_block": "a prefix hit inside a block, its tail rows from a cached full block",
    "prefix_hit_tail_ckpt": "a prefix hit inside a block, its tail rows stored with the checkpoint",
    "prefix_hit_on_generated": "a prefix hit on a checkpoint that covers tokens an earlier request generated",
    "checkpoint_saved": "a KDA checkpoint was stored in the prefix cache",
    "checkpoint_saved_at_end": "a KDA checkpoint was stored at a request's end (prompt + generated)",
    "projected_rows_reused": "cached projected K/V rows were handed to a forward (store.state_for)",
    # host_tier.py / prefix_cache.py / store.py
    "host_put_block": "an evicted MLA block was copied into the host tier",
    "host_take_block": "an MLA block was restored from the host tier",
    "host_put_ckpt": "an evicted KDA checkpoint was copied into the host tier",
    "host_take_ckpt": "a KDA checkpoint was restored from the host tier",
    # scheduler.py / store.py: preemption
    "preempt_recompute": "a request was preempted to be recomputed",
    "preempt_recompute_generated": "a preempted request had generated tokens that recompute must re-feed",
    "preempt_swap": "a request was preempted by swapping its state out",
    "preempt_sampled": "a sampled (temperature > 0) request was preempted",
    "swap_in": "a swapped-out request's state was loaded back",
    # spec.py: verification outcomes
    "spec_accept_all": "a verification accepted every draft",
    "spec_accept_partial": "a verification accepted some drafts and rejected the rest",
    "spec_reject_all": "a verification rejected every draft",
    # spec.py via spec_sampling.py: sampled (temperature > 0) verification outcomes
    "spec_sampled_accept_all": "a sampled verification accepted every draft (the bonus token drawn from p)",
    "spec_sampled_accept_partial": "a sampled verification accepted some drafts, the next token from the residual",
    "spec_sampled_reject_all": "a sampled verification rejected the first draft, the token from the residual",
    # engine/drafter_model.py
    "spec_model_drafts": "the trained draft model proposed drafts from the target's hidden states "
                         "(ModelDrafter.propose_many)",
    # engine/fast/decoder.py: the batched decode step and its graphs
    "fast_decode_rows": "a request's decode row ran in the batched decode step (FastDecoder.run)",
    "prefill_sorted_experts": "a MoE layer of a forward outside the batched decode step ran its routed experts "
                              "through one sort (engine._sorted_experts)",
    "prefill_batched_mixers": "a KDA or MLA layer of a forward over several segments ran every segment's "
                              "token-wise work on all rows at once (prefill_batched_mixers; counts segments)",
    "fast_padded_rows": "the batched decode step ran padding rows up to the ladder size (FastDecoder.run)",
    "graph_replay": "the batched decode step was replayed from a captured CUDA graph (FastDecoder._forward)",
    "fast_step_digests": "a decode row's logits and KDA states were digested for the observers inside the "
                         "batched decode step (FastDecoder.run; engine/fast/step_digests.py)",
    "fast_kda_value_tiles": "a decode row's KDA recurrence ran more than one 64-wide value tile in the batched "
                            "step (FastDecoder.run; only where the value head is > 64)",
    "fast_fused_conv_rows": "a decode row's KDA convs ran as the fused Triton kernel (fused_kda_conv; "
                            "FastDecoder.run)",
    "fast_fused_combine_rows": "a decode row's routed experts were combined by the fused Triton kernel "
                               "(fused_moe_combine; FastDecoder.run)",
    "fast_fused_combine_three_plus": "the fused combine summed three or more experts a row, where the "
                                     "order of the sum shows in its bits (FastDecoder.run; only where "
                                     "num_experts_per_token > 2)",
    "fused_situ": "the routed experts' SiTU-GLU ran as the fused Triton kernel (fused_situ): a decode step's "
                  "request rows (FastDecoder.run), a prefill MoE layer's (token, expert) rows "
                  "(engine._sorted_experts)",
    "fused_situ_wide": "the fused SiTU-GLU ran on experts wider than 64 (as fused_situ; only where "
                       "moe_intermediate_size > 64)",
    # k3verify/run/sequential.py (the verifier's runner-level toggles)
    "prompt_via_step_api": "a prompt was fed through the step API in more than one call",
    "state_roundtrip": "a request's state was serialised to bytes and restored",
    # parallel/tp_model.py, tp_shards.py (counted on rank 0)
    "tp_dedup_gather": "replicated work was row-sharded and all-gathered",
    "moe_shard_add": "the routed output was column-sharded into the shared expert's partial",
    "fused_allreduce": "the all-reduce ran fused with the residual add",
    "dcp_merge": "MLA partial attentions were merged by log-sum-exp across ranks",
    "dcp_fp8_gather": "a prefill call all-gathered the DCP-sharded MLA context in FP8 (tp_shards.py)",
}


# Events no scenario can fire while the engine cuts KDA on the 64-token grid (the GPU profile;
# kernels/kda/grid.py): the store reuses state only where it was computed on the chunked path,
# i.e. at grid points up to the computing request's 64-aligned prompt length (engine/store.py).
# Measured on the CPU twin (cpu_grid_kda) at full scale over every prefix scenario: never fired.
# A verdict on the grid does not wait for them, and a toggle all of whose events are here does
# not apply there. The two sub-block events are impossible only where every reusable checkpoint
# is a block boundary (SUB_BLOCK_EVENTS, decided from the engine options in force).
OFF_GRID_IMPOSSIBLE = {
    "prefix_hit_on_generated": "a checkpoint past the computing request's aligned prompt length (over "
                               "tokens it generated) is never reused on the 64-token KDA grid",
    "prefix_hit_tail_ckpt": "checkpoints reused on the 64-token KDA grid fall on block boundaries, so no "
                            "partial-block MLA tail is ever stored with one",
    "prefix_hit_inside_block": "on the 64-token KDA grid a hit inside a block restarts from the last aligned "
                               "checkpoint (a block-boundary hit) and recomputes the rest",
}
SUB_BLOCK_EVENTS = ("prefix_hit_tail_ckpt", "prefix_hit_inside_block")


def _reusable_inside_blocks(grid: int, engine: dict | None) -> bool:
    """Whether a checkpoint reusable on `grid` can fall inside a block: checkpoints every
    `spacing` tokens are reusable at multiples of lcm(spacing, grid), and those are all block
    boundaries iff block_size divides that lcm (64-token blocks: always)."""
    from math import lcm

    from .engine.options import EngineOptions
    opts = EngineOptions.from_dict(engine or {})
    return lcm(opts.checkpoint_spacing, grid) % opts.block_size != 0


# Events that fire only at some model dims: a loop over 64-wide head-dim tiles (as the GPU kernels
# tile) has a second trip only where the head is wider than one tile. event -> (the config field,
# the width it must exceed). A mutant all of whose events are here does not apply to such a model
# (it is judged on one whose dims run its code, e.g. k3-dims), so it is never a silent "caught".
DIMS_NEEDED = {
    "fast_kda_value_tiles": ("kda_head_dim", 64, "one tile, so the code for the tiles after the first never runs"),
    # a sum of two experts from zero is the same in either order ((0 + a) + b == (0 + b) + a)
    "fast_fused_combine_three_plus": ("num_experts_per_token", 2, "two experts a row, whose sum from zero "
                                      "is the same in any order"),
    # not a code path but a count: a fault of a few fp32 ULP in the fused SiTU-GLU's sigmoid reaches a
    # bf16 activation only where it crosses a rounding boundary, ~2^-16 of the elements it moves. On
    # multi_length k3-mini's width-32 experts give ~3e5 routed activations, about one expected crossing
    # (a coin toss); k3-small's width 384, ~1e7 and dozens (estimate: kernels/moe/situ.py's fault,
    # emulated under the interpreter, moved 12 of 1M bf16 outputs)
    "fused_situ_wide": ("moe_intermediate_size", 64, "experts this narrow give a scenario too few activations "
                        "for a few-ULP fault in the sigmoid to cross a bf16 rounding reliably"),
}


def impossible(declared: tuple[str, ...] | list[str], grid: int | None, config=None,
               engine: dict | None = None) -> dict[str, str]:
    """The declared events that cannot fire on this KDA grid (none off the grid), with the engine
    options in force there (`engine`, a dict of EngineOptions fields; defaults where absent), or
    at this model's dims (`config`, a K3Config), with why."""
    inside = bool(grid) and _reusable_inside_blocks(grid, engine)
    out = {e: OFF_GRID_IMPOSSIBLE[e] for e in declared
           if grid and e in OFF_GRID_IMPOSSIBLE and not (inside and e in SUB_BLOCK_EVENTS)}
    for e in declared:
        if config is not None and e in DIMS_NEEDED:
            field, width, why = DIMS_NEEDED[e]
            if getattr(config, field) <= width:
                out[e] = (f"at this model's dims: {field} {getattr(config, field)} <= {width}, {why} "
                          f"(judge it on a model past that, e.g. k3-dims or k3-small)")
    return out


def check_name(name: str, slots: list[str], owner: str) -> None:
    """A declared event must be counted somewhere: a known name or op:<known slot>."""
    if name.startswith(OP_PREFIX):
        slot = name[len(OP_PREFIX):]
        if slot not in slots:
            close = difflib.get_close_matches(slot, slots, n=1)
            raise K3Error(f"{owner}: event {name!r} names no op slot"
                          f"{f'; did you mean {OP_PREFIX}{close[0]!r}?' if close else ''}")
        return
    if name not in EVENTS:
        close = difflib.get_close_matches(name, list(EVENTS), n=1)
        raise K3Error(f"{owner}: unknown event {name!r}{f'; did you mean {close[0]!r}?' if close else ''}")


class Events(Counter):
    """The counters of one run (name -> times fired); `fire` is the only writer."""

    def fire(self, name: str, n: int = 1) -> None:
        assert name in EVENTS or name.startswith(OP_PREFIX), f"uncounted event name {name!r}"
        if n:
            self[name] += n


def missing(declared: tuple[str, ...] | list[str], fired: dict[str, int]) -> list[str]:
    """The declared events that never fired, in declaration order."""
    return [e for e in declared if not fired.get(e)]
