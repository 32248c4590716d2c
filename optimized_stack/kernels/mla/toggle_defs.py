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
    ops={"mla_prefill": mla_absorbed, "mla_decode": mla_absorbed}, phases=("decode",),
    events=("op:mla_prefill", "op:mla_decode")))

register(Toggle(
    name="mla_sdpa", contract=APPROX_KERNEL, touches=("logits",),
    description="MLA causal softmax in torch's fused SDPA kernel (O(T) memory; long prefills on CPU)",
    ops={"attention": sdpa_attention}, phases=("prefill",), events=("op:attention",)))

_wrong_scale = functools.partial(mla_absorbed, _scale_mult=24 ** -0.5)
register(Toggle(
    name="mut_mla_absorbed_scale", kind="mutant", mutant_of="mla_absorbed", contract=APPROX_KERNEL,
    touches=("logits",), description="absorbed MLA with the softmax scale applied twice",
    caught_by=("drift_budget",), lives_in="mla/mixer",
    ops={"mla_prefill": _wrong_scale, "mla_decode": _wrong_scale}, events=("op:mla_prefill", "op:mla_decode")))

# the same fault on one slot each: the negative controls of the two slots' events (a scenario
# without decode steps leaves op:mla_decode unfired, a one-token prompt op:mla_prefill). The
# decode-slot one has no lives_in: localisation replays whole-prompt forwards (k3verify/localize.py),
# which never call the decode slot, so it cannot name the mixer; caught is what it proves.
for _slot in ("mla_prefill", "mla_decode"):
    register(Toggle(
        name=f"mut_mla_absorbed_{_slot.split('_')[1]}_scale", kind="mutant", mutant_of="mla_absorbed",
        contract=APPROX_KERNEL, touches=("logits",), caught_by=("drift_budget",),
        lives_in="mla/mixer" if _slot == "mla_prefill" else None,
        description=f"absorbed MLA in the {_slot} slot only, with the softmax scale applied twice",
        ops={_slot: _wrong_scale}, events=(f"op:{_slot}",)))

register(Toggle(
    name="mut_mla_sdpa_mask_leaks_next", kind="mutant", mutant_of="mla_sdpa", contract=APPROX_KERNEL,
    touches=("logits",), description="SDPA attention mask off by one: each query also sees the next key",
    caught_by=("drift_budget",), lives_in="mla/mixer",
    ops={"attention": functools.partial(sdpa_attention, _mask_leaks_next=True)}, events=("op:attention",)))
