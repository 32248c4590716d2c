"""One KDA decode token for B requests at once, over the engine's KDA state pool in place.

The reference (model/kda.py KDAttention.forward, one request, T = 1): projections, the causal
conv against the request's window, SiLU, l2 norms, the gates, one step of the recurrence from the
request's state, the output norm / gate / o_proj. Here every token-wise op runs on the B rows (the
reference's own primitives, row-invariant), and the two per-request pieces run batched:

- conv: windows [B, W-1, C] gathered from the pool by slot, the same taps in the same order
  (elementwise, so a row's bits are its own), the new windows written back by slot;
- recurrence: CPU, kda_recurrent's four steps over [B, H, K, V] (the same elementwise ops and the
  same K-axis reductions per request: bitwise equal, tests/test_fast_parts.py); CUDA, fla's
  fused_recurrent_kda_fwd with initial_state = the pool, ssm_state_indices = slots and
  inplace_final_state (one launch, no copies; the reference decode runs the same kernel body one
  request at a time). `K3_FAST_KDA=gather` runs the reference's own specialisation instead
  (states gathered, final states out, scattered back): the fallback if the in-place
  specialisation ever differs on a GPU (tests/test_fast_gpu.py compares both).
A KDA decode op in the op table (a kernel toggle or a mutant) is honoured in its rows form where
ROW_FORMS has one (fla's kernels over B sequences of one token: one call, not B), else one request
at a time. Either way the step is not captured (capturable() in decode_step.py).

Padding rows point at the pool's spare slot, never at a request's.
Shape letters: B rows, H heads, K key dim, V value dim, C = H*K, W conv taps, P pool slots.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from ...errors import K3Error
from ...model import ops
from ...model.kda import KDAState, KDAttention, kda_scan
from ...model.ops import OPS, exp, l2_norm, silu
from ...kernels.kda import fla
from ...toggles import base_form, count_call

FAST_KDA_ENV = "K3_FAST_KDA"
FAST_KDA_CHOICES = ("inplace", "gather")

# a kernel toggle's KDA decode op (OPS.kda_decode) -> the same kernel over the B rows in one call:
# (q, k, g [B, H, K], v [B, H, V], beta [B, H], states [B, H, K, V]) -> (o [B, H, V], finals).
# A mutant's op (a functools.partial of a form) has none and runs one request at a time.
ROW_FORMS: dict[Callable, Callable] = {fla.fla_chunk: fla.fla_chunk_rows, fla.fla_recurrent: fla.fla_recurrent_rows}


def fast_kda_choice() -> str:
    value = os.environ.get(FAST_KDA_ENV, "inplace").strip().lower() or "inplace"
    if value not in FAST_KDA_CHOICES:
        raise K3Error(f"{FAST_KDA_ENV} must be one of {', '.join(FAST_KDA_CHOICES)}, got {value!r}")
    return value


def conv_step(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
              *, wrong_row: bool = False) -> torch.Tensor:
    """model/kda.py causal_conv for one token of B requests: x [B, C], pool [P, W-1, C] (updated
    in place at `slots` [B]), weight [C, 1, W] -> y [B, C]. `wrong_row` is the seeded fault
    (request i's window gets request i+1's input)."""
    taps = weight.shape[-1]
    xs = torch.cat([pool.index_select(0, slots).to(x.dtype), x.unsqueeze(1)], 1)   # [B, W, C]
    y = xs[:, 0] * weight[:, 0, 0]
    for j in range(1, taps):                                                        # fixed tap order
        y = y + xs[:, j] * weight[:, 0, j]
    new = xs[:, 1:]
    if wrong_row:
        new = torch.cat([new[:, :-1], x.roll(-1, 0).unsqueeze(1)], 1)
    pool.index_copy_(0, slots, new.to(pool.dtype))
    return y


# The value axis runs in 64-wide tiles, as fla's fused_recurrent_kda runs one program per value
# tile on the GPU: a tile's working set is [B, H, K, 64] whatever V is. Every value column's
# recurrence is its own (its reductions run over K), so tiles give the untiled bits
# (tests/test_fast_parts.py). A value head of <= 64 (k3-mini's 16) is one tile: the code for the
# tiles after the first runs only at K3's dims (v 128), which is why exact verdicts run there too.
V_TILE = 64


def value_tiles(v_dim: int) -> int:
    return -(-v_dim // V_TILE)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kda_recurrent for one token of B requests: q, k, g [B, H, K], v [B, H, V], beta [B, H],
    state [B, H, K, V] fp32 -> (o [B, H, V] fp32, new state [B, H, K, V] fp32), V in V_TILE tiles."""
    v_dim = v.shape[-1]
    if v_dim <= V_TILE:
        return _recurrent_tile(q, k, v, g, beta, state)
    tiles = [_recurrent_tile(q, k, v[..., a:a + V_TILE], g, beta, state[..., a:a + V_TILE])
             for a in range(0, v_dim, V_TILE)]
    return torch.cat([o for o, _ in tiles], -1), torch.cat([st for _, st in tiles], -1)


def _recurrent_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One value tile: v [B, H, Vt], state [B, H, K, Vt] -> (o [B, H, Vt], state [B, H, K, Vt])."""
    q, k, v, g, beta = q.float(), k.float(), v.float(), g.float(), beta.float()
    state = state.float() * exp(g).unsqueeze(-1)                      # decay first
    kv = (state * k.unsqueeze(-1)).sum(2)                             # S^T k   [B, H, V]
    u = beta.unsqueeze(-1) * (v - kv)
    state = state + k.unsqueeze(-1) * u.unsqueeze(2)                  # k (outer) u
    return (state * q.unsqueeze(-1)).sum(2), state                    # S^T q


def _fla_inplace(q, k, v, g, beta, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    o, _ = fused_recurrent_kda_fwd(
        q=q.unsqueeze(1).contiguous(), k=k.unsqueeze(1).contiguous(), v=v.float().unsqueeze(1).contiguous(),
        g=g.float().unsqueeze(1).contiguous(), beta=beta.float().unsqueeze(1).contiguous(), scale=1.0,
        initial_state=pool, inplace_final_state=True, ssm_state_indices=slots)
    return o[:, 0].float()                                            # [B, H, V]


def _fla_gather(q, k, v, g, beta, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    o, final = fused_recurrent_kda_fwd(
        q=q.unsqueeze(1).contiguous(), k=k.unsqueeze(1).contiguous(), v=v.float().unsqueeze(1).contiguous(),
        g=g.float().unsqueeze(1).contiguous(), beta=beta.float().unsqueeze(1).contiguous(), scale=1.0,
        initial_state=pool.index_select(0, slots), output_final_state=True, inplace_final_state=False)
    pool.index_copy_(0, slots, final)
    return o[:, 0].float()


def _batched_reference(x: torch.Tensor) -> bool:
    """Whether the reference decode op in force is the one the batched forms reproduce: the CPU
    recurrence, or on CUDA the invariant profile's fused_recurrent_kda (not K3_GPU_PROFILE=torch)."""
    if OPS.kda_decode is not None:
        return False
    if not x.is_cuda:
        return True
    from ...kernels import gpu_reference
    return ops.gpu_reference() is gpu_reference


def _conv(fused: bool | str, wrong_row: bool):
    """The conv form in force: conv_step, or (fused_kda_conv) the Triton kernel, "stale_window"
    being its seeded fault."""
    if not fused:
        return lambda x, pool, slots, weight: conv_step(x, pool, slots, weight, wrong_row=wrong_row)
    from ...kernels.kda.conv_step import fused_conv_step
    return lambda x, pool, slots, weight: fused_conv_step(x, pool, slots, weight,
                                                          stale_window=fused == "stale_window")


def kda_decode(layer: KDAttention, x: torch.Tensor, pools: dict[str, torch.Tensor], slots: torch.Tensor,
               *, conv_wrong_row: bool = False, stale_value_tiles: bool = False,
               fused_conv: bool | str = False) -> torch.Tensor:
    """KDAttention.forward for one token of each of B requests: x [B, D] -> [B, D]; the request
    states live in `pools` (recurrent [P, H, K, V] fp32, conv_q/k/v [P, W-1, C]) at `slots` [B]
    and are advanced in place. `stale_value_tiles` is the seeded fault mut_fast_kda_stale_value_tiles
    (the value tiles after the first are not written back: inert while V <= V_TILE); `fused_conv`
    runs the three convs as Triton launches (fused_kda_conv; "stale_window": its seeded fault)."""
    cfg = layer.cfg
    h, kd = cfg.kda_num_heads, cfg.kda_head_dim
    lin = OPS.linear
    conv = _conv(fused_conv, conv_wrong_row)
    q = conv(lin(x, layer.q_proj.weight), pools["conv_q"], slots, layer.q_conv1d.weight)
    k = conv(lin(x, layer.k_proj.weight), pools["conv_k"], slots, layer.k_conv1d.weight)
    v = conv(lin(x, layer.v_proj.weight), pools["conv_v"], slots, layer.v_conv1d.weight)
    q = silu(q).view(-1, h, kd)
    k = silu(k).view(-1, h, kd)
    v = silu(v).view(-1, h, kd)
    q = l2_norm(q.float()) * kd ** -0.5
    k = l2_norm(k.float())
    v = v.float()
    g, beta = layer.gates(x)
    pool = pools["recurrent"]
    # the seeded fault keeps the old state of every value tile after the first
    stale = pool.index_select(0, slots)[..., V_TILE:].clone() if stale_value_tiles else None
    if not _batched_reference(x):
        o = _one_by_one(q, k, v, g, beta, pool, slots)
    elif x.is_cuda:
        o = (_fla_inplace if fast_kda_choice() == "inplace" else _fla_gather)(q, k, v, g, beta, pool, slots)
    else:
        o, new = recurrent_step(q, k, v, g, beta, pool.index_select(0, slots))
        pool.index_copy_(0, slots, new)
    if stale is not None and stale.numel():
        pool[slots, ..., V_TILE:] = stale
    return layer.output(x, o)


def _one_by_one(q, k, v, g, beta, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The decode op in force (a toggle's kernel, or the torch profile's): its rows form over the
    B rows in one call where it has one (counted as one call of the slot), else one request at a
    time, correct whatever the op (reads the slots on the host)."""
    rows = ROW_FORMS.get(base_form(OPS.kda_decode))          # the slot holds a counting wrapper
    if rows is not None:
        count_call(OPS.kda_decode)
        o, finals = rows(q, k, v, g, beta, pool.index_select(0, slots))
        pool.index_copy_(0, slots, finals)
        return o
    scan = OPS.kda_decode or kda_scan
    outs = []
    for b, slot in enumerate(slots.tolist()):
        o, st = scan(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], pool[slot])
        pool[slot].copy_(st)
        outs.append(o)
    return torch.cat(outs)


__all__ = ["KDAState", "ROW_FORMS", "V_TILE", "conv_step", "kda_decode", "recurrent_step", "fast_kda_choice", "value_tiles"]
