"""Routed experts as three batched GEMMs over tokens grouped by expert (toggle moe_grouped).

Same contract as the op-table slot `moe_experts` (model/moe.py MoE.routed): (moe, h [T, De],
idx [T, k], w [T, k]) -> [T, De] fp32, and the combine in the reference's order.
Shape letters: T tokens, k experts per token, E experts, De expert input width, F expert width.
"""
from __future__ import annotations

import torch

from ...model.ops import situ, swiglu


def _stacked(experts, names: tuple[str, str, str]) -> tuple[torch.Tensor, ...]:
    """[E, F, D], [E, F, D], [E, D, F] stacks of the expert weights, rebuilt only when a
    weight changes (inference weights do not, so this is a one-time copy per layer)."""
    key = tuple((getattr(e, n).weight.data_ptr(), getattr(e, n).weight._version) for e in experts for n in names)
    cache = getattr(experts, "_k3_grouped_cache", None)
    if cache is None or cache[0] != key:
        stacks = tuple(torch.stack([getattr(e, n).weight for e in experts]) for n in names)
        cache = (key, stacks)
        object.__setattr__(experts, "_k3_grouped_cache", cache)
    return cache[1]


def routed_grouped(self, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, *,
                   _slot0_weight: bool = False) -> torch.Tensor:
    """MoE.routed as three batched GEMMs over [E, cap, De] groups (cap = the busiest expert's
    row count), then the combine in the reference's order: per row, ascending expert index,
    starting from zeros. h [T, De] -> [T, De] fp32."""
    n_tok, d_e = h.shape
    n_exp, top_k = len(self.experts), idx.shape[1]
    w1, w3, w2 = _stacked(self.experts, ("w1", "w3", "w2"))
    flat = idx.reshape(-1)                                            # [T*k] expert of each (row, slot)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_exp)                    # [E]
    starts = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    pos = torch.arange(flat.numel(), device=h.device) - starts[sorted_e]   # place inside its group
    cap = int(counts.max())                                           # one host sync per layer
    xs = h.new_zeros(n_exp, cap, d_e)
    xs[sorted_e, pos] = h[order // top_k]
    gate, up = torch.bmm(xs, w1.transpose(1, 2)), torch.bmm(xs, w3.transpose(1, 2))   # [E, cap, F]
    cfg = self.cfg
    act = situ(gate, up, cfg.situ_beta, cfg.situ_linear_beta) if cfg.activation == "situ" else swiglu(gate, up)
    out = torch.bmm(act, w2.transpose(1, 2)).float()                  # [E, cap, De]
    per_slot = torch.empty(flat.numel(), d_e, dtype=torch.float32, device=h.device)
    per_slot[order] = out[sorted_e, pos]
    per_slot = per_slot.view(n_tok, top_k, d_e)                       # [T, k, De]
    weight = w[:, :1].expand(-1, top_k) if _slot0_weight else w
    # the reference adds each row's experts in ascending expert index: visit slots that way
    slot_order = torch.argsort(idx, dim=1, stable=True)               # [T, k]
    y = torch.zeros(n_tok, d_e, dtype=torch.float32, device=h.device)
    for j in range(top_k):
        s = slot_order[:, j:j + 1]
        contrib = weight.gather(1, s) * per_slot.gather(1, s.unsqueeze(-1).expand(-1, 1, d_e)).squeeze(1)
        y = y + contrib
    return y
