"""Prefix cache for a hybrid model: MLA blocks by prefix hash, KDA checkpoints by token.

MLA rows can be reused at any token; the KDA state only where a checkpoint was saved.
- Blocks: hash chain h_j = H(h_{j-1} || tokens of block j) over full blocks, so a hash
  names the whole prefix up to the block's end.
- Checkpoints: the KDA state after n tokens (every layer, recurrent and conv), keyed by
  (h_{j}, tokens[j*B:n]) with j = n // B. Saved at block boundaries (vLLM's `align`
  mode); with prefix_cache_subblock also every checkpoint_interval tokens and at the end
  of each request; with ckpt_with_mla_tail the partial block's MLA rows [j*B, n) are
  stored with the checkpoint.
- A hit at n needs the MLA rows of 0..n-1 (full blocks 0..j-1 plus, when n is inside a
  block, the tail: from the checkpoint or from a cached full block j) AND a checkpoint at
  n. The lookup takes the largest such n <= prompt_len - 1 (the last prompt token is
  always computed: its logits row is needed); everything after it is recomputed.
Shape letters: B block_size.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .host_tier import HostTier
from .kv_cache import PagedMLACache, Rows
from .state_pool import Snapshot

ROOT = b"k3-prefix-root"


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


CkptKey = tuple[bytes, tuple[int, ...]]


@dataclass
class Checkpoint:
    num_tokens: int
    kda: Snapshot
    tail: Rows | None = None                 # layer -> [n - j*B, R]
    tail_kv: Rows | None = None              # layer -> [n - j*B, W]
    covers_generated: bool = False           # n reaches past the saving request's prompt

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Checkpoint":
        from ..model.kda import KDAState
        kda = {i: KDAState(*(fn(t) for t in st.tensors().values())) for i, st in self.kda.items()}
        tail = None if self.tail is None else {i: fn(t) for i, t in self.tail.items()}
        tail_kv = None if self.tail_kv is None else {i: fn(t) for i, t in self.tail_kv.items()}
        return Checkpoint(self.num_tokens, kda, tail, tail_kv, self.covers_generated)


@dataclass
class PrefixHit:
    num_tokens: int                          # n: tokens served from the cache
    block_hashes: list[bytes]                # full blocks 0..j-1
    tail_block: bytes | None                 # block j's hash when the tail rows come from it
    ckpt_key: CkptKey


class PrefixCache:
    def __init__(self, mla: PagedMLACache, host: HostTier | None, spacing: int, end_checkpoints: bool,
                 ckpt_capacity: int):
        self.mla = mla
        self.host = host
        self.block_size = mla.block_size
        self.spacing = spacing                 # checkpoint every `spacing` tokens
        self.end_checkpoints = end_checkpoints
        self.ckpt_capacity = ckpt_capacity
        self.ckpts: OrderedDict[CkptKey, Checkpoint] = OrderedDict()     # oldest first
        self.evictions = 0
        self.restores = 0

    # ---- keys -------------------------------------------------------------------------
    def chain(self, tokens: list[int], hashes: list[bytes], num_blocks: int) -> list[bytes]:
        """Extend `hashes` (in place) to the first num_blocks full blocks of tokens."""
        bs = self.block_size
        while len(hashes) < num_blocks:
            j = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else ROOT, tokens[j * bs:(j + 1) * bs]))
        return hashes

    def key(self, tokens: list[int], hashes: list[bytes], n: int) -> CkptKey:
        j = n // self.block_size
        parent = hashes[j - 1] if j else ROOT
        return parent, tuple(tokens[j * self.block_size:n])

    def is_point(self, n: int) -> bool:
        return n > 0 and n % self.spacing == 0

    # ---- checkpoints ------------------------------------------------------------------
    def wants(self, key: CkptKey) -> bool:
        return key not in self.ckpts

    def put(self, key: CkptKey, ckpt: Checkpoint) -> None:
        self.ckpts[key] = ckpt
        while len(self.ckpts) > self.ckpt_capacity:
            old_key, old = self.ckpts.popitem(last=False)
            self.evictions += 1
            if self.host is not None:
                self.host.put_ckpt(old_key, old)

    def _peek(self, key: CkptKey) -> Checkpoint | None:
        ck = self.ckpts.get(key)
        if ck is None and self.host is not None:
            ck = self.host.peek_ckpt(key)
        return ck

    def take(self, key: CkptKey) -> Checkpoint:
        """The checkpoint for a hit, restored from the host tier when it lives there."""
        if key in self.ckpts:
            self.ckpts.move_to_end(key)
            return self.ckpts[key]
        assert self.host is not None
        ck = self.host.take_ckpt(key)
        self.restores += 1
        self.put(key, ck)
        return ck

    def _has_block(self, h: bytes) -> bool:
        return self.mla.has(h) or (self.host is not None and self.host.has_block(h))

    # ---- lookup -----------------------------------------------------------------------
    def match(self, tokens: list[int], cap: int) -> PrefixHit | None:
        """The longest usable hit at n <= cap (see module docstring), or None."""
        bs = self.block_size
        hashes: list[bytes] = []
        for j in range(len(tokens) // bs):
            h = block_hash(hashes[-1] if hashes else ROOT, tokens[j * bs:(j + 1) * bs])
            if not self._has_block(h):
                break
            hashes.append(h)
        k = len(hashes)
        for n in range(min(cap, k * bs + bs - 1), 0, -1):
            j, r = divmod(n, bs)
            key = self.key(tokens, hashes, n)
            ck = self._peek(key)
            if ck is None:
                continue
            if r == 0 or ck.tail is not None:
                return PrefixHit(n, hashes[:j], None, key)
            if j < k:                                 # tail rows from the cached full block j
                return PrefixHit(n, hashes[:j], hashes[j], key)
        return None

    def stats(self) -> dict[str, Any]:
        return {"checkpoints": len(self.ckpts), "evictions": self.evictions, "restores": self.restores}
