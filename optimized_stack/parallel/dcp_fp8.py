"""The DCP prefill context all-gathered in FP8 (toggle dcp_fp8_allgather).

Under decode context parallelism (option dcp_mla) rank r keeps the MLA cache rows of
positions p with p % W == r. A prefill call (more than one query) here gathers the whole
context instead of merging partial attentions: every rank quantizes its rows to e4m3 with
one scale per row (kernels/fp8_rows.py), the bytes and the scales are all-gathered, every
rank dequantizes and re-interleaves them into position order, and attends its own heads over
the full context as the non-DCP path does. Half the bytes of a bf16 gather, a quarter of fp32.

What it covers, exactly: the rows this call attends over (the history already stored and
this call's new rows, each on the rank that stores it), gathered once per MLA layer per
prefill call. The stored cache keeps its full-precision rows; only the gathered copy is
FP8. Decode steps (one query) keep the dcp_mla log-sum-exp merge, which exchanges partial
outputs, never K/V.
Shape letters: S rows, S_r this rank's rows, R row width (latent | rope).
"""
from __future__ import annotations

import torch

from ..kernels.fp8_rows import E4M3, dequantize, quantize_rows
from .launch import Comm

def gather_context_fp8(shard: torch.Tensor, n_rows: int, comm: Comm, faults=frozenset()) -> torch.Tensor:
    """This rank's rows [S_r, R] (positions rank, rank + W, ...) -> all n_rows rows [S, R]
    fp32 in position order, every rank's rows through e4m3 + per-row scale. `faults`: the TP
    seeded faults "dcp_fp8_dequant_scale_x2" (the mutant) and "dcp_fp8_per_tensor" (one scale
    per shard: the tests' negative control of per-row scaling)."""
    w = comm.world_size
    sizes = [len(range(r, n_rows, w)) for r in range(w)]
    q, scale = quantize_rows(shard, 1, per_tensor="dcp_fp8_per_tensor" in faults)
    scale = scale.expand(shard.shape[0], 1).contiguous()          # [S_r, 1] (per-tensor: one, repeated)
    if "dcp_fp8_dequant_scale_x2" in faults:
        scale = scale * 2.0
    # gloo has no float8 reduction types; the gather moves bytes, so send them as uint8
    q_parts = comm.gather_parts(q.view(torch.uint8), sizes, 0)
    s_parts = comm.gather_parts(scale, sizes, 0)
    full = torch.empty(n_rows, shard.shape[1], dtype=torch.float32, device=shard.device)
    for r, (qp, sp) in enumerate(zip(q_parts, s_parts)):
        full[r::w] = dequantize(qp.view(E4M3), sp)
    return full
