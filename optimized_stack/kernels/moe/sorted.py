"""Routed experts for prefill with one host sync per layer (engine toggle prefill_sorted_experts).

Same contract as the op-table slot `moe_experts` (model/moe.py MoE.routed): (moe, h [T, De],
idx [T, k], w [T, k]) -> [T, De] fp32, bit-identical to it. Why it exists: on the H200 a prefill
step is host-bound, and the reference's expert loop is most of its launches (a k3-small prefill
forward: ~11,400 of the ~15,000 non-view ops are in MoE.routed, ~30 per expert per layer, plus a
`nonzero` per expert, each a device-to-host sync; golden/reports/gpu-2026-12-02-h200-engine/).

What each step keeps equal to the reference, so the bits cannot differ:
- rows: one stable sort of the (row, slot) pairs by expert lists each expert's rows in
  ascending row order, the order `(idx == e).nonzero()` gives; the group sizes come to the host
  once (`tolist`), the only sync;
- GEMM inputs: each expert's rows are gathered into a fresh tensor (`index_select`, as the
  reference's `h[rows]`) and its activation rows cloned into one, so every OPS.linear call has the
  reference's shape, strides and a fresh allocation's alignment (cuBLAS and MKL may pick kernels
  by pointer alignment; a view at an offset could differ);
- the activation runs once over all groups' gate/up rows: it is elementwise, so an element's bits
  are its own (on the CPU model/ops.py keeps every element on the SIMD path whatever the size);
  with the engine option fused_situ, as one Triton launch on CUDA (`_situ`, kernels/moe/situ_form.py);
- the combine is the reference's: per row, from zeros, w * out added in ascending expert index.
Per active expert 5 launches (gather, three GEMMs, the clone) instead of ~30; per layer ~40 more.

`_weights_unsorted` is the seeded fault mut_sorted_experts_weights_unsorted: the routing weights
taken in (row, slot) order while the outputs are in expert order (the permutation forgotten once).
Shape letters: T tokens, k experts per token, E experts, De expert input width, F expert width.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...model.ops import OPS, situ, swiglu


def routed_sorted(moe, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, *,
                  _weights_unsorted: bool = False, _situ: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """MoE.routed with the experts' rows from one sort (module docstring). h [T, De] -> [T, De] fp32.
    `_situ`: the activation in model/ops.py situ's place (None: situ itself)."""
    n_tok, d_e = h.shape
    top_k = idx.shape[1]
    flat = idx.reshape(-1)                                            # [T*k] expert of each (row, slot)
    order = torch.argsort(flat, stable=True)                          # (row, slot) pairs by expert, rows ascending
    counts = torch.bincount(flat, minlength=len(moe.experts)).tolist()   # the one host sync
    rows = order // top_k                                             # [T*k] the row of each sorted pair
    bounds, start = [], 0
    for n in counts:
        bounds.append((start, start + n))
        start += n
    active = [(e, a, b) for e, (a, b) in enumerate(bounds) if b > a]   # ascending expert index
    lin, cfg = OPS.linear, moe.cfg
    xs = [h.index_select(0, rows[a:b]) for _, a, b in active]         # fresh [n_e, De], as h[rows]
    gate = torch.cat([lin(x, moe.experts[e].w1.weight) for (e, _, _), x in zip(active, xs)])   # [T*k, F]
    up = torch.cat([lin(x, moe.experts[e].w3.weight) for (e, _, _), x in zip(active, xs)])
    act = ((_situ or situ)(gate, up, cfg.situ_beta, cfg.situ_linear_beta) if cfg.activation == "situ"
           else swiglu(gate, up))
    out = torch.cat([lin(act[a:b].clone(), moe.experts[e].w2.weight) for e, a, b in active]).float()   # [T*k, De]
    w_sorted = w.reshape(-1) if _weights_unsorted else w.reshape(-1)[order]
    contrib = torch.empty(n_tok * top_k, d_e, dtype=torch.float32, device=h.device)
    contrib[order] = w_sorted.unsqueeze(-1) * out                     # back to (row, slot) order
    contrib = contrib.view(n_tok, top_k, d_e)
    by_expert = torch.sort(idx, dim=1, stable=True).indices           # [T, k] each row's slots, ascending expert
    y = torch.zeros(n_tok, d_e, dtype=torch.float32, device=h.device)
    for j in range(top_k):
        s = by_expert[:, j].view(n_tok, 1, 1).expand(-1, 1, d_e)
        y = y + contrib.gather(1, s).squeeze(1)
    return y


def routed_sorted_weights_unsorted(moe, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, *,
                                   _situ: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """The seeded fault mut_sorted_experts_weights_unsorted (module docstring)."""
    return routed_sorted(moe, h, idx, w, _weights_unsorted=True, _situ=_situ)
