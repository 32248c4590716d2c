"""The engine's toggles (all exact) and their seeded faults (mutants).

Each toggle's `engine` dict is a set of EngineOptions fields, prerequisites included, so
the options stand on their own even when a caller does not resolve `requires`.
Capacities: host_kv_tier and preemption only do something under pressure, so they set a
small device pool (DEVICE_TOKENS, for the k3-mini scenarios); a scenario can override it.
"""
from __future__ import annotations

from ..toggles import EXACT, Toggle, register
from .options import required_options

ALL = ("logits", "kda_state", "kda_conv", "mla_rows")
# cuts at 96 (inside a block, off the 64 grid) and 192 (on it), alternating along a long prompt
CHUNK_BUDGET = 96
DEVICE_TOKENS = 1024

PC = {"prefix_cache": True}
SUB = {**PC, "prefix_cache_subblock": True}
TAIL = {**SUB, "ckpt_with_mla_tail": True}
HOST = {**PC, "host_kv_tier": True, "device_cache_tokens": DEVICE_TOKENS}
# On the 64-token KDA grid (the GPU profile) a checkpoint is reusable only on the grid, up to the
# computing request's aligned prompt (store.py _ckpt_point): with 64-token blocks every such point is
# a block boundary, so no hit lands inside a block and no MLA tail is stored, and the sub-block
# toggles would be inert there. 128-token blocks put the grid point at 64 inside a block; its state
# is the chunked path's, as at a block boundary (events.py impossible reads these options).
SUB_ON_GRID = {"block_size": 128, "checkpoint_interval": 64}
ON_GRID = {"prefix_cache_subblock": SUB_ON_GRID, "ckpt_with_mla_tail": SUB_ON_GRID}
CB = {"continuous_batching": True}
PRE = {**CB, "preemption": True, "device_cache_tokens": DEVICE_TOKENS}
SWAP = {**PRE, "preempt_mode": "swap"}
CHUNK = {"chunked_prefill": True, "token_budget": CHUNK_BUDGET}


# scenario tags (k3verify.scenarios.workloads) that put each toggle's mechanism under load
EXERCISED_BY = {
    "continuous_batching": ("preemption",), "chunked_prefill": ("long",),
    "prefix_cache": ("prefix",), "prefix_cache_subblock": ("prefix",), "ckpt_with_mla_tail": ("prefix",),
    "projected_kv_cache": ("prefix",), "host_kv_tier": ("eviction", "agentic"), "preemption": ("preemption",),
    "preempt_swap": ("preemption",),
}

# the path events that prove each toggle ran (optimized_stack/events.py); tests/test_events.py
# proves each fires in the toggle's default scenarios and names the mutant that corrupts it
EVENTS = {
    "continuous_batching": ("batched_forward",),
    "chunked_prefill": ("chunk_cut_off_grid", "chunk_cut_on_grid"),
    "prefix_cache": ("checkpoint_saved", "prefix_hit_block", "prefix_hit_on_generated"),
    "prefix_cache_subblock": ("prefix_hit_inside_block", "prefix_hit_on_generated"),
    "ckpt_with_mla_tail": ("prefix_hit_tail_ckpt", "prefix_hit_on_generated"),
    "projected_kv_cache": ("projected_rows_reused",),
    "host_kv_tier": ("host_put_block", "host_take_block", "host_put_ckpt", "host_take_ckpt"),
    "preemption": ("batched_forward", "preempt_recompute_generated", "preempt_sampled"),
    "preempt_swap": ("preempt_swap", "swap_in"),
}


def _opt(name: str, description: str, engine: dict) -> None:
    # every engine toggle can reach every tensor: an MLA layer's output feeds later KDA layers;
    # what it requires is options.REQUIRES's (the toggle named after each needed option)
    requires = tuple(o for o in required_options(engine) if o != name)
    register(Toggle(name=name, description=description, contract=EXACT, touches=ALL,
                    engine=engine, engine_on_grid=ON_GRID.get(name, {}), requires=requires,
                    exercised_by=EXERCISED_BY.get(name, ()), events=EVENTS[name]))


def _mut(name: str, of: str, description: str, engine: dict, caught_by: tuple[str, ...], lives_in: str,
         events: tuple[str, ...]) -> None:
    register(Toggle(name=name, description=description, contract=EXACT, touches=ALL, kind="mutant",
                    engine={**engine, "faults": (name,)}, engine_on_grid=ON_GRID.get(of, {}),
                    caught_by=caught_by, lives_in=lives_in,
                    mutant_of=of, exercised_by=EXERCISED_BY.get(of, ()), events=events))


_opt("continuous_batching", "many requests per step (prefill chunks and decodes in one forward) "
     "on row-stable ops, paged MLA cache and KDA state pool", CB)
_opt("chunked_prefill", f"prompts split across steps under a token budget ({CHUNK_BUDGET})", CHUNK)
_opt("prefix_cache", "block-hashed reuse of MLA rows plus KDA checkpoints at block boundaries "
     "(vLLM align mode)", PC)
_opt("prefix_cache_subblock", "KDA checkpoints every checkpoint_interval tokens and at request end, "
     "usable where the MLA rows up to that token are cached", SUB)
_opt("ckpt_with_mla_tail", "the partial block's MLA rows stored with each KDA checkpoint so forks "
     "hit inside blocks", TAIL)
_opt("projected_kv_cache", "kv_b_proj output kept per cached row so reused rows skip the decompression",
     {"projected_kv_cache": True})
_opt("host_kv_tier", f"LRU eviction of MLA blocks and KDA checkpoints to a host tier under a "
     f"{DEVICE_TOKENS}-token device pool, restored on a hit", HOST)
_opt("preemption", f"preempt the newest running request when the {DEVICE_TOKENS}-token MLA pool "
     "runs out; resume by recompute", PRE)
_opt("preempt_swap", f"preemption under the {DEVICE_TOKENS}-token MLA pool by swap: the request's MLA "
     "rows and KDA state copied out and loaded back on resume", SWAP)

_mut("mut_batch_plain_linear", "continuous_batching", "a forward of several requests runs on torch's "
     "plain GEMM (a row's bits depend on the batch)", CB, ("logits",), "ops/linear", ("batched_forward",))
_mut("mut_chunk_resets_conv", "chunked_prefill", "a prefill chunk starting off the block grid starts "
     "from zeroed conv windows", CHUNK, ("kda_state", "logits"), "kda/conv", ("chunk_cut_off_grid",))
_mut("mut_chunk_aligned_resets_conv", "chunked_prefill", "a prefill chunk starting on the block grid "
     "starts from zeroed conv windows", CHUNK, ("kda_state", "logits"), "kda/conv", ("chunk_cut_on_grid",))
_mut("mut_restore_skips_conv", "prefix_cache", "a prefix hit restores the recurrent state but leaves "
     "the conv windows zero", PC, ("kda_state", "logits"), "kda/conv", ("prefix_hit_block",))
_mut("mut_ckpt_one_late", "prefix_cache", "the checkpoint saved for token n holds the state "
     "after n+1", PC, ("kda_state", "logits"), "kda/recurrent", ("checkpoint_saved", "prefix_hit_block"))
_mut("mut_inside_hit_tail_short", "prefix_cache_subblock", "a hit inside a block copies its tail rows "
     "from the cached full block one row short", SUB, ("logits", "mla_rows"), "mla/cache",
     ("prefix_hit_inside_block",))
_mut("mut_end_ckpt_counts_unfed", "ckpt_with_mla_tail", "the end-of-request checkpoint is keyed by "
     "len(tokens), counting the sampled token that was never fed", TAIL, ("kda_state", "logits"),
     "kda/recurrent", ("prefix_hit_on_generated",))
_mut("mut_tail_one_short", "ckpt_with_mla_tail", "the MLA tail stored with a checkpoint is one row "
     "short (the last row comes from whatever the block held)", TAIL, ("logits", "mla_rows"), "mla/cache",
     ("prefix_hit_tail_ckpt",))
_mut("mut_projected_kv_lowp", "projected_kv_cache", "projected K/V rows stored one precision step down (bf16 for fp32 rows, fp8 for bf16)",
     {"projected_kv_cache": True}, ("logits",), "mla/attention", ("projected_rows_reused",))
_mut("mut_host_block_aliases", "host_kv_tier", "a block evicted to the host tier is kept as a view of "
     "the device block (no copy), which the pool then reuses", HOST, ("logits", "mla_rows"), "mla/cache",
     ("host_put_block", "host_take_block"))
_mut("mut_stale_block_after_evict", "host_kv_tier", "a block restored from the host tier keeps the "
     "device block's stale rows", HOST, ("logits", "mla_rows"), "mla/cache", ("host_take_block",))
_mut("mut_host_ckpt_drops_conv", "host_kv_tier", "a checkpoint evicted to the host tier is stored "
     "without its conv windows", HOST, ("kda_state", "logits"), "kda/conv", ("host_put_ckpt", "host_take_ckpt"))
_mut("mut_host_take_ckpt_bf16", "host_kv_tier", "a checkpoint restored from the host tier comes back "
     "with its recurrent state rounded through bf16", HOST, ("kda_state", "logits"), "kda/recurrent",
     ("host_take_ckpt",))
_mut("mut_preempt_loses_conv", "preempt_swap", "swap-in after preemption restores the recurrent state "
     "but not the conv windows", SWAP, ("kda_state", "logits"), "kda/conv", ("preempt_swap", "swap_in"))
_mut("mut_recompute_skips_generated", "preemption", "recompute after preemption re-prefills the prompt "
     "and skips the generated tokens", PRE, ("kda_state", "logits"), "kda/recurrent",
     ("preempt_recompute_generated",))
_mut("mut_preempt_resets_sampler", "preemption", "recompute after preemption restarts the request's "
     "sampler (its generator reseeded)", PRE, ("tokens",), "engine/sampler", ("preempt_sampled",))
