"""The batched decode step: one forward over B running requests, each decoding one token.

    step = DecodeStep(model, store, opts)
    logits, sampled = step.forward(meta)     # meta [4, Bp] int64 on the model's device (batch.py)

What runs (the reference's own primitives wherever a row's bits are its own):
- embeddings, projections, norms, AttnRes reads, the FFN / MoE router, lm_head on the Bp rows
  (row-invariant ops, exactly as model.forward_batch runs them on concatenated segments);
- KDA for all rows over the state pool in place (kda_step.py), MLA over the paged pools
  (mla_step.py), the routed experts on static-capacity buffers (moe_static.py);
- greedy sampling for every row: argmax (first maximum, the sampler's rule) and whether the row
  is finite, so the host reads one [2, Bp] tensor per step.
The layer walk mirrors model.py `_attn_res_stack` / `_plain_stack` line for line (the model's
walk calls its per-segment mixer; this one calls the batched ones). With the reference ops in
the op table nothing reads the device from the host: the forward is CUDA-graph capturable
(`capturable()` says why not otherwise). Probes are not emitted: the engine sends a step to the
reference path while a probe is attached.

Shape letters: Bp padded rows, D hidden, V vocab.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import fields
from typing import Iterator

import torch

from ...config import KDA
from ...kernels.gpu_reference import interpreting
from ...kernels.moe.situ_form import situ_form
from ...model import ops
from ...model.attn_res import AttnResRead
from ...model.ops import OPS, OpTable
from ...toggles import base_form
from .batch import ROW_IDS, ROW_KDA_SLOT, ROW_POS, ROW_TABLE_SLOT, BlockTables
from .kda_step import FAST_KDA_ENV, kda_decode
from .mla_step import PagedMLA, mla_decode, paged_form
from .moe_static import (routed_static, routed_static_fused, routed_static_fused_drop_last,
                         routed_static_fused_slot_order, routed_static_grouped)
from .step_digests import StepDigests

CAPTURABLE_EXPERTS = (None, routed_static, routed_static_grouped, routed_static_fused, routed_static_fused_slot_order,
                      routed_static_fused_drop_last)
ENV_CHOICES = (ops.GPU_PROFILE_ENV, "K3_GPU_GEMM", "K3_GPU_KDA", FAST_KDA_ENV)


def op_fingerprint() -> tuple:
    """What the step's Python dispatch depends on: every op-table slot and the env choices the
    GPU profile reads at call time. A captured graph is valid only under the same fingerprint."""
    return (tuple(id(getattr(OPS, f.name)) for f in fields(OpTable))
            + tuple(os.environ.get(k) for k in ENV_CHOICES))


class DecodeStep:
    def __init__(self, model, store, opts):
        self.model = model
        self.cfg = model.config
        mla, pool = store.mla, store.pool
        if mla.kv is None:
            raise ValueError("the batched decode step needs the projected K/V cache (projected_kv_cache)")
        if not pool.spare or not mla.spare_blocks:
            raise ValueError("the batched decode step needs a spare KDA slot and a spare MLA block for padding")
        self.block_size = mla.block_size
        self.kda = {i: pool.pools[i] for i in store.kda_layers}                 # layer -> name -> [P, ...]
        self.mla = {i: PagedMLA(mla.rows[i], mla.kv[i], mla.block_size) for i in store.mla_layers}
        self.spare_slot = pool.slots
        self.tables = BlockTables(pool.slots + pool.spare, self.spare_slot, mla.num_blocks,
                                  mla.num_blocks, model.device)
        self.conv_wrong_row = "mut_fast_conv_wrong_row" in opts.faults
        self.stale_value_tiles = "mut_fast_kda_stale_value_tiles" in opts.faults
        # fused_kda_conv: the KDA conv as one Triton launch per conv (kernels/kda/conv_step.py). Its
        # bit-for-bit argument needs a narrower dtype: an fp32 model keeps conv_step, the toggle's
        # event stays silent (verdict: not exercised), and the counted stack, which holds the toggle
        # on every CUDA run, still serves it.
        narrow = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
        self.fused_conv = narrow and ("stale_window" if "mut_fused_conv_stale_window" in opts.faults
                                      else opts.fused_kda_conv)
        # fused_moe_combine: the static experts' combine as one Triton launch (kernels/moe/combine.py)
        self.combine = (routed_static_fused_slot_order if "mut_fused_combine_slot_order" in opts.faults
                        else routed_static_fused_drop_last if "mut_fused_combine_drops_last" in opts.faults
                        else routed_static_fused if opts.fused_moe_combine else routed_static)
        if (self.fused_conv or self.combine is not routed_static) and model.device.type != "cuda" \
                and not interpreting():
            raise ValueError("fused_kda_conv and fused_moe_combine are Triton kernels: they need a CUDA model "
                             "(or TRITON_INTERPRET=1)")
        # fused_situ: the experts' SiTU-GLU as one Triton launch (kernels/moe/situ.py) where the step's
        # tensors are on CUDA; a CPU model keeps the torch form and the event stays silent
        situ = situ_form(opts.faults, self._situ_ran) if opts.fused_situ else None
        self.experts = self.combine if situ is None else functools.partial(self.combine, _situ=situ)
        self.combine_fused = False    # whether the last traced forward ran the fused combine (its event)
        self.situ_fused = False       # ... and the fused SiTU-GLU (its event)
        # an observer's digests taken inside the step (step_digests.py); set by the engine, None: off
        self.digests: StepDigests | None = None

    # ---- capturability -------------------------------------------------------------------
    def capturable(self) -> str | None:
        """None when the forward has no host sync and static shapes under the ops in force, else why."""
        if self.model.device.type != "cuda":
            return "CUDA graphs need a CUDA model"
        from ...kernels import gpu_reference
        if ops.gpu_reference() is not gpu_reference:
            return f"{ops.GPU_PROFILE_ENV}=torch: the decode ops run one request at a time"
        if OPS.kda_decode is not None:
            # its rows form (kda_step.ROW_FORMS) is fla's Python entry point, not checked for host syncs
            return "a KDA decode op in the op table (its rows form, or one request at a time) is not captured"
        if (OPS.attention is not None or OPS.mla_decode is not None) and paged_form() is None:
            return "an MLA attention op without a paged form runs one request at a time"
        if base_form(OPS.moe_experts) not in CAPTURABLE_EXPERTS:
            return f"routed experts {getattr(OPS.moe_experts, '__name__', OPS.moe_experts)!r} have data-dependent shapes"
        if OPS.moe_block is not None:
            return "a MoE block op in the op table (side stream) is not captured"
        return None

    # ---- the forward ---------------------------------------------------------------------
    def _situ_ran(self, rows: int) -> None:
        self.situ_fused = True

    @contextlib.contextmanager
    def _static_experts(self) -> Iterator[None]:
        self.situ_fused = False                      # set again by the fused activation's call
        if OPS.moe_experts is not None:              # a toggle's experts win (grouped, a mutant)
            self.combine_fused = False
            yield
            return
        self.combine_fused = self.combine is not routed_static
        with ops.override(moe_experts=self.experts):
            yield

    @torch.no_grad()
    def forward(self, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """meta [4, Bp] int64 on the device -> (logits [Bp, V] fp32, sampled [2, Bp] int64:
        the greedy token and 1 where the row is finite)."""
        self._batch = (meta[ROW_POS], meta[ROW_KDA_SLOT], meta[ROW_TABLE_SLOT])
        with self._static_experts():
            x = self.model.model.embed_tokens(meta[ROW_IDS])                    # [Bp, D]
            h = self._plain_stack(x) if self.cfg.attn_res_block_size is None else self._attn_res_stack(x)
            h = self.model.model.norm(h)
            logits = OPS.linear(h, self.model.lm_head.weight).float()           # [Bp, V]
        sampled = torch.stack([logits.argmax(-1), torch.isfinite(logits).all(-1).long()])
        return logits, sampled

    @torch.no_grad()
    def forward_words(self, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """forward(meta) and the observer's words of the step's rows and states: (logits, sampled,
        words [len(digests.layout), Bp, W]), all of it one capturable sequence of launches."""
        assert self.digests is not None, "forward_words needs the engine's step digests"
        logits, sampled = self.forward(meta)
        return logits, sampled, self.digests.words(logits, meta[ROW_KDA_SLOT])

    def _mixer(self, layer, x: torch.Tensor) -> torch.Tensor:
        pos, kda_slot, table_slot = self._batch
        if layer.kind == KDA:
            return kda_decode(layer.self_attn, x, self.kda[layer.index], kda_slot,
                              conv_wrong_row=self.conv_wrong_row,
                              stale_value_tiles=self.stale_value_tiles, fused_conv=self.fused_conv)
        return mla_decode(layer.self_attn, x, self.mla[layer.index], self.tables.tables, table_slot, pos)

    def _plain_stack(self, h: torch.Tensor) -> torch.Tensor:
        """model.py _plain_stack."""
        for layer in self.model.model.layers:
            h = h + self._mixer(layer, layer.input_layernorm(h))
            h = h + layer.ffn(layer.post_attention_layernorm(h))
        return h

    def _attn_res_stack(self, embed: torch.Tensor) -> torch.Tensor:
        """model.py _attn_res_stack."""
        cfg, model = self.cfg, self.model.model
        eps = cfg.rms_norm_eps
        mix = OPS.attn_res_mix or AttnResRead.mix
        snapshots: list[torch.Tensor] = []
        partial: torch.Tensor | None = embed
        for layer in model.layers:
            assert partial is not None
            h = (mix(snapshots + [partial], layer.self_attention_res_norm.weight,
                     layer.self_attention_res_proj.weight, eps) if snapshots else partial)
            if layer.index % cfg.attn_res_block_size == 0:
                snapshots.append(partial)
                partial = None
            a = self._mixer(layer, layer.input_layernorm(h))
            partial = a if partial is None else partial + a
            h = mix(snapshots + [partial], layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps)
            partial = partial + layer.ffn(layer.post_attention_layernorm(h))
        assert partial is not None
        return mix(snapshots + [partial], model.output_attn_res_norm.weight, model.output_attn_res_proj.weight, eps)


__all__ = ["BlockTables", "DecodeStep", "op_fingerprint"]
