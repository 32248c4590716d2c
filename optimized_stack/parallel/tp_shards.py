"""One rank's slices of each K3 layer for the tensor-parallel forward (tp_model.py).

_KDAShard and _MLAShard own a contiguous range of attention heads, _FFNShard a range
of experts and a slice of the shared/dense GLU width; dcp_attention merges MLA
attention over keys split across ranks. Each block takes the reference layer
module, copies out the weight slices its rank owns, and computes that rank's partial
with the reference's row-stable ops; the sharding layout is described in tp_model.py.
Kept apart from tp_model.py so that the per-layer weight slicing and partial maths
sit in one file, and the model-level walk (state, collectives, options) in the other.

Shape letters as in tp_model.py: T tokens, D hidden, H heads, K head dim, S cached
rows, R MLA cache row width, C qk head dim, Vd value dim, L latent width, E experts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..model import ops
from ..model.kda import KDAState, causal_conv, kda_scan
from ..model.mla import blocked_attention
from ..model.ops import OPS, exp, l2_norm, rms_norm, sigmoid, silu, situ, swiglu
from .dcp_fp8 import gather_context_fp8
from .launch import Comm, shard_range

if TYPE_CHECKING:  # only for the ctx annotations; tp_model imports this module
    from .tp_model import TPModel


def _w(t: torch.Tensor, device) -> torch.Tensor:
    """A rank's own contiguous copy of a (sliced) weight."""
    return t.detach().to(device).contiguous().clone()


def _glu(cfg, x: torch.Tensor, gate_w, up_w, down_w) -> torch.Tensor:
    """The GLU of moe.GLU.forward with explicit (possibly width-sliced) weights."""
    lin = OPS.linear
    gate, up = lin(x, gate_w), lin(x, up_w)
    act = situ(gate, up, cfg.situ_beta, cfg.situ_linear_beta) if cfg.activation == "situ" else swiglu(gate, up)
    return lin(act, down_w)


class _KDAShard:
    """KDA heads [h0, h1) of one layer."""

    def __init__(self, attn, h0: int, h1: int, device):
        cfg = attn.cfg
        kd = cfg.kda_head_dim
        c = slice(h0 * kd, h1 * kd)                 # channels of the owned heads (head-major)
        self.cfg, self.h = cfg, h1 - h0
        self.q_w, self.k_w, self.v_w = (_w(m.weight[c], device) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        self.convs = [_w(m.weight[c], device) for m in (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d)]
        self.f_a, self.f_b = _w(attn.f_a_proj.weight, device), _w(attn.f_b_proj.weight[c], device)
        self.dt_bias, self.a_log = _w(attn.dt_bias[c], device), _w(attn.A_log[h0:h1], device)
        self.b_w = _w(attn.b_proj.weight[h0:h1], device)
        if cfg.kda_full_rank_gate:
            self.g_a, self.g_w = None, _w(attn.g_proj.weight[c], device)
        else:
            self.g_a, self.g_w = _w(attn.g_a_proj.weight, device), _w(attn.g_b_proj.weight[c], device)
        self.o_norm, self.o_w = _w(attn.o_norm.weight, device), _w(attn.o_proj.weight[:, c], device)

    def new_state(self, device) -> KDAState:
        cfg = self.cfg
        win = torch.zeros(cfg.kda_conv_size - 1, self.h * cfg.kda_head_dim, device=device)
        return KDAState(torch.zeros(self.h, cfg.kda_head_dim, cfg.kda_head_dim, device=device),
                        win.clone(), win.clone(), win.clone())

    def replicated(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The low-rank projections every rank needs whole: f_a (and g_a)."""
        lin = OPS.linear
        return [lin(x, self.f_a)] + ([] if self.g_a is None else [lin(x, self.g_a)])

    def forward(self, x, rep: list[torch.Tensor], st: KDAState, ctx: "TPModel") -> torch.Tensor:
        """Same ops as KDAttention.qkv / gates / output on the owned heads -> [T, D] partial."""
        cfg, h, kd, lin = self.cfg, self.h, self.cfg.kda_head_dim, OPS.linear
        if h == 0:
            return x.new_zeros(x.shape[0], ctx.d)
        q, st.conv_q = causal_conv(lin(x, self.q_w), st.conv_q, self.convs[0])
        k, st.conv_k = causal_conv(lin(x, self.k_w), st.conv_k, self.convs[1])
        v, st.conv_v = causal_conv(lin(x, self.v_w), st.conv_v, self.convs[2])
        q = l2_norm(silu(q).view(-1, h, kd).float()) * kd ** -0.5
        k = l2_norm(silu(k).view(-1, h, kd).float())
        v = silu(v).view(-1, h, kd).float()
        z = (lin(rep[0], self.f_b).float() + self.dt_bias.float()).view(-1, h, kd)
        a = exp(self.a_log.float()).view(1, h, 1)
        g = cfg.kda_gate_lower_bound * sigmoid(a * z) if cfg.variant == "k3" else -a * ops.softplus(z)
        beta = sigmoid(lin(x, self.b_w).float())
        scan = (OPS.kda_decode if x.shape[0] == 1 else OPS.kda_prefill) or kda_scan
        o, st.recurrent = scan(q, k, v, g, beta, st.recurrent)
        o = rms_norm(o, self.o_norm.float(), cfg.rms_norm_eps)
        gate = lin(x, self.g_w) if self.g_a is None else lin(rep[1], self.g_w)
        o = o * sigmoid(gate.float()).view_as(o)
        return lin(o.reshape(o.shape[0], -1).to(x.dtype), self.o_w)


class _MLAShard:
    """MLA heads [h0, h1) of one layer (all heads' kv_b kept too, for DCP)."""

    def __init__(self, attn, h0: int, h1: int, device):
        cfg = attn.cfg
        c, nv, vd = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim
        self.cfg, self.h0, self.h1, self.h = cfg, h0, h1, h1 - h0
        self.q_a = None
        if cfg.q_lora_rank is not None:
            self.q_a, self.q_a_ln = _w(attn.q_a_proj.weight, device), _w(attn.q_a_layernorm.weight, device)
            self.q_w = _w(attn.q_b_proj.weight[h0 * c:h1 * c], device)
        else:
            self.q_w = _w(attn.q_proj.weight[h0 * c:h1 * c], device)
        self.kv_a, self.kv_a_ln = _w(attn.kv_a_proj_with_mqa.weight, device), _w(attn.kv_a_layernorm.weight, device)
        self.kv_b = _w(attn.kv_b_proj.weight[h0 * nv:h1 * nv], device)
        self.kv_b_all = _w(attn.kv_b_proj.weight, device)
        self.g_w = _w(attn.g_proj.weight[h0 * vd:h1 * vd], device) if cfg.mla_output_gate else None
        self.o_w = _w(attn.o_proj.weight[:, h0 * vd:h1 * vd], device)

    def replicated(self, x: torch.Tensor) -> list[torch.Tensor]:
        """q_a (normed) and the new cache rows [T, R] = [rmsnorm(latent) | k_rope]."""
        cfg, lin = self.cfg, OPS.linear
        c = lin(x, self.kv_a)
        rows = torch.cat([rms_norm(c[:, :cfg.kv_lora_rank], self.kv_a_ln, cfg.lora_eps), c[:, cfg.kv_lora_rank:]], -1)
        if self.q_a is None:
            return [rows]
        return [rms_norm(lin(x, self.q_a), self.q_a_ln, cfg.lora_eps), rows]

    def _decompress(self, rows: torch.Tensor, kv_b: torch.Tensor, h: int):
        cfg = self.cfg
        nope = cfg.qk_nope_head_dim
        kv = OPS.linear(rows[:, :cfg.kv_lora_rank], kv_b).view(rows.shape[0], h, nope + cfg.v_head_dim)
        k_rope = rows[:, cfg.kv_lora_rank:].unsqueeze(1).expand(-1, h, -1)
        return torch.cat([kv[..., :nope], k_rope], -1), kv[..., nope:]

    def forward(self, x, rep, cache: torch.Tensor, start: int, ctx: "TPModel"):
        """-> ([T, D] partial, new cache). cache: all rows, or under DCP this rank's rows."""
        cfg, lin, t_len = self.cfg, OPS.linear, x.shape[0]
        rows_new = rep[-1].to(cache.dtype)
        q_pos = torch.arange(start, start + t_len, device=x.device)
        q = lin(rep[0], self.q_w) if self.q_a is not None else lin(x, self.q_w)
        q = q.view(t_len, self.h, cfg.qk_head_dim)
        scale = cfg.qk_head_dim ** -0.5
        if ctx.opts.dcp_fp8_allgather and t_len > 1:
            # prefill: gather the sharded context in FP8 and attend this rank's heads over it
            ctx.events.fire("dcp_fp8_gather")
            comm = ctx.comm
            cache = torch.cat([cache, rows_new[q_pos % comm.world_size == comm.rank]], 0)
            full = gather_context_fp8(cache, start + t_len, comm, ctx.opts.faults)   # every rank calls it
            if self.h == 0:
                return x.new_zeros(t_len, ctx.d), cache
            k, v = self._decompress(full.to(rows_new.dtype), self.kv_b, self.h)
            o = (OPS.attention or blocked_attention)(q, k, v, q_pos, scale)
        elif ctx.opts.dcp_mla:
            ctx.events.fire("dcp_merge")
            comm = ctx.comm
            keep = q_pos % comm.world_size == comm.rank
            cache = torch.cat([cache, rows_new[keep]], 0)
            k_pos = comm.rank + comm.world_size * torch.arange(cache.shape[0], device=x.device)
            q_all = torch.cat(comm.gather_parts(q, ctx.mla_heads, dim=1), 1)        # [T, H, C]
            k, v = self._decompress(cache, self.kv_b_all, cfg.num_heads)
            o = dcp_attention(q_all, k, v, q_pos, k_pos, scale, comm,
                              rescale="dcp_merge_no_rescale" not in ctx.opts.faults)[:, self.h0:self.h1]
        else:
            cache = torch.cat([cache, rows_new], 0)
            if self.h == 0:
                return x.new_zeros(t_len, ctx.d), cache
            k, v = self._decompress(cache, self.kv_b, self.h)
            o = (OPS.attention or blocked_attention)(q, k, v, q_pos, scale)
        if self.h == 0:
            return x.new_zeros(t_len, ctx.d), cache
        if self.g_w is not None:
            o = o * sigmoid(lin(x, self.g_w).float()).view_as(o)
        return lin(o.reshape(t_len, -1).to(x.dtype), self.o_w), cache


def dcp_attention(q, k, v, q_pos, k_pos, scale: float, comm: Comm, rescale: bool = True) -> torch.Tensor:
    """Causal attention over keys split across ranks, merged by log-sum-exp.

    q [T, H, C] (all heads), k [S_r, H, C], v [S_r, H, Vd]: this rank's keys at absolute
    positions k_pos [S_r]. Each rank computes its unnormalised partial (acc, max m, sum l);
    the merge rescales every partial by exp(m_r - max_r m_r) before summing, as flash
    decoding does. Returns [T, H, Vd] fp32, the same on every rank.
    """
    q, k, v = q.float(), k.float(), v.float()
    t_len, h, vd = q.shape[0], q.shape[1], v.shape[-1]
    if k.shape[0] == 0:
        m = torch.full((t_len, h), float("-inf"), device=q.device)
        l, acc = torch.zeros(t_len, h, device=q.device), torch.zeros(t_len, h, vd, device=q.device)
    else:
        s = torch.einsum("thc,shc->ths", q, k) * scale                        # [T, H, S_r]
        s = s.masked_fill(k_pos.view(1, 1, -1) > q_pos.view(-1, 1, 1), float("-inf"))
        m = s.amax(-1)                                                         # [T, H]
        p = exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m).unsqueeze(-1))
        l, acc = p.sum(-1), torch.einsum("ths,shv->thv", p, v)
    if rescale:
        top = comm.all_reduce(m, op="max")              # finite: a query always sees its own key
        w = torch.where(torch.isinf(m), torch.zeros_like(m), exp(m - top))
        acc, l = acc * w.unsqueeze(-1), l * w
    return comm.all_reduce(acc) / comm.all_reduce(l).unsqueeze(-1)


class _FFNShard:
    """Dense GLU (width split) or MoE: experts [e0, e1), shared-expert width split."""

    def __init__(self, layer, rank: int, world: int, device):
        cfg = layer.self_attn.cfg
        self.cfg, self.moe = cfg, hasattr(layer, "block_sparse_moe")
        if not self.moe:
            glu, width = layer.mlp, cfg.intermediate_size
            a, b = shard_range(width, world, rank)
            self.glu = (_w(glu.gate_proj.weight[a:b], device), _w(glu.up_proj.weight[a:b], device),
                        _w(glu.down_proj.weight[:, a:b], device))
            return
        moe = layer.block_sparse_moe
        self.router = moe.gate.to(device)               # replicated: the reference module
        self.e0, self.e1 = shard_range(cfg.num_experts, world, rank)
        self.experts = {e: moe.experts[e].to(device) for e in range(self.e0, self.e1)}
        self.latent = cfg.routed_expert_hidden_size is not None
        if self.latent:
            self.down = _w(moe.routed_expert_down_proj.weight, device)
            self.norm_w = _w(moe.routed_expert_norm.weight, device)
            self.up = _w(moe.routed_expert_up_proj.weight, device)
            a, b = shard_range(cfg.hidden_size, world, rank)       # moe_output_shard columns
            self.d0, self.d1, self.up_cols = a, b, _w(moe.routed_expert_up_proj.weight[a:b], device)
        self.glu = None
        if cfg.num_shared_experts:
            sh = moe.shared_experts
            a, b = shard_range(cfg.num_shared_experts * cfg.moe_intermediate_size, world, rank)
            self.glu = (_w(sh.gate_proj.weight[a:b], device), _w(sh.up_proj.weight[a:b], device),
                        _w(sh.down_proj.weight[:, a:b], device))

    def replicated(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Router (ids as int64, weights fp32) and the latent down-projection."""
        if not self.moe:
            return []
        idx, w = self.router(x)
        return [idx, w] + ([OPS.linear(x, self.down)] if self.latent else [])

    def routed(self, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """MoE.routed over the owned experts only (ascending index). -> [T, De] fp32 partial."""
        y = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        for e, expert in self.experts.items():
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y[rows] = y[rows] + w[rows, slot].unsqueeze(-1) * expert(h[rows]).float()
        return y

    def forward(self, x, rep, ctx: "TPModel") -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (this rank's [T, D] partial, a replicated [T, D] addend or None)."""
        cfg, lin, opts = self.cfg, OPS.linear, ctx.opts
        shared = _glu(cfg, x, *self.glu) if self.glu is not None else x.new_zeros(x.shape[0], ctx.d)
        if not self.moe:
            return shared, None
        idx, w = rep[0], rep[1]
        if not self.latent:       # Kimi Linear: routed partials ride in the same all-reduce
            return self.routed(x, idx, w).to(x.dtype) + shared, None
        y = ctx.comm.all_reduce(self.routed(rep[2], idx, w)).to(x.dtype)      # [T, L], whole
        if opts.moe_output_shard:
            ctx.events.fire("moe_shard_add")
        if "moe_shard_full_on_every_rank" in opts.faults:
            return shared + lin(rms_norm(y, self.norm_w, cfg.rms_norm_eps), self.up), None
        if opts.moe_output_shard:   # this rank's columns of the routed output, into its partial
            part = shared.clone()
            part[:, self.d0:self.d1] = part[:, self.d0:self.d1] + lin(
                rms_norm(y, self.norm_w, cfg.rms_norm_eps), self.up_cols)
            return part, None
        up = ctx.rows(lambda yy: [lin(rms_norm(yy, self.norm_w, cfg.rms_norm_eps), self.up)], y)[0]
        return shared, up
