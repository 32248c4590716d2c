"""Paged MLA cache: one preallocated [num_blocks, block_size, R] pool per MLA layer.

A request holds a block table (block ids in token order); block b of the table holds the
rows of positions b*block_size .. (b+1)*block_size - 1. Full blocks can be registered under
their prefix hash and shared read-only by later requests (the prefix cache); a request
only ever writes into blocks past its shared prefix, so no copy-on-write is needed.

Block life: free -> allocated (ref >= 1) -> released: back to `free` when unhashed, or to
the `evictable` LRU when hashed (still hittable). Allocation takes a free block first,
then evicts the least recently used cached block (`on_evict` lets the host tier keep it).

With projected_kv_cache a second pool per layer keeps kv_b_proj's output per row.
Shape letters: N blocks, B block_size, R row width, W projected width.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable

import torch

Rows = dict[int, torch.Tensor]                 # MLA layer -> [n, R] (or [n, W])


class PagedMLACache:
    def __init__(self, layers: list[int], num_blocks: int, block_size: int, width: int,
                 kv_width: int | None, dtype: torch.dtype, device: torch.device,
                 on_evict: Callable[[bytes, int], None] | None = None, spare_blocks: int = 0):
        """`spare_blocks` extra blocks past num_blocks are never allocated: a batched decode step
        (engine/fast) points its padding rows at them, so padding never writes a request's rows."""
        self.layers = list(layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.spare_blocks = spare_blocks
        total = num_blocks + spare_blocks
        self.rows = {i: torch.zeros(total, block_size, width, dtype=dtype, device=device)
                     for i in layers}                                           # [N, B, R]
        self.kv = (None if kv_width is None else
                   {i: torch.zeros(total, block_size, kv_width, dtype=dtype, device=device)
                    for i in layers})                                           # [N, B, W]
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()    # oldest first
        self.on_evict = on_evict
        self.evictions = 0

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def num_free(self) -> int:
        """Blocks an allocation can get (free ones and evictable cached ones)."""
        return len(self.free) + len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation -------------------------------------------------------------------
    def allocate(self) -> int | None:
        if self.free:
            b = self.free.popleft()
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)
            self._evict(b)
        else:
            return None
        self.ref_count[b] = 1
        return b

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        assert h is not None
        if self.on_evict is not None:
            self.on_evict(h, b)
        del self.by_hash[h]
        self.block_hash[b] = None
        self.evictions += 1

    def release(self, b: int) -> None:
        assert self.ref_count[b] > 0, f"block {b} released more often than taken"
        self.ref_count[b] -= 1
        if self.ref_count[b] == 0:
            if self.block_hash[b] is not None:
                self.evictable[b] = None
            else:
                self.free.append(b)

    # ---- prefix sharing ---------------------------------------------------------------
    def has(self, h: bytes) -> bool:
        return h in self.by_hash

    def share(self, h: bytes) -> int | None:
        """Take a reference on the cached block with hash h (None if not on device)."""
        b = self.by_hash.get(h)
        if b is None:
            return None
        if self.ref_count[b] == 0:
            del self.evictable[b]
        self.ref_count[b] += 1
        return b

    def register(self, b: int, h: bytes) -> bool:
        """Make full block b hittable under hash h; False when another block has it."""
        if h in self.by_hash or self.block_hash[b] is not None:
            return False
        self.by_hash[h] = b
        self.block_hash[b] = h
        return True

    # ---- rows -------------------------------------------------------------------------
    def gather(self, table: list[int], num_tokens: int, kv: bool = False) -> Rows:
        """The first num_tokens rows of a block table, per layer -> [num_tokens, R|W]."""
        pools = self.kv if kv else self.rows
        assert pools is not None
        idx = torch.tensor(table[:self.blocks_for(num_tokens)], dtype=torch.long,
                           device=next(iter(pools.values())).device)
        return {i: p.index_select(0, idx).reshape(-1, p.shape[-1])[:num_tokens] for i, p in pools.items()}

    def write(self, table: list[int], start: int, rows: Rows, kv: bool = False) -> None:
        """Write rows [T, R|W] per layer at positions start .. start+T-1 of a block table."""
        pools = self.kv if kv else self.rows
        assert pools is not None
        n = next(iter(rows.values())).shape[0]
        pos = start
        while pos < start + n:
            b, off = divmod(pos, self.block_size)
            take = min(self.block_size - off, start + n - pos)
            for i, p in pools.items():
                p[table[b], off:off + take] = rows[i][pos - start:pos - start + take]
            pos += take

    def read_block(self, b: int, kv: bool = False) -> Rows:
        pools = self.kv if kv else self.rows
        assert pools is not None
        return {i: p[b] for i, p in pools.items()}
