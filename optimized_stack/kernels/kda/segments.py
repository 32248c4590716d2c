"""KDA for every segment of a forward_batch at once (engine toggle prefill_batched_mixers).

Same contract as the op-table slot `kda_segments`: (attn, layer index, x [T, D], bounds [(a, b)],
states [KDAState]) -> [T, D], each segment's rows and state bit-identical to
`attn(x[a:b], state)` (model/model.py _mixer's per-segment call). Why it exists: the reference runs
every KDA layer once per segment, ~45 launches each (8 GEMMs, the convs, the gate and norm math),
so a forward over n prompts costs n x that per layer; on the GPU a prefill step is host-bound
(NOTES.md 2026-12-02: the device idle 87-92% of a prefill step), and the agentic and GSM8K
workloads prefill many requests a step.

What each piece keeps equal to the per-segment call:
- projections, gates, norms, SiLU and the output on all T rows at once: every one is row-invariant
  (a row's bits are its own: model/ops.py; on CUDA the GPU profile), so a row computed beside other
  segments' rows has the bits it has alone;
- the causal conv (`conv_segments`): one sequence [window_1; x_1; window_2; x_2; ...], the taps
  multiplied and added in the reference's order on it, and each segment's outputs and new window
  read at its own rows: the same elementwise operations on the same operands per output row;
- the recurrence per segment, through the op slot the per-segment call would take (kda_prefill
  for T > 1, kda_decode for T = 1), on the segment's rows of q, k, v, g, beta.

`_windows_from_next` is the seeded fault mut_batched_mixers_window_from_next: segment i keeps the
new conv window of segment i+1 (a misplaced offset in the window gather).
Shape letters: T rows of all segments, D hidden, H heads, K key dim, C = H*K, W conv taps, n segments.
"""
from __future__ import annotations

import torch

from ...model import ops
from ...model.kda import KDAState, KDAttention, kda_scan
from ...model.ops import OPS, l2_norm, silu


def segment_rows(bounds: list[tuple[int, int]], w1: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where conv_segments reads in the joined sequence [window_1; x_1; window_2; x_2; ...] (windows of
    w1 rows): the output rows [T] (row r's taps are rows r .. r+w1) and each segment's last w1 rows
    [n*w1] (its new window). The same for a layer's three convs: built once a call."""
    out_rows, tails, at = [], [], 0
    for a, b in bounds:
        out_rows.append(torch.arange(at, at + b - a))
        at += w1 + b - a
        tails.append(torch.arange(at - w1, at))
    return torch.cat(out_rows).to(device), torch.cat(tails).to(device)


def conv_segments(x: torch.Tensor, bounds: list[tuple[int, int]], windows: list[torch.Tensor],
                  weight: torch.Tensor, *, rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                  _windows_from_next: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """model/kda.py causal_conv for n segments at once: x [T, C] (segment i's rows bounds[i]),
    windows n x [W-1, C], weight [C, 1, W] -> (y [T, C], the n new windows [W-1, C]). `rows`:
    segment_rows' indices, when the caller has them."""
    taps = weight.shape[-1]
    w1 = taps - 1
    out_rows, tail = rows if rows is not None else segment_rows(bounds, w1, x.device)
    pieces = []
    for (a, b), win in zip(bounds, windows):
        pieces += [win.to(x.dtype), x[a:b]]                          # [W-1 + T_i, C] per segment
    xs = torch.cat(pieces, 0)                                         # [n(W-1) + T, C]
    length = xs.shape[0] - w1
    y = xs[0:length] * weight[:, 0, 0]
    for j in range(1, taps):                                          # the reference's tap order
        y = y + xs[j:j + length] * weight[:, 0, j]
    y = y.index_select(0, out_rows)                                   # [T, C]
    new = xs.index_select(0, tail).view(len(bounds), w1, -1)          # [n, W-1, C]
    if _windows_from_next:
        new = new.roll(-1, 0)
    return y, list(new.unbind(0))


def kda_segments(attn: KDAttention, layer_index: int, x: torch.Tensor, bounds: list[tuple[int, int]],
                 states: list[KDAState], *, _windows_from_next: bool = False) -> torch.Tensor:
    """KDAttention.forward for every segment (module docstring): x [T, D] -> [T, D]; each segment's
    state (recurrent and conv windows) advanced as its own call would."""
    cfg, lin = attn.cfg, OPS.linear
    h, kd = cfg.kda_num_heads, cfg.kda_head_dim
    convs = {}
    rows = segment_rows(bounds, attn.q_conv1d.weight.shape[-1] - 1, x.device)
    for name, proj, conv in (("conv_q", attn.q_proj, attn.q_conv1d), ("conv_k", attn.k_proj, attn.k_conv1d),
                             ("conv_v", attn.v_proj, attn.v_conv1d)):
        convs[name], windows = conv_segments(lin(x, proj.weight), bounds, [getattr(st, name) for st in states],
                                             conv.weight, rows=rows, _windows_from_next=_windows_from_next)
        for st, win in zip(states, windows):
            setattr(st, name, win)
    q = silu(convs["conv_q"]).view(-1, h, kd)
    k = silu(convs["conv_k"]).view(-1, h, kd)
    v = silu(convs["conv_v"]).view(-1, h, kd)
    q = l2_norm(q.float()) * kd ** -0.5
    k = l2_norm(k.float())
    v = v.float()
    g, beta = attn.gates(x)
    outs = []
    for (a, b), st in zip(bounds, states):
        scan = (OPS.kda_decode if b - a == 1 else OPS.kda_prefill) or kda_scan
        if x.is_cuda:
            with ops.gpu_reference().kda_activations(x.dtype):
                o, st.recurrent = scan(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], st.recurrent)
        else:
            o, st.recurrent = scan(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], st.recurrent)
        outs.append(o)
    return attn.output(x, torch.cat(outs))
