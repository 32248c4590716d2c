"""The CUDA implementations behind kernels/cuda_toggle_defs.py.

Op-table forms take the reference's arguments (model/ops.py): kda_prefill(q, k, v, g, beta,
initial_state) with q, k, g [T, H, K], v [T, H, V], beta [T, H], state [H, K, V] fp32, and
return (o [T, H, V] fp32, final state [H, K, V] fp32). MoE forms replace MoE.routed /
MoE.forward and keep their signatures. Leading underscore arguments switch in the mutants.
"""
from __future__ import annotations

import torch

from ..model.ops import situ, swiglu


def _state_in(state: torch.Tensor | None, transpose: bool) -> torch.Tensor | None:
    if state is None:
        return None
    s = state.float()
    if transpose:
        s = s.transpose(-1, -2)
    return s.unsqueeze(0).contiguous()


def fla_chunk(q, k, v, g, beta, initial_state=None, *, _drop_state: bool = False):
    """fla-core chunk_kda (chunks of 64 tokens; a T < 64 call is one padded chunk)."""
    from fla.ops.kda import chunk_kda
    init = None if _drop_state else _state_in(initial_state, False)
    o, final = chunk_kda(q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0),
                         g=g.float().unsqueeze(0), beta=beta.float().unsqueeze(0), scale=1.0,
                         initial_state=init, output_final_state=True)
    return o[0].float(), final[0].float()


def fla_recurrent(q, k, v, g, beta, initial_state=None, *, _transpose_state: bool = False):
    """fla-core fused_recurrent_kda: the whole call in one kernel, state in registers."""
    from fla.ops.kda import fused_recurrent_kda
    if initial_state is None:
        initial_state = q.new_zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float32)
    o, final = fused_recurrent_kda(q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0),
                                   g=g.float().unsqueeze(0), beta=beta.float().unsqueeze(0), scale=1.0,
                                   initial_state=_state_in(initial_state, _transpose_state),
                                   output_final_state=True)
    final = final[0].float()
    if _transpose_state:
        final = final.transpose(-1, -2).contiguous()
    return o[0].float(), final


# ---- grouped experts ----------------------------------------------------------------------
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


# ---- shared expert on a side stream ------------------------------------------------------
_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def moe_forward_side_stream(self, x: torch.Tensor, *, _tf32: bool = False) -> torch.Tensor:
    """MoE.forward with the shared expert on a second stream. The same ops on the same
    shapes as the reference, only overlapped: the side stream waits for x, the main stream
    waits for the shared output before the add, and the allocator is told the tensor is
    used on the main stream (record_stream) so its memory is not handed out early."""
    if not x.is_cuda or not self.cfg.num_shared_experts:
        y = self.routed_part(x)
        return y + self.shared_experts(x) if self.cfg.num_shared_experts else y
    main = torch.cuda.current_stream(x.device)
    side = _SIDE.setdefault(x.device, torch.cuda.Stream(x.device))
    side.wait_stream(main)
    with torch.cuda.stream(side):
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = _tf32 or saved
        try:
            shared = self.shared_experts(x)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved
    y = self.routed_part(x)
    main.wait_stream(side)
    shared.record_stream(main)
    return y + shared
