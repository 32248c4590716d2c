"""MLA kernel toggles (absorbed attention over latent rows, torch's fused SDPA) and their mutant."""
from __future__ import annotations

import functools

from ...toggles import Toggle, register
from ..kda.toggle_defs import APPROX_KERNEL
from .absorbed import mla_absorbed
from .sdpa import sdpa_attention

register(Toggle(
    name="mla_absorbed", contract=APPROX_KERNEL, touches=("logits",),
    description="MLA attention over latent cache rows with kv_b_proj absorbed into q and "
                "the output (reads each row once; no K/V decompression)",
    ops={"mla_prefill": mla_absorbed, "mla_decode": mla_absorbed}, phases=("decode",)))

register(Toggle(
    name="mla_sdpa", contract=APPROX_KERNEL, touches=("logits",),
    description="MLA causal softmax in torch's fused SDPA kernel (O(T) memory; long prefills on CPU)",
    ops={"attention": sdpa_attention}, phases=("prefill",)))

_wrong_scale = functools.partial(mla_absorbed, _scale_mult=24 ** -0.5)
register(Toggle(
    name="mut_mla_absorbed_scale", kind="mutant", mutant_of="mla_absorbed", contract=APPROX_KERNEL,
    touches=("logits",), description="absorbed MLA with the softmax scale applied twice",
    caught_by=("drift_budget",), lives_in="mla/mixer",
    ops={"mla_prefill": _wrong_scale, "mla_decode": _wrong_scale}))
