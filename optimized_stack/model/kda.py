"""KDA (Kimi Delta Attention): the reference recurrence, one token at a time, fp32 state.

Shape letters: T tokens, H heads, K key dim (= head_dim), V value dim (= K), D hidden.

Per token t and head h (k3-architecture.md):
    S = S * exp(g_t)[:, None]        # 1. decay first, per key channel     S [K, V]
    u = beta_t * (v_t - S^T k_t)     # 2. delta against the decayed state
    S = S + k_t (outer) u            # 3. write
    o_t = S^T q_t                    # 4. read after the write
Every reduction is an explicit multiply + sum over a fixed-length axis, so the bits of
one token's update do not depend on how many tokens or requests share the call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import K3Config
from . import ops
from .ops import OPS, exp, l2_norm, rms_norm, sigmoid, silu, softplus


@dataclass
class KDAState:
    """Per request, per KDA layer. recurrent [H, K, V] fp32; conv windows [W-1, H*K] each."""

    recurrent: torch.Tensor
    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor

    def clone(self) -> "KDAState":
        return KDAState(self.recurrent.clone(), self.conv_q.clone(), self.conv_k.clone(),
                        self.conv_v.clone())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"recurrent": self.recurrent, "conv_q": self.conv_q, "conv_k": self.conv_k,
                "conv_v": self.conv_v}


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential KDA recurrence.

    q, k, g: [T, H, K] (q already l2-normed and scaled, k l2-normed, g the log-decay <= 0);
    v: [T, H, V]; beta: [T, H]; initial_state: [H, K, V] or None (zeros).
    Returns o [T, H, V] fp32 and the final state [H, K, V] fp32 (the input is not modified).
    """
    # One loop for the reference and for speculative tracing, so they cannot drift apart.
    out, state, _ = kda_recurrent_trace(q, k, v, g, beta, initial_state)
    return out, state


def kda_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference sequence op (a None kda_prefill / kda_decode slot): the recurrence above
    on the CPU; on CUDA the GPU profile's fla kernels, chunk_kda on the leading 64-aligned part
    and fused_recurrent_kda for the tail and for decode (kernels/gpu_reference.py kda_scan).
    Same arguments and results as kda_recurrent."""
    if q.is_cuda:
        return ops.gpu_reference().kda_scan(q, k, v, g, beta, initial_state)
    return kda_recurrent(q, k, v, g, beta, initial_state)


@dataclass
class KDATrace:
    """What the recurrence used per token, for speculative rollback (spec.py).
    k [T, H, K] l2-normed key, u [T, H, V] the written delta, g [T, H, K] the log-decay;
    states [T, H, K, V] the state after each token (only when asked for)."""

    k: torch.Tensor
    u: torch.Tensor
    g: torch.Tensor
    states: torch.Tensor | None = None


def kda_recurrent_trace(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                        keep_states: bool = False) -> tuple[torch.Tensor, torch.Tensor, KDATrace]:
    """The sequential recurrence (`kda_recurrent` is this without the trace), also returning
    the per-token (k, u, g) it used and, with keep_states, the state after every token."""
    t_len, h, kd = q.shape
    vd = v.shape[-1]
    state = (torch.zeros(h, kd, vd, dtype=torch.float32, device=q.device) if initial_state is None
             else initial_state.float().clone())
    q, k, v, g, beta = q.float(), k.float(), v.float(), g.float(), beta.float()
    out = torch.empty(t_len, h, vd, dtype=torch.float32, device=q.device)
    us = torch.empty(t_len, h, vd, dtype=torch.float32, device=q.device)
    states = torch.empty(t_len, h, kd, vd, dtype=torch.float32, device=q.device) if keep_states else None
    decay = exp(g)                                            # [T, H, K]
    for t in range(t_len):
        state = state * decay[t].unsqueeze(-1)                      # [H, K, V]
        kv = (state * k[t].unsqueeze(-1)).sum(1)                    # S^T k   [H, V]
        u = beta[t].unsqueeze(-1) * (v[t] - kv)                     # [H, V]
        state = state + k[t].unsqueeze(-1) * u.unsqueeze(1)         # k (outer) u
        out[t] = (state * q[t].unsqueeze(-1)).sum(1)                # S^T q   [H, V]
        us[t] = u
        if states is not None:
            states[t] = state
    return out, state, KDATrace(k, us, g, states)


def kda_replay(state: torch.Tensor, k: torch.Tensor, u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Rebuild the state from a checkpoint [H, K, V] and stored per-token k [T, H, K],
    u [T, H, V], g [T, H, K] by the same sequential update as the recurrence (decay, then
    write): bit-identical to the recurrence's state after those T tokens. Returns a new
    tensor (the checkpoint is not modified)."""
    state = state.float().clone()
    decay = exp(g.float())                                    # elementwise: same bits as in the scan
    for t in range(k.shape[0]):
        state = state * decay[t].unsqueeze(-1)
        state = state + k[t].unsqueeze(-1) * u[t].unsqueeze(1)
    return state


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time. x [T, C], window [W-1, C] (the last W-1 inputs),
    weight [C, 1, W] with tap W-1 = the current token. Returns (y [T, C], new window)."""
    taps = weight.shape[-1]
    xs = torch.cat([window.to(x.dtype), x], 0)                       # [W-1+T, C]
    t_len = x.shape[0]
    y = xs[0:t_len] * weight[:, 0, 0]
    for j in range(1, taps):                                          # fixed tap order
        y = y + xs[j:j + t_len] * weight[:, 0, j]
    return y, xs[-(taps - 1):].clone()


class KDAttention(nn.Module):
    """One KDA mixer layer; parameter names are the HF checkpoint names."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.cfg = cfg
        d, h, kd = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        hk = h * kd
        self.q_proj = nn.Linear(d, hk, bias=False)
        self.k_proj = nn.Linear(d, hk, bias=False)
        self.v_proj = nn.Linear(d, hk, bias=False)
        self.q_conv1d = nn.Conv1d(hk, hk, cfg.kda_conv_size, groups=hk, bias=False)
        self.k_conv1d = nn.Conv1d(hk, hk, cfg.kda_conv_size, groups=hk, bias=False)
        self.v_conv1d = nn.Conv1d(hk, hk, cfg.kda_conv_size, groups=hk, bias=False)
        self.f_a_proj = nn.Linear(d, kd, bias=False)
        self.f_b_proj = nn.Linear(kd, hk, bias=False)
        # A_log ships zero-padded to max(H, K); only [:H] is read.
        self.A_log = nn.Parameter(torch.zeros(max(h, kd)))
        self.dt_bias = nn.Parameter(torch.zeros(hk))
        self.b_proj = nn.Linear(d, h, bias=False)
        if cfg.kda_full_rank_gate:
            self.g_proj = nn.Linear(d, hk, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, kd, bias=False)
            self.g_b_proj = nn.Linear(kd, hk, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(kd))
        self.o_proj = nn.Linear(hk, d, bias=False)

    def new_state(self, device: torch.device | str = "cpu") -> KDAState:
        cfg = self.cfg
        hk = cfg.kda_num_heads * cfg.kda_head_dim
        # the windows hold pre-conv projections, in the activations' dtype (bf16 on the GPU profile),
        # so a pooled copy and the reference's own window are the same tensor type
        win = torch.zeros(cfg.kda_conv_size - 1, hk, device=device, dtype=self.q_proj.weight.dtype)
        return KDAState(torch.zeros(cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim,
                                    dtype=torch.float32, device=device),
                        win.clone(), win.clone(), win.clone())

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-decay g [T, H, K] fp32 and beta [T, H] fp32 from the layer input x [T, D]."""
        cfg = self.cfg
        h, kd = cfg.kda_num_heads, cfg.kda_head_dim
        lin = OPS.linear
        z = lin(lin(x, self.f_a_proj.weight), self.f_b_proj.weight).float()     # [T, H*K]
        z = (z + self.dt_bias.float()).view(-1, h, kd)
        a = exp(self.A_log[:h].float()).view(1, h, 1)
        if cfg.variant == "k3":      # safe gate: g in (lower_bound, 0)
            g = cfg.kda_gate_lower_bound * sigmoid(a * z)
        else:                        # Kimi Linear: g = -exp(A_log) * softplus(z + dt_bias)
            g = -a * softplus(z)
        beta = sigmoid(lin(x, self.b_proj.weight).float())                 # [T, H]
        return g, beta

    def qkv(self, x: torch.Tensor, st: KDAState) -> tuple[torch.Tensor, ...]:
        """Projections, causal conv (updates the windows in st), SiLU, l2norm, q scale."""
        cfg = self.cfg
        h, kd = cfg.kda_num_heads, cfg.kda_head_dim
        lin = OPS.linear
        q, st.conv_q = causal_conv(lin(x, self.q_proj.weight), st.conv_q, self.q_conv1d.weight)
        k, st.conv_k = causal_conv(lin(x, self.k_proj.weight), st.conv_k, self.k_conv1d.weight)
        v, st.conv_v = causal_conv(lin(x, self.v_proj.weight), st.conv_v, self.v_conv1d.weight)
        q = silu(q).view(-1, h, kd)
        k = silu(k).view(-1, h, kd)
        v = silu(v).view(-1, h, kd)
        q = l2_norm(q.float()) * kd ** -0.5
        k = l2_norm(k.float())
        return q, k, v.float()

    def output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm, sigmoid output gate, o_proj. o [T, H, V] fp32 -> [T, D]."""
        cfg = self.cfg
        lin = OPS.linear
        o = rms_norm(o, self.o_norm.weight.float(), cfg.rms_norm_eps)
        if cfg.kda_full_rank_gate:
            gate = lin(x, self.g_proj.weight)
        else:
            gate = lin(lin(x, self.g_a_proj.weight), self.g_b_proj.weight)
        o = o * sigmoid(gate.float()).view_as(o)
        return lin(o.reshape(o.shape[0], -1).to(x.dtype), self.o_proj.weight)

    def forward(self, x: torch.Tensor, st: KDAState) -> torch.Tensor:
        """x [T, D] -> [T, D]; st (recurrent state and conv windows) is advanced in place."""
        q, k, v = self.qkv(x, st)
        g, beta = self.gates(x)
        scan = (OPS.kda_decode if x.shape[0] == 1 else OPS.kda_prefill) or kda_scan
        if x.is_cuda:
            # the GPU profile picks its KDA form by the activations' dtype (fp32: no TF32 chunk)
            with ops.gpu_reference().kda_activations(x.dtype):
                o, st.recurrent = scan(q, k, v, g, beta, st.recurrent)
        else:
            o, st.recurrent = scan(q, k, v, g, beta, st.recurrent)
        return self.output(x, o)


__all__ = ["KDAttention", "KDAState", "KDATrace", "kda_recurrent", "kda_recurrent_trace", "kda_replay", "kda_scan",
           "causal_conv", "ops"]
