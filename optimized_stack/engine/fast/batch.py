"""Batch metadata for the fast decode step, built once per step on the host.

- the ladder: a batch of B rows runs padded to the next size of LADDER (the CUDA-graph sizes),
  eager or captured alike, so both run the same shapes; padding rows decode token PAD_TOKEN at
  position 0 from the pools' spare slot and spare block, never a request's;
- the block tables: one device tensor [slots + spare, P] indexed by KDA slot (a request's slot
  is fixed while it runs), rewritten only where a request's block list changed (admission,
  growth, a new request in a slot), so a step copies no table;
- the step's inputs: one [4, Bp] int64 tensor (token id, position, KDA slot, table slot per row)
  handed to the device in one copy.

Shape letters: B real rows, Bp padded rows, P max blocks per request.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PAD_TOKEN = 0
ROW_IDS, ROW_POS, ROW_KDA_SLOT, ROW_TABLE_SLOT = range(4)


def padded_size(n: int, ladder: tuple[int, ...] = LADDER) -> int:
    """The smallest ladder size >= n (past the ladder: the next power of two)."""
    if n < 1:
        raise ValueError(f"a decode batch needs at least one row, got {n}")
    for size in ladder:
        if size >= n:
            return size
    return 1 << (n - 1).bit_length()


class BlockTables:
    """Each KDA slot's block table on the device, kept in step with the requests' block lists."""

    def __init__(self, num_slots: int, spare_slot: int, max_blocks: int, spare_block: int, device):
        self.tables = torch.full((num_slots, max_blocks), spare_block, dtype=torch.int32, device=device)
        self.spare_slot, self.spare_block = spare_slot, spare_block
        self._seen: dict[int, tuple[list[int], int]] = {}    # slot -> (the block list object, its length)

    def sync(self, slot: int, blocks: list[int]) -> None:
        """Bring slot's row up to `blocks`. Block lists only grow by append while a request runs
        and are replaced by a new list on (re)admission, so (list identity, length) tells what
        changed; the list is kept referenced, so its identity cannot be reused meanwhile."""
        if len(blocks) > self.tables.shape[1]:
            raise ValueError(f"a request holds {len(blocks)} blocks, the tables have room for {self.tables.shape[1]}")
        seen = self._seen.get(slot)
        if seen is not None and seen[0] is blocks and seen[1] == len(blocks):
            return
        start = seen[1] if seen is not None and seen[0] is blocks and seen[1] < len(blocks) else 0
        if start < len(blocks):
            self.tables[slot, start:len(blocks)] = torch.tensor(blocks[start:], dtype=torch.int32)
        self._seen[slot] = (blocks, len(blocks))


@dataclass
class HostBatch:
    """One step's rows: meta [4, Bp] int64 on the host (pinned on CUDA), B real rows first."""

    meta: torch.Tensor
    num_real: int

    @property
    def size(self) -> int:
        return self.meta.shape[1]


def build_meta(ids: list[int], pos: list[int], slots: list[int], spare_slot: int, size: int,
               *, pin: bool, pad_shares_table: bool = False) -> HostBatch:
    """Real rows then padding rows. `pad_shares_table` is the seeded fault: padding rows read and
    write through the first request's block table instead of the spare slot's."""
    n = len(ids)
    pad = size - n
    pad_table = slots[0] if pad_shares_table else spare_slot
    rows = [ids + [PAD_TOKEN] * pad, pos + [0] * pad, slots + [spare_slot] * pad, slots + [pad_table] * pad]
    meta = torch.tensor(rows, dtype=torch.int64)
    if pin:
        meta = meta.pin_memory()
    return HostBatch(meta, n)
