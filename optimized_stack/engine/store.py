"""Where request state lives between steps.

PlainStore (the reference, and options that need no pool): one model RequestState per
request, advanced in place by the model.
PagedStore (continuous batching, prefix cache, preemption): MLA rows in the paged pool,
KDA state in a pool slot. A forward gets a RequestState assembled from them (rows
gathered, slot views) and `commit` copies the new rows and state back. Every move is a
copy of the exact bits, never a recomputation, which is what keeps the toggles exact.
"""
from __future__ import annotations

import torch

from ..config import KDA, MLA
from ..events import Events
from ..model.kda import KDAState
from ..model.model import K3Model, RequestState
from .host_tier import HostBlock, HostTier, SwapEntry, rows_to_host, to_host
from .kv_cache import PagedMLACache, Rows
from .options import EngineOptions
from .prefix_cache import Checkpoint, PrefixCache, PrefixHit
from .sampler import Sampler
from .scheduler import Request
from .state_pool import KDAStatePool

DEFAULT_DEVICE_TOKENS = 16384


def _round_lower(t: torch.Tensor) -> torch.Tensor:
    """The seeded fault's storage: one precision step down (fp32 rows via bf16, bf16 rows via fp8)."""
    low = torch.bfloat16 if t.dtype == torch.float32 else torch.float8_e4m3fn
    return t.to(low).to(t.dtype)


class PlainStore:
    def __init__(self, model: K3Model, opts: EngineOptions, events: Events | None = None):
        self.model, self.opts = model, opts
        self.events = events if events is not None else Events()

    def admit(self, req: Request) -> bool:
        req.state = self.model.new_state()
        if self.opts.projected_kv_cache:
            req.state.mla_kv = {}
        return True

    def ensure(self, req: Request, num_rows: int) -> bool:
        return True

    def preempt(self, req: Request) -> None:
        raise AssertionError("preemption needs the paged store")

    def state_for(self, req: Request) -> RequestState:
        assert req.state is not None
        if req.state.mla_kv is not None:
            self.events.fire("projected_rows_reused", req.num_computed)
        return req.state

    def zero_conv(self, req: Request) -> None:
        assert req.state is not None
        for st in req.state.kda.values():
            for t in (st.conv_q, st.conv_k, st.conv_v):
                t.zero_()

    def commit(self, req: Request, st: RequestState, start: int, end: int) -> None:
        if st.mla_kv is not None and "mut_projected_kv_lowp" in self.opts.faults:
            for t in st.mla_kv.values():
                t[start:end] = _round_lower(t[start:end])
        req.num_computed = end

    def kda_states(self, req: Request) -> dict:
        assert req.state is not None
        return req.state.kda

    def kda_states_stacked(self, reqs: list[Request]) -> dict[int, dict[str, torch.Tensor]]:
        """layer -> name -> [len(reqs), ...]: copies of the requests' KDA state, row i reqs[i]'s."""
        states = [self.kda_states(req) for req in reqs]
        return {layer: {name: torch.stack([st[layer].tensors()[name] for st in states])
                        for name in states[0][layer].tensors()} for layer in states[0]}

    def mla_rows(self, req: Request) -> Rows:
        """Copies the caller owns (the state's own tensors live on while the request runs)."""
        assert req.state is not None
        return {i: t.clone() for i, t in req.state.mla.items()}

    def finish(self, req: Request) -> None:
        req.state = None

    def capacity_tokens(self) -> int:
        return 0


class PagedStore:
    def __init__(self, model: K3Model, opts: EngineOptions, grid: int | None = None,
                 events: Events | None = None):
        self.model, self.opts = model, opts
        self.events = events if events is not None else Events()
        # On a KDA grid (kernels/kda/grid.py) only state computed on the chunked path can be
        # reused: checkpoints at grid points up to the computing request's aligned prompt length,
        # MLA blocks that end there. Sub-block, tail and end-of-request checkpoints lie past it.
        self.grid = grid
        cfg = model.config
        proto = model.new_state()
        self.mla_layers = [i for i, k in enumerate(cfg.layer_kinds) if k == MLA]
        self.kda_layers = [i for i, k in enumerate(cfg.layer_kinds) if k == KDA]
        device_tokens = opts.device_cache_tokens or DEFAULT_DEVICE_TOKENS
        num_blocks = device_tokens // opts.block_size
        kv_width = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) if opts.projected_kv_cache else None
        self.host = (HostTier(opts.block_size, opts.host_cache_tokens, opts.checkpoint_spacing,
                              self.events, opts.faults) if opts.host_kv_tier else None)
        spare = 1 if opts.batched_decode else 0        # the fast step's padding rows (engine/fast)
        self.mla = PagedMLACache(self.mla_layers, num_blocks, opts.block_size, cfg.mla_cache_width,
                                 kv_width, next(iter(proto.mla.values())).dtype, model.device,
                                 on_evict=self._block_evicted if self.host else None, spare_blocks=spare)
        slots = opts.kda_pool_slots or (opts.max_num_seqs if opts.continuous_batching else 1)
        self.pool = KDAStatePool(proto.kda, slots, spare=spare)
        # checkpoint capacity: one per checkpoint spacing of the device pool, at least 4 (was 8:
        # the eviction scenario's 256-token pool then never evicted a checkpoint to the host tier)
        self.prefix = (PrefixCache(self.mla, self.host, opts.checkpoint_spacing, opts.prefix_cache_subblock,
                                   max(4, device_tokens // opts.checkpoint_spacing))
                       if opts.prefix_cache else None)
        self.swap: dict[str, SwapEntry] = {}
        self.faults = opts.faults
        self.checkpoints_saved = 0
        self.swap_ins = 0
        self.block_restores = 0

    # ---- capacity ---------------------------------------------------------------------
    def capacity_tokens(self) -> int:
        return self.mla.capacity_tokens

    def fits(self, num_rows: int) -> bool:
        return self.mla.blocks_for(num_rows) <= self.mla.num_blocks

    def _target_rows(self, req: Request) -> int:
        """Rows to reserve at admission: the whole request without preemption (it can then
        never run out), just what it has so far with it (it grows on demand)."""
        if self.opts.preemption:
            return len(req.tokens)
        return max(len(req.tokens), len(req.prompt) + req.params.max_new_tokens - 1)

    def ensure(self, req: Request, num_rows: int) -> bool:
        while len(req.blocks) * self.mla.block_size < num_rows:
            b = self.mla.allocate()
            if b is None:
                return False
            req.blocks.append(b)
        return True

    # ---- admission --------------------------------------------------------------------
    def admit(self, req: Request) -> bool:
        slot = self.pool.acquire()
        if slot is None:
            return False
        hit: PrefixHit | None = None
        if not req.swapped and self.prefix is not None:
            hit = self.prefix.match(req.tokens, len(req.tokens) - 1)
        shared: dict[bytes, int] = {}
        if hit is not None:
            for h in hit.block_hashes + ([hit.tail_block] if hit.tail_block else []):
                b = self.mla.share(h)
                if b is not None:
                    shared[h] = b
        own_shared = sum(1 for h in hit.block_hashes if h in shared) if hit else 0
        need = self.mla.blocks_for(self._target_rows(req)) - own_shared
        if self.mla.num_free() < need:
            for b in shared.values():
                self.mla.release(b)
            self.pool.release(slot)
            return False
        req.slot, req.blocks, req.registered = slot, [], 0
        if req.swapped:
            self._swap_in(req)
        elif hit is not None:
            self._apply_hit(req, hit, shared)
        else:
            req.num_computed = 0
        ok = self.ensure(req, self._target_rows(req))
        assert ok, "admission counted free blocks but could not allocate them"
        return True

    def _apply_hit(self, req: Request, hit: PrefixHit, shared: dict[bytes, int]) -> None:
        assert self.prefix is not None and req.slot is not None
        bs = self.mla.block_size
        # Take everything from the host tier before allocating: an allocation can evict a
        # device block into the host tier and push out an entry this hit still needs.
        ck = self.prefix.take(hit.ckpt_key)
        from_host = {h: self.host.get_block(h) for h in hit.block_hashes + [hit.tail_block]
                     if h is not None and h not in shared and self.host is not None}
        for h in hit.block_hashes:
            b = shared.get(h)
            req.blocks.append(self._restore_block(h, from_host[h]) if b is None else b)
        r = hit.num_tokens % bs
        if r:
            b = self.mla.allocate()
            assert b is not None
            if ck.tail is not None:
                rows, kv = ck.tail, ck.tail_kv
                self.events.fire("prefix_hit_tail_ckpt")
            elif hit.tail_block in shared:
                src = shared[hit.tail_block]
                rows = self.mla.read_block(src)
                kv = self.mla.read_block(src, kv=True) if self.mla.kv is not None else None
            else:
                assert hit.tail_block is not None
                hb = from_host[hit.tail_block]
                rows, kv = hb.rows, hb.kv
            if ck.tail is None:
                self.events.fire("prefix_hit_inside_block")
            # seeded fault: the tail copied from a cached full block one row short
            keep = r - 1 if ck.tail is None and "mut_inside_hit_tail_short" in self.faults else r
            self._fill(b, {i: t[:keep] for i, t in rows.items()},
                       None if kv is None else {i: t[:keep] for i, t in kv.items()})
            req.blocks.append(b)
            if hit.tail_block in shared:
                self.mla.release(shared[hit.tail_block])
        if not r:
            self.events.fire("prefix_hit_block")
        if ck.covers_generated:
            self.events.fire("prefix_hit_on_generated")
        self.pool.load(req.slot, ck.kda, skip_conv="mut_restore_skips_conv" in self.faults)
        req.num_computed = hit.num_tokens
        req.hashes = list(hit.block_hashes)
        req.registered = len(hit.block_hashes)

    def _fill(self, b: int, rows: Rows, kv: Rows | None) -> None:
        n = next(iter(rows.values())).shape[0]
        for i, t in rows.items():
            self.mla.rows[i][b, :n] = t
        if kv is not None and self.mla.kv is not None:
            for i, t in kv.items():
                self.mla.kv[i][b, :n] = t

    def _restore_block(self, h: bytes, hb: HostBlock) -> int:
        """Host tier -> a fresh device block, registered again under its hash."""
        b = self.mla.allocate()
        assert b is not None
        if "mut_stale_block_after_evict" not in self.faults:
            self._fill(b, hb.rows, hb.kv)
        self.mla.register(b, h)
        self.block_restores += 1
        return b

    def _block_evicted(self, h: bytes, b: int) -> None:
        assert self.host is not None
        self.host.put_block(h, self.mla.read_block(b),
                            self.mla.read_block(b, kv=True) if self.mla.kv is not None else None)

    # ---- preemption -------------------------------------------------------------------
    def preempt(self, req: Request) -> None:
        assert req.slot is not None
        if self.opts.preempt_mode == "swap":
            n = req.num_computed
            kv = self.mla.gather(req.blocks, n, kv=True) if self.mla.kv is not None else None
            kda = {i: KDAState(*(to_host(t) for t in st.tensors().values()))
                   for i, st in self.pool.view(req.slot).items()}
            self.swap[req.request_id] = SwapEntry(n, kda, rows_to_host(self.mla.gather(req.blocks, n)) or {},
                                                  rows_to_host(kv))
            req.swapped = True
        else:
            req.num_computed = 0
            if "mut_preempt_resets_sampler" in self.faults:
                req.sampler = Sampler(req.params)
            req.skip_generated = "mut_recompute_skips_generated" in self.faults and bool(req.generated)
        self._release(req)

    def _swap_in(self, req: Request) -> None:
        assert req.slot is not None
        entry = self.swap.pop(req.request_id)
        req.swapped = False
        ok = self.ensure(req, entry.num_tokens)
        assert ok
        if entry.num_tokens:
            self.mla.write(req.blocks, 0, entry.rows)
            if entry.kv is not None:
                self.mla.write(req.blocks, 0, entry.kv, kv=True)
        self.pool.load(req.slot, entry.kda, skip_conv="mut_preempt_loses_conv" in self.faults)
        req.num_computed = entry.num_tokens
        self.swap_ins += 1
        self.events.fire("swap_in")
        self._register_full(req)

    def _release(self, req: Request) -> None:
        for b in reversed(req.blocks):          # deepest blocks become the first evicted
            self.mla.release(b)
        req.blocks = []
        if req.slot is not None:
            self.pool.release(req.slot)
        req.slot = None
        req.registered = 0

    # ---- forward plumbing -------------------------------------------------------------
    def state_for(self, req: Request) -> RequestState:
        assert req.slot is not None
        n = req.num_computed
        st = RequestState(n, self.pool.view(req.slot), self.mla.gather(req.blocks, n))
        if self.mla.kv is not None:
            st.mla_kv = self.mla.gather(req.blocks, n, kv=True)
            self.events.fire("projected_rows_reused", n)
        return st

    def zero_conv(self, req: Request) -> None:
        assert req.slot is not None
        self.pool.zero_conv(req.slot)

    def commit(self, req: Request, st: RequestState, start: int, end: int) -> None:
        assert req.slot is not None
        self.mla.write(req.blocks, start, {i: st.mla[i][start:end] for i in self.mla_layers})
        if st.mla_kv is not None:
            kv = {i: st.mla_kv[i][start:end] for i in self.mla_layers}
            if "mut_projected_kv_lowp" in self.faults:
                kv = {i: _round_lower(t) for i, t in kv.items()}
            self.mla.write(req.blocks, start, kv, kv=True)
        self.pool.store(req.slot, st.kda)
        self.commit_written(req, end)

    def commit_written(self, req: Request, end: int) -> None:
        """The bookkeeping of `commit` for a step that wrote its MLA rows and KDA state into the
        pools itself (engine/fast's batched decode): the request now holds `end` tokens."""
        req.num_computed = end
        if self.prefix is None:
            return
        self._register_full(req)
        late = "mut_ckpt_one_late" in self.faults
        point = end - 1 if late else end
        if self._ckpt_point(req, point):
            self._save_checkpoint(req, point)

    def _aligned(self, req: Request) -> int:
        """Where the grid reference leaves the chunked path for this request."""
        assert self.grid
        return len(req.prompt) - len(req.prompt) % self.grid

    def _ckpt_point(self, req: Request, n: int) -> bool:
        assert self.prefix is not None
        if not self.prefix.is_point(n):
            return False
        return not self.grid or (n % self.grid == 0 and n <= self._aligned(req))

    def split_points(self, req: Request, start: int, end: int) -> list[int]:
        """Positions inside (start, end) where a forward must stop so a checkpoint can be
        taken (the model hands back the state only at the end of a call). A point whose
        checkpoint is already stored needs no cut: each cut costs a forward."""
        if self.prefix is None:
            return []
        shift = 1 if "mut_ckpt_one_late" in self.faults else 0
        points = [p for p in range(start + 1 - shift, end - shift) if self._ckpt_point(req, p)]
        if points:
            self.prefix.chain(req.tokens, req.hashes, points[-1] // self.mla.block_size)
        cuts = [p + shift for p in points if self.prefix.wants(self.prefix.key(req.tokens, req.hashes, p))]
        # on the KDA grid a call may only stop on it (kernels/kda/grid.py): a seeded fault's
        # off-grid cut (mut_ckpt_one_late) is dropped, so that fault cannot fire there
        return [c for c in cuts if not self.grid or c % self.grid == 0 or c >= self._aligned(req)]

    def _register_full(self, req: Request) -> None:
        if self.prefix is None:
            return
        full = req.num_computed // self.mla.block_size
        if self.grid:                            # blocks past the chunked path are not reusable
            full = min(full, self._aligned(req) // self.mla.block_size)
        if full <= req.registered:
            return
        self.prefix.chain(req.tokens, req.hashes, full)
        for j in range(req.registered, full):
            self.mla.register(req.blocks[j], req.hashes[j])
        req.registered = full

    def _save_checkpoint(self, req: Request, n: int, at_end: bool = False) -> None:
        assert self.prefix is not None and req.slot is not None
        bs = self.mla.block_size
        j, r = divmod(n, bs)
        self.prefix.chain(req.tokens, req.hashes, j)
        key = self.prefix.key(req.tokens, req.hashes, n)
        if not self.prefix.wants(key):
            return
        tail = tail_kv = None
        if self.opts.ckpt_with_mla_tail and r:
            keep = r - 1 if "mut_tail_one_short" in self.faults else r
            tail = {i: t[:keep].clone() for i, t in self.mla.read_block(req.blocks[j]).items()}
            if self.mla.kv is not None:
                tail_kv = {i: t[:keep].clone() for i, t in self.mla.read_block(req.blocks[j], kv=True).items()}
        self.prefix.put(key, Checkpoint(n, self.pool.snapshot(req.slot), tail, tail_kv,
                                        covers_generated=n > len(req.prompt)))
        self.checkpoints_saved += 1
        self.events.fire("checkpoint_saved")
        if at_end:
            self.events.fire("checkpoint_saved_at_end")

    # ---- results ----------------------------------------------------------------------
    def kda_states(self, req: Request) -> dict:
        assert req.slot is not None
        return self.pool.view(req.slot)

    def kda_states_stacked(self, reqs: list[Request]) -> dict[int, dict[str, torch.Tensor]]:
        """PlainStore.kda_states_stacked's copies, gathered from the pool by slot."""
        assert all(req.slot is not None for req in reqs)
        return self.pool.gather([req.slot for req in reqs])

    def mla_rows(self, req: Request) -> Rows:
        return self.mla.gather(req.blocks, req.num_computed)      # index_select: already a copy

    def finish(self, req: Request) -> None:
        if (self.prefix is not None and self.opts.prefix_cache_subblock and req.num_computed
                and not self.grid):               # past the chunked path on a grid
            # seeded fault: the end checkpoint keyed by len(tokens), counting the sampled token
            # that was never fed (its state is the one after num_computed tokens)
            n = len(req.tokens) if "mut_end_ckpt_counts_unfed" in self.faults else req.num_computed
            self._save_checkpoint(req, n, at_end=True)
        self._release(req)

    @property
    def evictions(self) -> int:
        return self.mla.evictions + (self.prefix.evictions if self.prefix else 0)

    @property
    def restores(self) -> int:
        return self.block_restores + (self.prefix.restores if self.prefix else 0)

