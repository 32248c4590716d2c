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
The per-layer shard blocks (_KDAShard, _MLAShard, _FFNShard, dcp_attention) are in tp_shards.py.

Options (toggles, see toggle_defs.py) change only where and in which order sums happen:
`dedup` (replicated work row-sharded then all-gathered), `moe_output_shard` (latent
up-projection column-sharded into the shared expert's partial), `fused_allreduce_residual`
(one-shot rank-order sum with the residual added in the same pass), `dcp_mla`, and with it
`dcp_fp8_allgather` (prefill over the whole context gathered in FP8, dcp_fp8.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import KDA
from ..errors import K3Error
from ..events import Events
from ..model.attn_res import AttnResRead
from ..model.kda import KDAState
from ..model.model import K3Model, RequestState
from ..model.ops import OPS, rms_norm
from .launch import Comm, shard_range, split_sizes
from .tp_shards import _FFNShard, _KDAShard, _MLAShard, _w

FAULTS = ("dedup_gather_reversed", "moe_shard_full_on_every_rank", "allreduce_twice",
          "dcp_merge_no_rescale", "dcp_fp8_dequant_scale_x2", "dcp_fp8_per_tensor")
OPTION_KEYS = ("tp_dedup", "moe_output_shard", "fused_allreduce_residual", "dcp_mla", "faults",
               "dcp_fp8_allgather")


@dataclass(frozen=True)
class TPOptions:
    dedup: bool = False                     # tp_dedup_router
    moe_output_shard: bool = False
    fused_allreduce_residual: bool = False
    dcp_mla: bool = False
    faults: frozenset = frozenset()         # seeded faults of the TP mutants
    dcp_fp8_allgather: bool = False         # prefill gathers the DCP context in FP8 (dcp_fp8.py)

    def __post_init__(self) -> None:
        bad = sorted(set(self.faults) - set(FAULTS))
        if bad:
            raise K3Error(f"TP fault {bad[0]!r}: expected some of {', '.join(FAULTS)}")
        if self.dcp_fp8_allgather and not self.dcp_mla:
            raise K3Error("TP option dcp_fp8_allgather gathers the DCP context: it needs dcp_mla")

    @classmethod
    def from_runner(cls, opts: dict[str, Any]) -> "TPOptions":
        """From the merged `runner` options of the applied toggles (unknown keys refused)."""
        bad = sorted(set(opts) - set(OPTION_KEYS))
        if bad:
            raise K3Error(f"TP runner option {bad[0]!r}: expected some of {', '.join(OPTION_KEYS)}")
        return cls(bool(opts.get("tp_dedup")), bool(opts.get("moe_output_shard")),
                   bool(opts.get("fused_allreduce_residual")), bool(opts.get("dcp_mla")),
                   frozenset(opts.get("faults", ())), bool(opts.get("dcp_fp8_allgather")))


class TPModel:
    """One rank's shard of a K3Model; `forward(ids, state)` like K3Model.forward."""

    def __init__(self, model: K3Model, comm: Comm, opts: TPOptions = TPOptions(), device=None):
        cfg = model.config
        self.config, self.comm, self.opts = cfg, comm, opts
        self.events = Events()                  # path events of the TP options (optimized_stack/events.py)
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
        self.events.fire("tp_dedup_gather")
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
            self.events.fire("fused_allreduce")
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
        mix, eps = OPS.attn_res_mix or AttnResRead.mix, cfg.rms_norm_eps
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
