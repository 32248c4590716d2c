"""KDA state pool: a fixed number of slots, each holding one request's state for every KDA
layer (recurrent [H, K, V] fp32 and the three conv windows [W-1, H*K]).

Slots are read as views for a forward and written back by copy: the model replaces the
state tensors of a KDAState (it never writes the inputs in place), so the copy is the only
write and it is exact.
"""
from __future__ import annotations

import torch

from ..model.kda import KDAState

Snapshot = dict[int, KDAState]                 # KDA layer -> state (owned copies)


class KDAStatePool:
    def __init__(self, protos: dict[int, KDAState], slots: int, spare: int = 0):
        """`spare` extra slots past the last real one are never handed out: a batched decode
        step (engine/fast) points its padding rows at them, so padding never touches a request."""
        self.slots = slots
        self.spare = spare
        self.layers = list(protos)
        self.pools = {i: {name: torch.zeros((slots + spare,) + tuple(t.shape), dtype=t.dtype, device=t.device)
                          for name, t in st.tensors().items()}
                      for i, st in protos.items()}                 # layer -> name -> [slots + spare, ...]
        self.free = list(range(slots))

    def num_free(self) -> int:
        return len(self.free)

    def acquire(self) -> int | None:
        """A zeroed slot (a fresh request's state), or None when the pool is full."""
        if not self.free:
            return None
        slot = self.free.pop(0)
        for tensors in self.pools.values():
            for t in tensors.values():
                t[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        assert slot not in self.free, f"KDA slot {slot} released twice"
        self.free.append(slot)
        self.free.sort()

    def view(self, slot: int) -> Snapshot:
        return {i: KDAState(p["recurrent"][slot], p["conv_q"][slot], p["conv_k"][slot], p["conv_v"][slot])
                for i, p in self.pools.items()}

    def gather(self, slots: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        """Copies of the slots' state, stacked: layer -> name -> [len(slots), ...], row i slot
        slots[i]. One index_select per layer and tensor (an observer's batched call: per request
        views and a stack were B x layers x 4 indexing ops a step)."""
        device = next(iter(next(iter(self.pools.values())).values())).device
        index = torch.tensor(slots, dtype=torch.long, device=device)
        return {i: {name: t.index_select(0, index) for name, t in p.items()} for i, p in self.pools.items()}

    def store(self, slot: int, states: Snapshot) -> None:
        for i, st in states.items():
            for name, t in st.tensors().items():
                dst = self.pools[i][name][slot]
                if t.data_ptr() != dst.data_ptr():
                    dst.copy_(t)

    def snapshot(self, slot: int) -> Snapshot:
        return {i: st.clone() for i, st in self.view(slot).items()}

    def load(self, slot: int, snap: Snapshot, skip_conv: bool = False) -> None:
        """Copy a snapshot into a slot. skip_conv is the seeded fault that forgets the conv
        windows (they stay as the slot had them)."""
        for i, st in snap.items():
            self.pools[i]["recurrent"][slot].copy_(st.recurrent)
            if not skip_conv:
                for name in ("conv_q", "conv_k", "conv_v"):
                    self.pools[i][name][slot].copy_(getattr(st, name))

    def zero_conv(self, slot: int) -> None:
        for p in self.pools.values():
            for name in ("conv_q", "conv_k", "conv_v"):
                p[name][slot].zero_()
