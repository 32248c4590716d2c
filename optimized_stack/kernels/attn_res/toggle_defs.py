"""The AttnRes read's seeded fault (its reference is model/attn_res.py; no fast form yet)."""
from __future__ import annotations

from ...model.attn_res import AttnResRead
from ...toggles import EXACT, Toggle, register


def _mix_dropping_first_snapshot(candidates, norm_w, proj_w, eps):
    """Fault: once two snapshots exist, the oldest (the embeddings) is dropped from the mix."""
    if len(candidates) >= 3:
        candidates = candidates[1:]
    return AttnResRead.mix(candidates, norm_w, proj_w, eps)


register(Toggle(
    name="mut_attnres_drop_snapshot", kind="mutant", contract=EXACT, touches=("logits",),
    description="AttnRes read drops the oldest block snapshot once two exist",
    caught_by=("logits",), lives_in="attn_res/mlp_in", ops={"attn_res_mix": _mix_dropping_first_snapshot},
    events=("op:attn_res_mix",)))
