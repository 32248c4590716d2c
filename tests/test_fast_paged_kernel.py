"""The paged MLA decode kernel (optimized_stack/kernels/mla/paged.py) against the contiguous
reference kernel (kernels/mla/attention.py causal_attention) on each request's decompressed
K/V: bit for bit, over shuffled block tables, block sizes 16 / 64 / 128 and lengths around the
64-key blocks, in fp32 and bf16, with padding rows on a spare slot. Negative control: reading
the table one block off must change the bits. On the CPU this runs through Triton's interpreter
(`make triton-venv`, TRITON_INTERPRET=1); on a GPU natively (scripts/gpu_engine_bench.sh).
Also the CPU form of the same attention (engine/fast/paged_attention.py) on the same pools."""
from __future__ import annotations

import pytest
import torch

from triton_env import DEVICE, MARKS, bit_equal, max_rel

pytestmark = MARKS

H, NOPE, ROPE, VD, LAT = 2, 16, 8, 16, 16          # k3-mini's MLA widths
C = NOPE + ROPE


def _pools(lengths, block_size, dtype, seed=0):
    """Random cache rows and projected K/V for requests of the given lengths, their blocks
    scattered through the pool; returns (rows [N*bs, R], kv [N*bs, W], tables [slots, P], slots)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    n_blocks = sum(need) + 3                                   # a few blocks nobody owns
    perm = torch.randperm(n_blocks, generator=gen).tolist()
    max_blocks = max(need) + 1
    spare_block = n_blocks
    rows = torch.randn((n_blocks + 1) * block_size, LAT + ROPE, generator=gen).to(dtype)
    kv = torch.randn((n_blocks + 1) * block_size, H * (NOPE + VD), generator=gen).to(dtype)
    tables = torch.full((len(lengths) + 1, max_blocks), spare_block, dtype=torch.int32)
    at = 0
    for r, k in enumerate(need):
        tables[r, :k] = torch.tensor(perm[at:at + k], dtype=torch.int32)
        at += k
    return rows.to(DEVICE), kv.to(DEVICE), tables.to(DEVICE)


def _decompressed(rows, kv, table, n, block_size):
    p = torch.arange(n, device=rows.device)
    flat = table[p // block_size].long() * block_size + p % block_size
    kv3 = kv[flat].view(n, H, NOPE + VD)
    k = torch.cat([kv3[..., :NOPE], rows[flat][:, LAT:].unsqueeze(1).expand(-1, H, -1)], -1)
    return k.contiguous(), kv3[..., NOPE:].contiguous()


CASES = [((1,), 64), ((5, 64, 65, 130), 64), ((63, 1, 129, 200), 16), ((70, 128, 3), 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths,block_size", CASES, ids=[f"{'-'.join(map(str, l))}-bs{b}" for l, b in CASES])
def test_paged_kernel_equals_the_reference_kernel_per_request(lengths, block_size, dtype):
    from optimized_stack.kernels.mla.attention import causal_attention
    from optimized_stack.kernels.mla.paged import paged_decode_attention
    rows, kv, tables = _pools(lengths, block_size, dtype)
    gen = torch.Generator().manual_seed(1)
    n_real = len(lengths)
    pad = 2                                                    # padding rows: spare slot, position 0
    q = torch.randn(n_real + pad, H, C, generator=gen).to(dtype).to(DEVICE)
    slot = torch.tensor(list(range(n_real)) + [n_real] * pad, device=DEVICE)
    pos = torch.tensor([n - 1 for n in lengths] + [0] * pad, device=DEVICE)
    out = paged_decode_attention(q, rows, kv, tables, slot, pos, C ** -0.5, nope=NOPE, v_dim=VD,
                                 block_size=block_size)
    for b, n in enumerate(lengths):
        k, v = _decompressed(rows, kv, tables[b], n, block_size)
        ref = causal_attention(q[b:b + 1], k, v, pos[b:b + 1], C ** -0.5)
        assert bit_equal(out[b:b + 1], ref), f"request {b} (length {n}): paged != reference kernel"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_lowp_form_equals_the_flash_bf16_call_per_request(dtype):
    """lowp_pv (the mla_flash_bf16 toggle's batched decode, engine/fast/mla_step.py): request b's bits
    are those of causal_attention(..., lowp_pv=True) on its own keys; control: the reference's fp32
    P @ V gives other bits on the same inputs, so the comparison can tell the two forms apart."""
    from optimized_stack.kernels.mla.attention import causal_attention
    from optimized_stack.kernels.mla.paged import paged_decode_attention
    lengths, block_size = (5, 64, 65, 130), 16
    rows, kv, tables = _pools(lengths, block_size, dtype, seed=4)
    q = torch.randn(len(lengths), H, C, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    slot = torch.arange(len(lengths), device=DEVICE)
    pos = torch.tensor([n - 1 for n in lengths], device=DEVICE)
    args = (q, rows, kv, tables, slot, pos, C ** -0.5)
    low = paged_decode_attention(*args, nope=NOPE, v_dim=VD, block_size=block_size, lowp_pv=True)
    ieee = paged_decode_attention(*args, nope=NOPE, v_dim=VD, block_size=block_size)
    for b, n in enumerate(lengths):
        k, v = _decompressed(rows, kv, tables[b], n, block_size)
        want = causal_attention(q[b:b + 1], k, v, pos[b:b + 1], C ** -0.5, lowp_pv=True)
        assert bit_equal(low[b:b + 1], want), f"request {b} (length {n}): paged lowp != the toggle's call"
    assert not bit_equal(low, ieee), "lowp_pv changed no bit: the mode never reached the kernel"


def test_negative_control_a_table_read_one_block_off_is_caught():
    from optimized_stack.kernels.mla.attention import causal_attention
    from optimized_stack.kernels.mla.paged import paged_decode_attention
    lengths, block_size = (130, 70), 64
    rows, kv, tables = _pools(lengths, block_size, torch.float32)
    q = torch.randn(2, H, C, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    slot, pos = torch.tensor([0, 1], device=DEVICE), torch.tensor([129, 69], device=DEVICE)
    out = paged_decode_attention(q, rows, kv, tables, slot, pos, C ** -0.5, nope=NOPE, v_dim=VD,
                                 block_size=block_size, _shift_table=1)
    k, v = _decompressed(rows, kv, tables[0], 130, block_size)
    assert not bit_equal(out[:1], causal_attention(q[:1], k, v, pos[:1], C ** -0.5)), \
        "a shifted table gave the reference's bits: the comparison proves nothing"


def test_the_cpu_form_reads_the_same_pools():
    """engine/fast's CPU form over the same pools == blocked_attention per request (bitwise), and
    the kernel == it to fp32 rounding (the kernel's dots are not the CPU's sums)."""
    from optimized_stack.engine.fast.paged_attention import paged_attention_cpu
    from optimized_stack.kernels.mla.paged import paged_decode_attention
    from optimized_stack.model.mla import blocked_attention
    lengths, block_size = (5, 64, 65, 130), 16
    rows, kv, tables = _pools(lengths, block_size, torch.float32)
    q = torch.randn(4, H, C, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    slot = torch.arange(4, device=DEVICE)
    pos = torch.tensor([n - 1 for n in lengths], device=DEVICE)
    cpu = paged_attention_cpu(q.cpu(), rows.cpu(), kv.cpu(), tables.cpu()[:4], pos.cpu(), C ** -0.5,
                              nope=NOPE, v_dim=VD, block_size=block_size)
    for b, n in enumerate(lengths):
        k, v = _decompressed(rows.cpu(), kv.cpu(), tables.cpu()[b], n, block_size)
        assert torch.equal(cpu[b:b + 1], blocked_attention(q.cpu()[b:b + 1], k, v, pos.cpu()[b:b + 1], C ** -0.5))
    kern = paged_decode_attention(q, rows, kv, tables, slot, pos, C ** -0.5, nope=NOPE, v_dim=VD,
                                  block_size=block_size).cpu()
    assert (kern - cpu).abs().max() <= 2e-6 * cpu.abs().max()


@pytest.mark.parametrize("bad, match", [
    ("q2d", r"q must be 3-D \[B, H, C\], got shape \[2, 24\]"),
    ("kv_width", r"kv must be \[.*, H\*\(nope\+Vd\)\] = \[.*, 64\], got shape \[.*, 60\]"),
    ("pos_len", r"pos must be 1-D \[B\] = \[2\], got shape \[3\]"),
    ("slot_float", r"slot must be int32 or int64, got torch.float32"),
    ("rows_dtype", r"rows and kv must have q's dtype torch.float32, got torch.bfloat16 and torch.float32"),
])
def test_bad_input_is_refused_in_one_line(bad, match):
    from optimized_stack.errors import K3Error
    from optimized_stack.kernels.mla.paged import paged_decode_attention
    rows, kv, tables = _pools((10, 20), 16, torch.float32)
    q = torch.zeros(2, H, C, device=DEVICE)
    slot, pos = torch.tensor([0, 1], device=DEVICE), torch.tensor([9, 19], device=DEVICE)
    args = dict(q=q, rows=rows, kv=kv, tables=tables, slot=slot, pos=pos)
    if bad == "q2d":
        args["q"] = q[:, 0]
    elif bad == "kv_width":
        args["kv"] = kv[:, :60]
    elif bad == "pos_len":
        args["pos"] = torch.tensor([1, 2, 3], device=DEVICE)
    elif bad == "slot_float":
        args["slot"] = slot.float()
    elif bad == "rows_dtype":
        args["rows"] = rows.bfloat16()
    with pytest.raises(K3Error, match=match):
        paged_decode_attention(**args, scale=1.0, nope=NOPE, v_dim=VD, block_size=16)


# ---- the absorbed form (kernels/mla/paged_absorbed.py): approx, batch-invariant ------------------
def _absorbed64(q_lat, q_rope, rows, table, n, block_size, scale):
    p = torch.arange(n, device=rows.device)
    flat = table[p // block_size].long() * block_size + p % block_size
    r = rows[flat].double().cpu()
    s = (torch.einsum("hl,sl->hs", q_lat.double().cpu(), r[:, :LAT])
         + torch.einsum("hr,sr->hs", q_rope.double().cpu(), r[:, LAT:])) * scale
    return torch.einsum("hs,sl->hl", torch.softmax(s, -1), r[:, :LAT])


@pytest.mark.parametrize("lengths,block_size", CASES, ids=[f"{'-'.join(map(str, l))}-bs{b}" for l, b in CASES])
def test_paged_absorbed_matches_fp64_and_is_batch_invariant(lengths, block_size):
    from optimized_stack.kernels.mla.paged_absorbed import paged_absorbed_attention
    rows, _, tables = _pools(lengths, block_size, torch.float32)
    gen = torch.Generator().manual_seed(4)
    n = len(lengths)
    q_lat = torch.randn(n + 1, H, LAT, generator=gen).to(DEVICE)
    q_rope = torch.randn(n + 1, H, ROPE, generator=gen).to(DEVICE)
    slot = torch.tensor(list(range(n)) + [n], device=DEVICE)          # one padding row on the spare slot
    pos = torch.tensor([m - 1 for m in lengths] + [0], device=DEVICE)
    out = paged_absorbed_attention(q_lat, q_rope, rows, tables, slot, pos, C ** -0.5, block_size=block_size)
    for b, m in enumerate(lengths):
        want = _absorbed64(q_lat[b], q_rope[b], rows, tables[b], m, block_size, C ** -0.5)
        assert max_rel(out[b], want) <= 2e-6, f"request {b} (length {m})"
        alone = paged_absorbed_attention(q_lat[b:b + 1], q_rope[b:b + 1], rows, tables, slot[b:b + 1], pos[b:b + 1],
                                         C ** -0.5, block_size=block_size)
        assert bit_equal(alone, out[b:b + 1]), f"request {b}: alone != in the batch"


def test_the_probes_query_tiles_run_and_agree_to_rounding():
    """perf/gpu_probes.py paged_tiles at k3-mini's widths: every query-tile height builds and gives the
    reference tile's output to fp32 rounding (bitwise on the device is the probe's question; the
    interpreter's dot is numpy's). The reference tile's own row is its identity."""
    from k3verify.perf.gpu_probes import paged_tile_cells
    cells = paged_tile_cells(batch=3, keys=70, heads=H, nope=NOPE, rope=ROPE, v_dim=VD, latent=LAT,
                             block_size=16, device=DEVICE)
    assert [c["block_m"] for c in cells][1:] == [16, 64] and all("error" not in c for c in cells), cells
    assert cells[0]["reference_tile"] and cells[0]["bitwise_reference"] and cells[0]["max_abs_diff"] == 0.0
    assert all(c["max_abs_diff"] < 1e-2 for c in cells), cells
