"""Routed experts with static shapes: every expert's GEMMs on a fixed-capacity padded buffer.

Same contract as the op-table slot `moe_experts` (model/moe.py MoE.routed): (moe, h [T, De],
idx [T, k], w [T, k]) -> [T, De] fp32. The reference runs each expert on exactly the rows that
chose it (`nonzero`: a host sync and a data-dependent shape). Here each expert's rows are placed
into its own [T, De] buffer (capacity T: no expert can get more rows than there are tokens),
the rest of the buffer zeros, and the expert's GEMMs run on the whole buffer:

- the GEMMs are the reference's own (OPS.linear, row-invariant: CPU fixed tiles, cuBLAS bf16 on
  the GPU profile), so a real row's bits equal the reference's per-expert GEMM on its rows;
- the activation runs once over [E, T, F] (elementwise: an element's bits are its own), as torch
  ops or, with the engine option fused_situ, as one Triton launch (`_situ`, kernels/moe/situ.py);
- the combine is the reference's: per row, starting from zeros, add w * out in ascending
  expert index.
No host sync, no data-dependent shape: capturable in a CUDA graph. Cost: E * T rows per GEMM
instead of T * k (decode is bound by reading the expert weights, which both forms read once).

`routed_static_grouped` is the same placement with the three GEMMs as one batched matmul each
over [E, T, De] (torch.bmm): fewer launches, but not the reference's GEMM, so approx.
Shape letters: T tokens, k experts per token, E experts, De expert input width, F expert width.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...model.ops import OPS, situ, swiglu

Act = Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]


def placement(idx: torch.Tensor, n_exp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """idx [T, k] -> (expert [T*k], position inside that expert's buffer [T*k]): the rank of the
    (row, slot) among those choosing the same expert, in row order (as `nonzero` lists them).

    The running count is a scan along the contiguous dim of an [E, T*k] one-hot. Integer counts
    are exact in any order, so this is the same result as a scan down the [T*k, E] one-hot's
    rows; but that scan was CUDA's outer-dim kernel: 45 us a call at B=64 and 190 us at B=256 on
    the H200, 9% and 20% of the eager step's device time (golden/reports/gpu-2026-12-01-h200-engine
    /step_kernels.txt: 12 calls a step, one per MoE layer)."""
    flat = idx.reshape(-1)                                                    # [T*k]
    onehot = torch.arange(n_exp, device=idx.device).unsqueeze(1) == flat.unsqueeze(0)   # [E, T*k]
    seen = onehot.to(torch.int32).cumsum(1, dtype=torch.int32)                 # choosers so far, self included
    slots = torch.arange(flat.shape[0], device=idx.device)
    return flat, (seen[flat, slots] - 1).long()


def _act(cfg, gate: torch.Tensor, up: torch.Tensor, situ_form: Act | None = None) -> torch.Tensor:
    """The experts' GLU activation; `situ_form` replaces model/ops.py situ (None: situ itself)."""
    if cfg.activation != "situ":
        return swiglu(gate, up)
    return (situ_form or situ)(gate, up, cfg.situ_beta, cfg.situ_linear_beta)


def _combine(out: torch.Tensor, flat: torch.Tensor, pos: torch.Tensor, idx: torch.Tensor,
             w: torch.Tensor, drop_last: bool = False) -> torch.Tensor:
    """out [E, T, De] fp32 -> y [T, De]: per row, zeros + w * out in ascending expert index.
    `drop_last` is a seeded fault (the row's highest expert is left out)."""
    n_tok, top_k = idx.shape
    contrib = w.reshape(-1).unsqueeze(-1) * out[flat, pos]                    # [T*k, De]
    contrib = contrib.view(n_tok, top_k, -1)
    order = torch.sort(idx, dim=1, stable=True).indices                       # slots by expert id
    y = torch.zeros(n_tok, out.shape[-1], dtype=torch.float32, device=out.device)
    for j in range(top_k - 1 if drop_last else top_k):
        s = order[:, j].view(n_tok, 1, 1).expand(-1, 1, out.shape[-1])
        y = y + contrib.gather(1, s).squeeze(1)
    return y


def _dispatch(h: torch.Tensor, flat: torch.Tensor, pos: torch.Tensor, n_exp: int, top_k: int) -> torch.Tensor:
    xs = h.new_zeros(n_exp, h.shape[0], h.shape[1])                          # [E, T, De]
    xs[flat, pos] = h.repeat_interleave(top_k, 0)
    return xs


def routed_static(moe, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, *,
                  _fused_combine: bool | str = False, _situ: Act | None = None) -> torch.Tensor:
    """MoE.routed on static shapes (module docstring). h [T, De] -> [T, De] fp32.
    `_fused_combine` (routed_static_fused) combines in one Triton launch; "slot_order" and
    "drop_last" are its seeded faults. `_situ`: the activation in situ's place (fused_situ's
    kernels/moe/situ_form.py; None: model/ops.py situ)."""
    experts = moe.experts
    n_exp, top_k = len(experts), idx.shape[1]
    flat, pos = placement(idx, n_exp)
    xs = _dispatch(h, flat, pos, n_exp, top_k)
    lin = OPS.linear
    gate = torch.stack([lin(xs[e], ex.w1.weight) for e, ex in enumerate(experts)])    # [E, T, F]
    up = torch.stack([lin(xs[e], ex.w3.weight) for e, ex in enumerate(experts)])
    act = _act(moe.cfg, gate, up, _situ)
    out = torch.stack([lin(act[e], ex.w2.weight) for e, ex in enumerate(experts)]).float()   # [E, T, De]
    if _fused_combine:
        from ...kernels.moe.combine import fused_combine
        return fused_combine(out, pos, idx, w, slot_order=_fused_combine == "slot_order",
                             drop_last=_fused_combine == "drop_last")
    return _combine(out, flat, pos, idx, w)


def routed_static_fused(moe, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, *,
                        _situ: Act | None = None) -> torch.Tensor:
    """routed_static with the combine as one Triton launch (fused_moe_combine: bit-identical,
    kernels/moe/combine.py)."""
    return routed_static(moe, h, idx, w, _fused_combine=True, _situ=_situ)


def routed_static_fused_slot_order(moe, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, *,
                                   _situ: Act | None = None) -> torch.Tensor:
    """The seeded fault mut_fused_combine_slot_order: the fused combine adds in slot order."""
    return routed_static(moe, h, idx, w, _fused_combine="slot_order", _situ=_situ)


def routed_static_fused_drop_last(moe, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, *,
                                  _situ: Act | None = None) -> torch.Tensor:
    """The seeded fault mut_fused_combine_drops_last: each row's highest expert left out."""
    return routed_static(moe, h, idx, w, _fused_combine="drop_last", _situ=_situ)


def routed_static_grouped(moe, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, *,
                          _drop_last: bool = False) -> torch.Tensor:
    """The same placement and combine, the GEMMs as torch.bmm over [E, T, .] (approx: not the
    reference's GEMM kernel). `_drop_last` only for the mutant."""
    from ...kernels.moe.grouped import _stacked
    n_exp, top_k = len(moe.experts), idx.shape[1]
    w1, w3, w2 = _stacked(moe.experts, ("w1", "w3", "w2"))                   # [E, F, De] x2, [E, De, F]
    flat, pos = placement(idx, n_exp)
    xs = _dispatch(h, flat, pos, n_exp, top_k)
    gate, up = torch.bmm(xs, w1.transpose(1, 2)), torch.bmm(xs, w3.transpose(1, 2))
    out = torch.bmm(_act(moe.cfg, gate, up), w2.transpose(1, 2)).float()
    return _combine(out, flat, pos, idx, w, drop_last=_drop_last)
