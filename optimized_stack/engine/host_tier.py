"""Host tier: storage apart from the device pools for evicted MLA blocks, evicted KDA
checkpoints and the state of requests swapped out by preemption.

On CUDA an entry is copied into pinned host memory; on CPU it is a separate cloned
tensor (never a view of a device pool, so a pool block reused later cannot change it).
Cache entries are LRU-bounded by `capacity_tokens` (None: unbounded); swapped requests
are never dropped.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..events import Events

Rows = dict[int, torch.Tensor]


def to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cuda":
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t)
        return out
    return t.clone()


def rows_to_host(rows: Rows | None) -> Rows | None:
    return None if rows is None else {i: to_host(t) for i, t in rows.items()}


@dataclass
class HostBlock:
    rows: Rows                                   # layer -> [B, R]
    kv: Rows | None                              # layer -> [B, W] (projected_kv_cache)


@dataclass
class SwapEntry:
    """A preempted request's whole state: KDA snapshot and its MLA rows."""

    num_tokens: int
    kda: Any                                     # state_pool.Snapshot (host copies)
    rows: Rows                                   # layer -> [num_tokens, R]
    kv: Rows | None


class HostTier:
    def __init__(self, block_size: int, capacity_tokens: int | None, checkpoint_spacing: int,
                 events: Events | None = None, faults: frozenset[str] = frozenset()):
        self.block_size = block_size
        self.events = events if events is not None else Events()
        self.faults = faults
        self.max_blocks = None if capacity_tokens is None else capacity_tokens // block_size
        self.max_ckpts = None if capacity_tokens is None else max(1, capacity_tokens // checkpoint_spacing)
        self.blocks: OrderedDict[bytes, HostBlock] = OrderedDict()
        self.ckpts: OrderedDict[Any, Any] = OrderedDict()
        self.swapped: dict[str, SwapEntry] = {}
        self.dropped = 0

    # ---- cache entries ----------------------------------------------------------------
    def put_block(self, h: bytes, rows: Rows, kv: Rows | None) -> None:
        if h in self.blocks:
            self.blocks.move_to_end(h)
            return
        if "mut_host_block_aliases" in self.faults:     # the views of the device block, not copies
            self.blocks[h] = HostBlock(dict(rows), None if kv is None else dict(kv))
        else:
            self.blocks[h] = HostBlock(rows_to_host(rows), rows_to_host(kv))
        self.events.fire("host_put_block")
        while self.max_blocks is not None and len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)
            self.dropped += 1

    def has_block(self, h: bytes) -> bool:
        return h in self.blocks

    def get_block(self, h: bytes) -> HostBlock:
        self.events.fire("host_take_block")
        self.blocks.move_to_end(h)
        return self.blocks[h]

    def put_ckpt(self, key: Any, ckpt: Any) -> None:
        if key in self.ckpts:
            self.ckpts.move_to_end(key)
            return
        self.ckpts[key] = ckpt.map(to_host)
        if "mut_host_ckpt_drops_conv" in self.faults:
            for st in self.ckpts[key].kda.values():
                for t in (st.conv_q, st.conv_k, st.conv_v):
                    t.zero_()
        self.events.fire("host_put_ckpt")
        while self.max_ckpts is not None and len(self.ckpts) > self.max_ckpts:
            self.ckpts.popitem(last=False)
            self.dropped += 1

    def peek_ckpt(self, key: Any) -> Any | None:
        return self.ckpts.get(key)

    def take_ckpt(self, key: Any) -> Any:
        """The checkpoint, copied back for the device (the host keeps its copy)."""
        self.ckpts.move_to_end(key)
        self.events.fire("host_take_ckpt")
        ck = self.ckpts[key].map(lambda t: t.clone())
        if "mut_host_take_ckpt_bf16" in self.faults:     # the recurrent state comes back via bf16
            for st in ck.kda.values():
                st.recurrent = st.recurrent.to(torch.bfloat16).to(st.recurrent.dtype)
        return ck

    # ---- preemption by swap -----------------------------------------------------------
    def swap_out(self, request_id: str, entry: SwapEntry) -> None:
        self.swapped[request_id] = entry

    def swap_in(self, request_id: str) -> SwapEntry:
        return self.swapped.pop(request_id)
