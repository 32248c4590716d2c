"""MLA prefill attention with Q K^T as a row-scaled FP8 GEMM (toggle mla_fp8_prefill_scaled).

Same contract as the op-table slot `mla_prefill` (model/mla.py MLAttention.attend, called for
calls of more than one query; decode keeps its own slot and is untouched): (layer, q [T, H, C],
rows [S, R], q_pos [T]) -> [T, H, Vd] fp32. The rows are decompressed as in the reference; Q
and K go to e4m3 with one fp32 scale per (token, head) row (kernels/fp8_rows.py quantize_rows),
and each head's scores are one scaled FP8 GEMM:

    s_h [t, S'] = torch._scaled_mm(q8_h [t, C'], k8_h [S', C'].t(),
                                   scale_a=q scales [t, 1], scale_b=k scales [1, S'], out_dtype=bf16)
    s_h[i, j]   = bf16(scale_a[i] * scale_b[j] * sum_c q8[i, c] * k8[j, c])

A per-row scale of Q is a per-row scale of the GEMM's output and a per-row scale of K a
per-column one, so the row-wise form applies them exactly; the only rounding it adds to
mla_fp8_prefill (the cast form: the same e4m3 values, scores in fp32) is the bf16 output of
each score, at most 2^-8 of it (bf16 keeps 8 significant bits), and its accumulation order.
Row-wise scaling writes bf16 on the H200 (torch checks it); fp32 scores would need per-tensor
scales. Then, in fp32: the softmax scale 1/sqrt(C), the causal mask by q_pos, the softmax, and
P @ V with V through e4m3 and back as in mla_fp8_prefill.

Shape rules (CUDA's _scaled_mm, aten/src/ATen/native/cuda/ScaledBlas.cpp; the CPU one, torch
2.13, takes any shape): K (here C) and N (here the keys) multiples of 16, M (queries) free; a
row-major, b column-major; scales fp32 and contiguous. C and the keys are zero-padded to
multiples of 16 before quantizing: a zero column adds an exact 0 to every dot product and a
zero key row only makes score columns that are sliced off before the mask, so padding changes
no bit (tests/test_mla_fp8_scaled.py). It runs on every device, so the CPU tests run the
shapes the H200 sees.

Memory: queries in blocks of QUERY_BLOCK, each against the keys up to its last position
(masked keys add exp(-inf) = 0, so skipping them is exact): [t, S] per head at a time, never
[H, T, S].
Shape letters: T queries, S cache rows (keys), H heads, C qk head dim, Vd v head dim, R row width;
C' and S' padded to multiples of 16, t a block of queries.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fp8_rows import FAULTS, fp8_roundtrip, quantize_rows

QUERY_BLOCK = 1024       # queries a block: [1024, 32768] fp32 scores are 128 MiB a head
GEMM_ALIGN = 16          # CUDA _scaled_mm: K and N multiples of 16


def _round_up(n: int) -> int:
    return -(-n // GEMM_ALIGN) * GEMM_ALIGN


def fp8_scaled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                         scale: float, *, fault: str | None = None,
                         query_block: int = QUERY_BLOCK) -> torch.Tensor:
    """Causal softmax attention with FP8 scores. q [T, H, C], k [S, H, C], v [S, H, Vd], q_pos [T]
    (query t sees keys 0..q_pos[t]) -> [T, H, Vd] fp32 (blocked_attention's signature).

    `fault` is a seeded mutant's (kernels/fp8_rows.py FAULTS), on this form's operands:
    "per_tensor" one scale for each of Q, K and V; "row_shifted_scale" scale_b shifted by one key
    (key j read with key j-1's scale, key 0 with the last key's); "dequant_scale_x2" every scale
    doubled (scale_a, scale_b and V's)."""
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"fp8 fault must be one of {FAULTS}, got {fault!r}")
    if query_block < 1:
        raise ValueError(f"query_block must be >= 1, got {query_block}")
    t_len, h, c = q.shape
    s_len, vd = k.shape[0], v.shape[-1]
    c_pad, s_pad = _round_up(c) - c, _round_up(s_len) - s_len
    per_tensor = fault == "per_tensor"
    # pad before quantizing: zeros move no row's amax, so the e4m3 values and scales are unchanged
    q8, q_scale = quantize_rows(F.pad(q.float(), (0, c_pad)), 2, per_tensor=per_tensor)        # [T, H, C'], [T, H, 1]
    k8, k_scale = quantize_rows(F.pad(k.float(), (0, c_pad, 0, 0, 0, s_pad)), 2,
                                per_tensor=per_tensor)                                        # [S', H, C'], [S', H, 1]
    if per_tensor:      # one scale broadcast over the rows: _scaled_mm's row-wise form wants one a row
        q_scale, k_scale = q_scale.expand(t_len, h, 1), k_scale.expand(s_len + s_pad, h, 1)
    if fault == "row_shifted_scale":
        k_scale = torch.cat([k_scale[:s_len].roll(1, 0), k_scale[s_len:]])
    elif fault == "dequant_scale_x2":
        q_scale, k_scale = q_scale * 2.0, k_scale * 2.0
    # V's per-row scales run along P @ V's contraction (the keys), where a GEMM applies no scale
    # (row-wise scales are per output row and column), so V cannot be a _scaled_mm operand with
    # its own row scales: it is stored in e4m3 and read back in fp32, as in mla_fp8_prefill.
    v_fault = None if fault == "row_shifted_scale" else fault          # that fault is scale_b's alone
    v8 = fp8_roundtrip(v, row_dims=2, fault=v_fault).permute(1, 0, 2)                        # [H, S, Vd]
    q8 = q8.permute(1, 0, 2).contiguous()                               # [H, T, C']: a head's block is row-major
    k8 = k8.permute(1, 0, 2).contiguous()                               # [H, S', C']: .t() is column-major
    # each head's scale vectors start 16-byte aligned: T padded to a multiple of 4 fp32 (S' already is
    # one of 16). Why: on the H200 (torch 2.11, CUDA 13: row-wise scales through cuBLASLt) the fourth
    # release run got CUBLAS_STATUS_NOT_SUPPORTED at prompt lengths like 107 and 375, where head h's
    # scale_a started h*T*4 bytes in; a hypothesis (perf/gpu_probes.py's misaligned-scale cells test
    # it), and harmless either way: the padding rows are never read
    q_scale = F.pad(q_scale.permute(1, 0, 2), (0, 0, 0, -t_len % 4)).contiguous()   # [H, T4, 1]
    k_scale = k_scale.permute(1, 2, 0).contiguous()                     # [H, 1, S']
    out = torch.empty(t_len, h, vd, dtype=torch.float32, device=q.device)
    for q0 in range(0, t_len, query_block):
        pos = q_pos[q0:q0 + query_block]                                # [t]
        n_keys = int(pos.max()) + 1                                     # the block sees keys 0..n_keys-1
        n_gemm = min(_round_up(n_keys), s_len + s_pad)
        visible = torch.arange(n_keys, device=q.device).view(1, -1) <= pos.view(-1, 1)   # [t, n]
        for head in range(h):
            s = torch._scaled_mm(q8[head, q0:q0 + query_block], k8[head, :n_gemm].t(),
                                 scale_a=q_scale[head, q0:q0 + pos.shape[0]], scale_b=k_scale[head, :, :n_gemm],
                                 out_dtype=torch.bfloat16)              # [t, n_gemm]
            s = s[:, :n_keys].float() * scale
            p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)           # [t, n]; key 0 always visible
            out[q0:q0 + query_block, head] = p @ v8[head, :n_keys]                        # [t, Vd]
    return out


def mla_fp8_prefill_scaled(layer, q: torch.Tensor, rows: torch.Tensor, q_pos: torch.Tensor, *,
                           _fault: str | None = None, _query_block: int = QUERY_BLOCK) -> torch.Tensor:
    """`_fault` is a seeded mutant's (fp8_scaled_attention says what each does to this form)."""
    k, v = layer.decompress(rows)                                       # [S, H, C], [S, H, Vd]
    return fp8_scaled_attention(q, k, v, q_pos, layer.cfg.qk_head_dim ** -0.5, fault=_fault,
                                query_block=_query_block)
