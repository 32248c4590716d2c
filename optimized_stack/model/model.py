"""The K3 reference model: decoder layers, AttnRes walk, incremental per-request state.

Shape letters: T tokens (new this call), D hidden, V vocab.

Public surface:
    model.logits(ids)             # ids [T] -> [T, V] fp32, fresh state (whole-prompt prefill)
    state = model.new_state()
    model.forward(ids, state)     # appends ids to the request, returns [T, V] fp32
    with model.probe(fn): ...     # fn(layer, sublayer, tensor) at every hook point

Hook points (sublayer names): "embed"; per layer "attn_in" (mixer input after the
AttnRes read), "mixer" (KDA or MLA output), "mlp_in", "ffn" (dense or MoE output),
"partial" (the residual partial sum leaving the layer); final "final_in", "final_norm",
"logits". Layer is -1 for the model-level points.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from ..config import KDA, K3Config
from .attn_res import AttnResRead, make_read_params
from .kda import KDAState, KDAttention
from .mla import MLAttention
from .moe import GLU, MoE
from ..errors import K3Error
from .ops import OPS, rms_norm

Probe = Callable[[int, str, torch.Tensor], None]
SegmentProbe = Callable[[list], None]      # [(ids [T], RequestState)] at the start of a forward_batch


@dataclass
class RequestState:
    """Everything one request carries between calls: KDA state per KDA layer, MLA rows per
    MLA layer, and the number of tokens consumed."""

    num_tokens: int = 0
    kda: dict[int, KDAState] = field(default_factory=dict)
    mla: dict[int, torch.Tensor] = field(default_factory=dict)    # [S, R] rows per layer
    # Projected K/V cache (the engine's projected_kv_cache): kv_b_proj output
    # [S', H*(nope+Vd)] for the first S' <= S rows per MLA layer. None = the reference:
    # decompress every row on every call. Rows it lacks are projected on the next call.
    mla_kv: dict[int, torch.Tensor] | None = None

    def clone(self) -> "RequestState":
        kv = None if self.mla_kv is None else {i: t.clone() for i, t in self.mla_kv.items()}
        return RequestState(self.num_tokens, {i: s.clone() for i, s in self.kda.items()},
                            {i: r.clone() for i, r in self.mla.items()}, kv)


class Norm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, index: int):
        super().__init__()
        self.index = index
        self.kind = cfg.layer_kinds[index]
        self.input_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = KDAttention(cfg) if self.kind == KDA else MLAttention(cfg)
        if cfg.is_moe_layer(index):
            self.block_sparse_moe = MoE(cfg)
        else:
            self.mlp = GLU(cfg, cfg.hidden_size, cfg.intermediate_size)
        if cfg.attn_res_block_size is not None:
            make_read_params(self, "self_attention_res", cfg.hidden_size)
            make_read_params(self, "mlp_res", cfg.hidden_size)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)


class Model(nn.Module):
    """`model.*` in the checkpoint."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size is not None:
            make_read_params(self, "output_attn_res", cfg.hidden_size)


class K3Model(nn.Module):
    """K3 / Kimi Linear causal LM on the reference path."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.config = cfg
        self.model = Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._probes: list[Probe] = []
        self._segment_probes: list[SegmentProbe] = []

    # ---- state ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def new_state(self) -> RequestState:
        st = RequestState()
        for layer in self.model.layers:
            if layer.kind == KDA:
                st.kda[layer.index] = layer.self_attn.new_state(self.device)
            else:
                st.mla[layer.index] = layer.self_attn.new_state(self.device).to(self.lm_head.weight.dtype)
        return st

    # ---- probes -----------------------------------------------------------------------
    @contextlib.contextmanager
    def probe(self, fn: Probe) -> Iterator[None]:
        """Attach a probe for the duration of the block (always detached afterwards)."""
        self._probes.append(fn)
        try:
            yield
        finally:
            self._probes.remove(fn)

    @contextlib.contextmanager
    def segment_probe(self, fn: "SegmentProbe") -> Iterator[None]:
        """Attach fn(segments) for the block: called at the start of every forward_batch with
        [(ids [T_i], state)] before anything runs, so a probe can read the states each call
        starts from and map the concatenated rows its other probes see back to segments."""
        self._segment_probes.append(fn)
        try:
            yield
        finally:
            self._segment_probes.remove(fn)

    def _emit(self, layer: int, name: str, t: torch.Tensor) -> None:
        for fn in self._probes:
            fn(layer, name, t)

    # ---- forward ----------------------------------------------------------------------
    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> logits [T, V] fp32 from a fresh state (whole-prompt prefill)."""
        return self.forward(ids, self.new_state())

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, state: RequestState) -> torch.Tensor:
        """Append ids [T] to the request in `state` (advanced in place) -> logits [T, V] fp32."""
        return self.forward_batch([(ids, state)])[0]

    @torch.no_grad()
    def forward_batch(self, segments: list[tuple[torch.Tensor, RequestState]]) -> list[torch.Tensor]:
        """Several requests in one call: each segment appends its ids to its own state.

        Token-wise work (projections, norms, AttnRes, FFN/MoE, lm_head) runs on the
        concatenated rows; KDA and MLA run per segment on their own state. Every op is
        row-stable, so each segment's logits are bit-identical to calling `forward` alone.
        """
        if not segments:
            raise K3Error("forward_batch: expected at least one (ids, state) segment, got none")
        cfg = self.config
        ids_list = [_as_ids(ids, cfg.vocab_size).to(self.device) for ids, _ in segments]
        states = [st for _, st in segments]
        if len({id(st) for st in states}) != len(states):
            raise K3Error("forward_batch: each segment needs its own RequestState, got one twice")
        for fn in self._segment_probes:
            fn(list(zip(ids_list, states)))
        bounds, start = [], 0
        for ids in ids_list:
            bounds.append((start, start + ids.shape[0]))
            start += ids.shape[0]
        x = self.model.embed_tokens(torch.cat(ids_list))                 # [T, D]
        self._emit(-1, "embed", x)
        seg = _Segments(bounds, states)
        h = self._plain_stack(x, seg) if cfg.attn_res_block_size is None else self._attn_res_stack(x, seg)
        h = self.model.norm(h)
        self._emit(-1, "final_norm", h)
        logits = OPS.linear(h, self.lm_head.weight).float()               # [T, V]
        self._emit(-1, "logits", logits)
        for ids, st in zip(ids_list, states):
            st.num_tokens += ids.shape[0]
        return [logits[a:b] for a, b in bounds]

    def _mixer(self, layer: DecoderLayer, x: torch.Tensor, seg: "_Segments") -> torch.Tensor:
        """Run the KDA / MLA mixer per segment, each on its own request state (or, with the op slot
        for every segment at once filled, through it: the same bits, kernels/kda/segments.py)."""
        over_segments = OPS.kda_segments if layer.kind == KDA else OPS.mla_segments
        if over_segments is not None and len(seg.bounds) > 1:
            states = [st.kda[layer.index] for st in seg.states] if layer.kind == KDA else seg.states
            return over_segments(layer.self_attn, layer.index, x, seg.bounds, states)
        outs = []
        for (a, b), st in zip(seg.bounds, seg.states):
            if layer.kind == KDA:
                outs.append(layer.self_attn(x[a:b], st.kda[layer.index]))
            elif st.mla_kv is not None:
                out, st.mla[layer.index], st.mla_kv[layer.index] = layer.self_attn.forward_projected(
                    x[a:b], st.mla[layer.index], st.mla_kv.get(layer.index))
                outs.append(out)
            else:
                out, st.mla[layer.index] = layer.self_attn(x[a:b], st.mla[layer.index])
                outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _plain_stack(self, h: torch.Tensor, state: "_Segments") -> torch.Tensor:
        """Kimi Linear: the classic residual stream."""
        for layer in self.model.layers:
            i = layer.index
            self._emit(i, "attn_in", h)
            a = self._mixer(layer, layer.input_layernorm(h), state)
            self._emit(i, "mixer", a)
            h = h + a
            self._emit(i, "mlp_in", h)
            f = layer.ffn(layer.post_attention_layernorm(h))
            self._emit(i, "ffn", f)
            h = h + f
            self._emit(i, "partial", h)
        self._emit(-1, "final_in", h)
        return h

    def _attn_res_stack(self, embed: torch.Tensor, state: "_Segments") -> torch.Tensor:
        """K3: block snapshots of the residual stream, read through learned mixes."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        mix = OPS.attn_res_mix or AttnResRead.mix
        snapshots: list[torch.Tensor] = []
        partial: torch.Tensor | None = embed
        for layer in self.model.layers:
            i = layer.index
            assert partial is not None
            h = (mix(snapshots + [partial], layer.self_attention_res_norm.weight,
                     layer.self_attention_res_proj.weight, eps) if snapshots else partial)
            if i % cfg.attn_res_block_size == 0:        # freeze the block, restart the sum
                snapshots.append(partial)
                partial = None
            self._emit(i, "attn_in", h)
            a = self._mixer(layer, layer.input_layernorm(h), state)
            self._emit(i, "mixer", a)
            partial = a if partial is None else partial + a
            h = mix(snapshots + [partial], layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps)
            self._emit(i, "mlp_in", h)
            f = layer.ffn(layer.post_attention_layernorm(h))
            self._emit(i, "ffn", f)
            partial = partial + f
            self._emit(i, "partial", partial)
        assert partial is not None
        h = mix(snapshots + [partial], self.model.output_attn_res_norm.weight,
                self.model.output_attn_res_proj.weight, eps)
        self._emit(-1, "final_in", h)
        return h


@dataclass
class _Segments:
    """Row ranges [a, b) of the concatenated tokens and the state each range belongs to."""

    bounds: list[tuple[int, int]]
    states: list[RequestState]


def _as_ids(ids: torch.Tensor | list[int], vocab: int) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        ids = torch.tensor(list(ids), dtype=torch.long)
    if ids.dim() != 1:
        raise K3Error(f"input_ids: expected a 1-D tensor of one sequence, got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise K3Error("input_ids: expected at least one token, got an empty sequence")
    if ids.dtype not in (torch.int64, torch.int32):
        raise K3Error(f"input_ids: expected an integer tensor, got {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise K3Error(f"input_ids: expected ids in 0..{vocab - 1}, got {lo if lo < 0 else hi}")
    return ids.long()
