"""Tensor-parallel forward of the K3 reference model, world size W, one object per rank.

Shape letters: T tokens (new this call), D hidden, H heads, K head dim, S cached rows,
R MLA cache row width, C qk head dim, Vd value dim, L latent width, V vocab.

The layer modules' weights are sliced, not re-learned, and every per-rank computation
uses the reference's row-stable ops (`OPS.linear`, `ops.exp` ...):
- column-parallel by heads: KDA q/k/v (+ conv channels), f_b, g, b, dt_bias, A_log;
  MLA q_b (or q), kv_b, g. Row-parallel o_proj: each rank's [T, D] partial, summed by
  an all-reduce. Replicated: embeddings, AttnRes reads, norms, the low-rank "a"
  projections (f_a, g_a, q_a, kv_a), the router and the latent down/up projections.
- MoE: rank r owns a contiguous range of E/W experts (whole experts); the routed latent
  partials are all-reduced (the latent RMSNorm needs the full sum), the shared experts'
  and dense GLU width is split (column gate/up, row down).
- lm_head is vocab-parallel; logits are all-gathered on the vocab axis.
- MLA cache rows are replicated (every rank needs every latent); under DCP rank r keeps
  only the rows of positions p with p % W == r.
Shards are even contiguous splits, so a rank may own no head when H < W.

Options (toggles, see toggle_defs.py) change only where and in which order sums happen:
`dedup` (replicated work row-sharded then all-gathered), `moe_output_shard` (latent
up-projection column-sharded into the shared expert's partial), `fused_allreduce_residual`
(one-shot rank-order sum with the residual added in the same pass), `dcp_mla`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import KDA
from ..errors import K3Error
from ..model import ops
from ..model.attn_res import AttnResRead
from ..model.kda import KDAState, causal_conv, kda_recurrent
from ..model.mla import blocked_attention
from ..model.model import K3Model, RequestState
from ..model.ops import OPS, exp, l2_norm, rms_norm, sigmoid, silu, situ, swiglu
from .launch import Comm, shard_range, split_sizes

FAULTS = ("dedup_gather_reversed", "moe_shard_full_on_every_rank", "allreduce_twice",
          "dcp_merge_no_rescale")
OPTION_KEYS = ("tp_dedup", "moe_output_shard", "fused_allreduce_residual", "dcp_mla", "faults")


@dataclass(frozen=True)
class TPOptions:
    dedup: bool = False                     # tp_dedup_router
    moe_output_shard: bool = False
    fused_allreduce_residual: bool = False
    dcp_mla: bool = False
    faults: frozenset = frozenset()         # seeded faults of the TP mutants

    def __post_init__(self) -> None:
        bad = sorted(set(self.faults) - set(FAULTS))
        if bad:
            raise K3Error(f"TP fault {bad[0]!r}: expected some of {', '.join(FAULTS)}")

    @classmethod
    def from_runner(cls, opts: dict[str, Any]) -> "TPOptions":
        """From the merged `runner` options of the applied toggles (unknown keys refused)."""
        bad = sorted(set(opts) - set(OPTION_KEYS))
        if bad:
            raise K3Error(f"TP runner option {bad[0]!r}: expected some of {', '.join(OPTION_KEYS)}")
        return cls(bool(opts.get("tp_dedup")), bool(opts.get("moe_output_shard")),
                   bool(opts.get("fused_allreduce_residual")), bool(opts.get("dcp_mla")),
                   frozenset(opts.get("faults", ())))


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
        o, st.recurrent = (OPS.kda_prefill or kda_recurrent)(q, k, v, g, beta, st.recurrent)
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
        if ctx.opts.dcp_mla:
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
            o = (OPS.mla_attention or blocked_attention)(q, k, v, q_pos, scale)
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
        if "moe_shard_full_on_every_rank" in opts.faults:
            return shared + lin(rms_norm(y, self.norm_w, cfg.rms_norm_eps), self.up), None
        if opts.moe_output_shard:   # this rank's columns of the routed output, into its partial
            part = shared.clone()
            part[:, self.d0:self.d1] = part[:, self.d0:self.d1] + lin(
                rms_norm(y, self.norm_w, cfg.rms_norm_eps), self.up_cols)
            return part, None
        up = ctx.rows(lambda yy: [lin(rms_norm(yy, self.norm_w, cfg.rms_norm_eps), self.up)], y)[0]
        return shared, up


class TPModel:
    """One rank's shard of a K3Model; `forward(ids, state)` like K3Model.forward."""

    def __init__(self, model: K3Model, comm: Comm, opts: TPOptions = TPOptions(), device=None):
        cfg = model.config
        self.config, self.comm, self.opts = cfg, comm, opts
        self.device = torch.device(device) if device is not None else model.device
        r, w = comm.rank, comm.world_size
        self.d = cfg.hidden_size
        self.kda_heads = split_sizes(cfg.kda_num_heads, w)
        self.mla_heads = split_sizes(cfg.num_heads, w)
        self.vocab = split_sizes(cfg.vocab_size, w)
        m = model.model
        self.embed = _w(m.embed_tokens.weight, self.device)
        v0, v1 = shard_range(cfg.vocab_size, w, r)
        self.lm_w = _w(model.lm_head.weight[v0:v1], self.device)
        self.norm_w = _w(m.norm.weight, self.device)
        self.res = cfg.attn_res_block_size is not None
        self.out_read = (_w(m.output_attn_res_norm.weight, self.device),
                         _w(m.output_attn_res_proj.weight, self.device)) if self.res else None
        self.layers = []
        for layer in m.layers:
            kinds = self.kda_heads if layer.kind == KDA else self.mla_heads
            h0, h1 = sum(kinds[:r]), sum(kinds[:r + 1])
            mixer = (_KDAShard if layer.kind == KDA else _MLAShard)(layer.self_attn, h0, h1, self.device)
            reads = None
            if self.res:
                reads = [(_w(getattr(layer, f"{n}_norm").weight, self.device),
                          _w(getattr(layer, f"{n}_proj").weight, self.device)) for n in ("self_attention_res", "mlp_res")]
            self.layers.append(dict(index=layer.index, kind=layer.kind, mixer=mixer, reads=reads,
                                    ffn=_FFNShard(layer, r, w, self.device),
                                    in_norm=_w(layer.input_layernorm.weight, self.device),
                                    post_norm=_w(layer.post_attention_layernorm.weight, self.device)))

    # ---- state ------------------------------------------------------------------------
    def new_state(self) -> RequestState:
        st = RequestState()
        for L in self.layers:
            if L["kind"] == KDA:
                st.kda[L["index"]] = L["mixer"].new_state(self.device)
            else:
                st.mla[L["index"]] = torch.zeros(0, self.config.mla_cache_width, device=self.device)
        return st

    def gather_kda(self, st: RequestState) -> dict[int, KDAState]:
        """Full KDA states [H, K, V] and conv windows [W-1, H*K], heads in rank order."""
        kd, out = self.config.kda_head_dim, {}
        for i, s in st.kda.items():
            chans = [n * kd for n in self.kda_heads]
            out[i] = KDAState(torch.cat(self.comm.gather_parts(s.recurrent, self.kda_heads, 0)),
                              *(torch.cat(self.comm.gather_parts(getattr(s, n), chans, 1), 1)
                                for n in ("conv_q", "conv_k", "conv_v")))
        return out

    def gather_mla(self, st: RequestState) -> dict[int, torch.Tensor]:
        """Full MLA cache rows [S, R] in position order (DCP shards re-interleaved)."""
        if not self.opts.dcp_mla:
            return dict(st.mla)
        w, out = self.comm.world_size, {}
        sizes = [len(range(r, st.num_tokens, w)) for r in range(w)]
        for i, rows in st.mla.items():
            full = rows.new_empty(st.num_tokens, rows.shape[1])
            for r, part in enumerate(self.comm.gather_parts(rows, sizes, 0)):
                full[r::w] = part
            out[i] = full
        return out

    # ---- collectives with their options ----------------------------------------------
    def rows(self, fn: Callable[..., list[torch.Tensor]], *xs: torch.Tensor) -> list[torch.Tensor]:
        """fn on every row of xs (all [T, ...]); with dedup each rank computes its row range
        and the results are all-gathered in rank order. Exact iff fn is row-stable."""
        if not self.opts.dedup or self.comm.world_size == 1:
            return fn(*xs)
        t_len = xs[0].shape[0]
        sizes = split_sizes(t_len, self.comm.world_size)
        a, b = shard_range(t_len, self.comm.world_size, self.comm.rank)
        # a rank without rows still needs output shapes: run one real row and keep none
        outs = fn(*(x[a:b] for x in xs)) if b > a else [o[:0] for o in fn(*(x[:1] for x in xs))]
        gathered = []
        for o in outs:
            parts = self.comm.gather_parts(o, sizes, 0)
            if "dedup_gather_reversed" in self.opts.faults:
                parts = parts[::-1]
            gathered.append(torch.cat(parts))
        return gathered

    def complete(self, part: torch.Tensor, residual: torch.Tensor | None,
                 addend: torch.Tensor | None = None) -> torch.Tensor:
        """residual + (addend + sum over ranks of part): the row-parallel reduction.

        Plain: torch.distributed all-reduce (gloo/NCCL pick the order), then the adds.
        Fused: one-shot, each rank sums the gathered partials in rank order and adds the
        rest in the same pass (what a fused all-reduce + residual kernel does)."""
        if self.opts.fused_allreduce_residual and self.comm.world_size > 1:
            parts = self.comm.all_gather(part)
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            if "allreduce_twice" in self.opts.faults:
                total = self.comm.all_reduce(total)
        else:
            total = self.comm.all_reduce(part)
        if addend is not None:
            total = addend + total
        return total if residual is None else residual + total

    # ---- forward ----------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, ids: torch.Tensor, st: RequestState) -> torch.Tensor:
        """Append ids [T] to the request (this rank's shards of its state) -> [T, V] fp32,
        the same full logits on every rank."""
        cfg = self.config
        ids = ids.to(self.device)
        x = torch.nn.functional.embedding(ids, self.embed)                    # [T, D]
        mix, eps = AttnResRead.mix, cfg.rms_norm_eps
        snapshots: list[torch.Tensor] = []
        partial: torch.Tensor | None = x
        for L in self.layers:
            i, mixer, ffn = L["index"], L["mixer"], L["ffn"]
            assert partial is not None
            cands = snapshots + [partial]
            use_mix = self.res and bool(snapshots)
            in_read = L["reads"][0] if self.res else None

            def pre_mixer(*c, use_mix=use_mix, L=L, in_read=in_read):
                h = mix(list(c), *in_read, eps) if use_mix else c[-1]
                xn = rms_norm(h, L["in_norm"], eps)
                return [xn] + L["mixer"].replicated(xn)
            xn, *rep = self.rows(pre_mixer, *cands)
            if self.res and i % cfg.attn_res_block_size == 0:      # freeze the block, restart the sum
                snapshots.append(partial)
                partial = None
            if L["kind"] == KDA:
                a = mixer.forward(xn, rep, st.kda[i], self)
            else:
                a, st.mla[i] = mixer.forward(xn, rep, st.mla[i], st.num_tokens, self)
            partial = self.complete(a, partial)
            cands = snapshots + [partial]

            def pre_ffn(*c, L=L):
                h = mix(list(c), *L["reads"][1], eps) if self.res else c[-1]
                x2 = rms_norm(h, L["post_norm"], eps)
                return [x2] + L["ffn"].replicated(x2)
            x2, *rep = self.rows(pre_ffn, *cands)
            f, addend = ffn.forward(x2, rep, self)
            partial = self.complete(f, partial, addend)
        assert partial is not None

        def final(*c):
            h = mix(list(c), *self.out_read, eps) if self.res else c[-1]
            return [rms_norm(h, self.norm_w, eps)]
        h = self.rows(final, *(snapshots + [partial]))[0]
        logits = OPS.linear(h, self.lm_w).float()                              # [T, V/W]
        st.num_tokens += ids.shape[0]
        return torch.cat(self.comm.gather_parts(logits, self.vocab, 1), 1)    # [T, V]
