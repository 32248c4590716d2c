"""Questions answered in seconds on the device before (or right after) something is changed. The
first two were left by the fourth H200 release run (golden/reports/gpu-2026-12-02-h200-release-4/):

1. `scaled_mm`: which shapes and scalings torch._scaled_mm accepts there. mla_fp8_prefill_scaled
   raised CUBLAS_STATUS_NOT_SUPPORTED for row-wise e4m3 scales with a bf16 output, even at
   M = N = 1024, K = 192 (K and N padded to 16 as the CPU tests require). Tried: M, N, K over
   multiples of 16 and 128, row-wise and tensor-wise scales, bf16 and fp32 outputs, and scale_a
   starting 0, 4 or 16 bytes into its buffer (the failing calls had head h's scales at h*T*4 bytes,
   T = 107, 375: misaligned; the form now pads T to 4); each cell `ok`, or the error's first line.
2. `kda_fp32`: how far fla's chunk_kda is from fp32 when its inputs are fp32. In fp32 on
   golden/k3-dims, kda_chunked and kda_fla_recurrent both missed their fp32 budget against the
   GPU reference by the same figures (max KL 1.4e-5, final KDA state 4.8e-4 of max), as if the
   reference were the odd one out: its chunk_kda calls tl.dot on fp32 operands, which Triton runs
   in TF32 unless TRITON_F32_DEFAULT=ieee. Measured: chunk_kda and fused_recurrent_kda against a
   float64 recurrence at K3's head dims (K = V = 128), in a child process per TRITON_F32_DEFAULT
   setting (Triton reads it when it compiles, so one process cannot hold both).
3. `router_tiles` (2026-12-07): the fp32 router GEMM ([M, 768] x [32, 768], twelve a k3-small decode
   step) under the batch-invariant Triton GEMM's default tile (61 us at every M on the H200) and under
   the small-N tiles (kernels/gemm/invariant.py SMALL_N_TILES, and candidates beside it): microseconds a
   call (CUDA events, median of 5 rounds of 100 calls), and whether each candidate's output is bitwise
   the default tile's (the FMA-chain argument that makes the change bit-neutral on CUDA).

4. `paged_tiles` (2026-12-07): the paged MLA decode kernel at k3-small's widths (8 heads, nope 128,
   rope 64, Vd 128, latent 512), B = 64 requests of up to 512 keys (lengths drawn at random), bf16: the reference's query tile
   (attention.TILES: 32 rows for one real query) against 16 and 64 rows. Microseconds a call, and
   whether each output is bitwise the reference tile's: if the 16-row tile is, the fast step can take
   it without touching any contract (the kernel took 184 us a call in the B = 64 step, session 23).

    python -m k3verify.perf.gpu_probes --out DIR [--only scaled_mm,kda_fp32,router_tiles,paged_tiles]
Writes DIR/gpu_probes.json (rewritten after each probe). The scaled_mm probe also runs on the CPU
(torch's CPU _scaled_mm takes any shape), kda_fp32 needs CUDA and fla, router_tiles needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from ..io import atomic_write_text

PROBES = ("scaled_mm", "kda_fp32", "router_tiles", "paged_tiles")
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) the router probe tries beside the default and SMALL_N_TILES
# (16, 16, 32, 4, 2) was SMALL_N_TILES until the probe of 2026-12-07 chose (16, 16, 128, 4, 2)
ROUTER_CANDIDATES = ((16, 32, 32, 4, 2), (16, 16, 64, 2, 2), (16, 16, 32, 4, 2), (32, 32, 32, 4, 2))


def router_tile_cells(ms=(64, 256, 2112), k: int = 768, n: int = 32) -> list[dict]:
    """Per M and tile: us a call and whether the output is bitwise the default tile's."""
    from optimized_stack.kernels.gemm import invariant as inv
    tiles = [("default", inv.TILES[torch.float32]), ("small_n", inv.SMALL_N_TILES[torch.float32])]
    tiles += [(f"candidate{i}", t) for i, t in enumerate(ROUTER_CANDIDATES)]
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).cuda()
    out = []
    for m in ms:
        x = torch.randn(m, k, generator=gen).cuda()
        ref = inv.matmul(x, w, _tiles=inv.TILES[torch.float32])
        for name, t in tiles:
            try:
                y = inv.matmul(x, w, _tiles=t)                    # compile and warm
                out.append({"m": m, "tile": name, "config": list(t),
                            "us": _us_a_call(lambda: inv.matmul(x, w, _tiles=t), calls=100),
                            "bitwise_default": bool(torch.equal(y, ref))})
            except Exception as exc:   # noqa: BLE001 - a tile Triton cannot build is a finding, not a crash
                out.append({"m": m, "tile": name, "config": list(t), "error": f"{type(exc).__name__}: {exc}"[:300]})
    return out


def _us_a_call(fn, rounds: int = 5, calls: int = 50) -> float:
    """Median over `rounds` of the CUDA-event time of `calls` calls, in us a call."""
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def paged_tile_cells(batch: int = 64, keys: int = 512, heads: int = 8, nope: int = 128, rope: int = 64,
                     v_dim: int = 128, latent: int = 512, block_size: int = 64, device: str = "cuda") -> list[dict]:
    """Per query-tile height: us a call of the paged decode kernel and whether its output is bitwise
    the reference tile's (attention.TILES), on random pools with each request's blocks scattered."""
    from optimized_stack.kernels.mla.attention import TILES
    from optimized_stack.kernels.mla.paged import paged_decode_attention
    gen = torch.Generator().manual_seed(0)
    per = -(-keys // block_size)
    n_blocks = batch * per
    dt = torch.bfloat16
    rows = torch.randn(n_blocks * block_size, latent + rope, generator=gen).to(dt).to(device)
    kv = torch.randn(n_blocks * block_size, heads * (nope + v_dim), generator=gen).to(dt).to(device)
    tables = torch.randperm(n_blocks, generator=gen).to(torch.int32).view(batch, per).to(device)
    q = torch.randn(batch, heads, nope + rope, generator=gen).to(dt).to(device)
    slot = torch.arange(batch, device=device)
    # each request at its own length (partial last blocks, loops of several lengths), at most `keys`
    pos = torch.randint(1, keys, (batch,), generator=gen).to(device)

    def call(block_m=None):
        return paged_decode_attention(q, rows, kv, tables, slot, pos, (nope + rope) ** -0.5, nope=nope,
                                      v_dim=v_dim, block_size=block_size, _block_m=block_m)
    ref = call()
    out = []
    for block_m in (TILES[dt][0], 16, 64):
        try:
            y = call(block_m)
            cell = {"block_m": block_m, "reference_tile": block_m == TILES[dt][0],
                    "bitwise_reference": bool(torch.equal(y, ref)),
                    "max_abs_diff": float((y - ref).abs().max())}
            if device == "cuda":
                cell["us"] = _us_a_call(lambda: call(block_m))
            out.append(cell)
        except Exception as exc:   # noqa: BLE001 - a tile Triton cannot build is a finding, not a crash
            out.append({"block_m": block_m, "error": f"{type(exc).__name__}: {exc}"[:300]})
    return out


def scaled_mm_cells(device: str) -> list[dict]:
    from optimized_stack.kernels.fp8_rows import quantize_rows
    out = []
    for m, n, k in ((1024, 1024, 192), (1024, 1024, 256), (112, 112, 192), (128, 128, 128), (107, 112, 192),
                    (128, 384, 32), (128, 384, 128)):
        for scaling in ("rowwise", "tensorwise"):
            for out_dtype in (torch.bfloat16, torch.float32):
                cell = {"m": m, "n": n, "k": k, "scaling": scaling, "out": str(out_dtype).replace("torch.", "")}
                try:
                    g = torch.Generator(device="cpu").manual_seed(0)
                    a = torch.randn(m, k, generator=g).to(device)
                    b = torch.randn(n, k, generator=g).to(device)
                    a8, sa = quantize_rows(a, 1, per_tensor=scaling == "tensorwise")
                    b8, sb = quantize_rows(b, 1, per_tensor=scaling == "tensorwise")
                    if scaling == "tensorwise":
                        sa, sb = sa.reshape(-1)[:1].reshape(()), sb.reshape(-1)[:1].reshape(())
                    else:
                        sa, sb = sa.reshape(m, 1).contiguous(), sb.reshape(1, n).contiguous()
                    y = torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
                    ref = (a8.float() * sa.reshape(-1, 1) if sa.dim() else a8.float() * sa) @ \
                          (b8.float() * sb.reshape(-1, 1) if sb.dim() else b8.float() * sb).t()
                    cell.update(status="ok", max_rel=float((y.float() - ref).abs().max() / ref.abs().max()))
                except Exception as exc:   # the probe's answer, not a failure of the probe
                    cell.update(status="error", error=str(exc).splitlines()[0][:300])
                out.append(cell)
    # the alignment hypothesis: row-wise scale_a as a view starting 4 bytes into its buffer (as head
    # 1's did at T = 107 before the padding), against the same values in a fresh tensor
    for offset in (0, 1, 4):
        cell = {"m": 112, "n": 112, "k": 192, "scaling": "rowwise", "out": "bfloat16", "scale_a_offset_floats": offset}
        try:
            a = torch.randn(112, 192).to(device)
            b = torch.randn(112, 192).to(device)
            a8, sa = quantize_rows(a, 1)
            b8, sb = quantize_rows(b, 1)
            buf = torch.empty(offset + 112, 1, device=device)
            buf[offset:] = sa.reshape(112, 1)
            torch._scaled_mm(a8, b8.t(), scale_a=buf[offset:], scale_b=sb.reshape(1, 112).contiguous(),
                             out_dtype=torch.bfloat16)
            cell["status"] = "ok"
        except Exception as exc:
            cell.update(status="error", error=str(exc).splitlines()[0][:300])
        out.append(cell)
    return out


def kda_fp32_child() -> dict:
    """In this process's TRITON_F32_DEFAULT: fla's chunk and recurrent KDA in fp32 against float64."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    torch.manual_seed(0)
    b, t, h, d = 1, 512, 2, 128
    dev = "cuda"
    q = torch.nn.functional.normalize(torch.randn(b, t, h, d, device=dev), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, d, device=dev), dim=-1)
    v = torch.randn(b, t, h, d, device=dev)
    g = -torch.rand(b, t, h, d, device=dev) * 0.1                 # log decay per key channel
    beta = torch.rand(b, t, h, device=dev)
    o_ref, s_ref = recurrence_f64(q, k, v, g, beta)
    out = {"TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT")}
    got = {}
    for name, fn in (("chunk_kda", chunk_kda), ("fused_recurrent_kda", fused_recurrent_kda)):
        o, s = fn(q, k, v, g, beta, scale=d ** -0.5, output_final_state=True)
        got[name] = (o.double(), s.double())
        out[name] = {"out_max_rel": float((o.double() - o_ref).abs().max() / o_ref.abs().max()),
                     "state_max_rel": float((s.double() - s_ref).abs().max() / s_ref.abs().max())}
    # free of any convention the float64 recurrence might get wrong: the two kernels against each other
    (oc, sc), (orr, sr) = got["chunk_kda"], got["fused_recurrent_kda"]
    out["chunk_vs_recurrent"] = {"out_max_rel": float((oc - orr).abs().max() / orr.abs().max()),
                                 "state_max_rel": float((sc - sr).abs().max() / sr.abs().max())}
    return out


def recurrence_f64(q, k, v, g, beta):
    """The gated delta rule per token in float64: S <- diag(exp g) S; S += beta k (v - k^T S); o = q^T S * scale."""
    b, t, h, d = q.shape
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    s = torch.zeros(b, h, d, v.shape[-1], dtype=torch.float64, device=q.device)
    outs = []
    for i in range(t):
        s = s * g[:, i].exp().unsqueeze(-1)
        kv = torch.einsum("bhk,bhkv->bhv", k[:, i], s)
        s = s + beta[:, i, :, None, None] * k[:, i].unsqueeze(-1) * (v[:, i] - kv).unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i] * d ** -0.5, s))
    return torch.stack(outs, 1), s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3verify.perf.gpu_probes", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default=",".join(PROBES))
    ap.add_argument("--kda-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.kda_child:
        print(json.dumps(kda_fp32_child()))
        return 0
    only = [x for x in args.only.split(",") if x]
    bad = [x for x in only if x not in PROBES]
    if bad:
        print(f"error: --only: unknown probe {bad[0]!r} (known: {', '.join(PROBES)})", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    doc: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}

    def save() -> None:
        atomic_write_text(args.out / "gpu_probes.json", json.dumps(doc, indent=1))
    if "scaled_mm" in only:
        doc["scaled_mm"] = scaled_mm_cells(device)
        save()
    if "router_tiles" in only:
        doc["router_tiles"] = router_tile_cells() if device == "cuda" else {"skipped": "needs CUDA"}
        save()
    if "paged_tiles" in only:
        doc["paged_tiles"] = paged_tile_cells() if device == "cuda" else {"skipped": "needs CUDA"}
        save()
    if "kda_fp32" in only:
        if device != "cuda":
            doc["kda_fp32"] = {"skipped": "needs CUDA and fla"}
        else:
            doc["kda_fp32"] = []
            for setting in (None, "tf32", "ieee"):
                env = {k: v for k, v in os.environ.items() if k != "TRITON_F32_DEFAULT"}
                if setting:
                    env["TRITON_F32_DEFAULT"] = setting
                p = subprocess.run([sys.executable, "-m", "k3verify.perf.gpu_probes", "--out", str(args.out),
                                    "--kda-child"], env=env, capture_output=True, text=True, timeout=400)
                last = (p.stdout.strip().splitlines() or [""])[-1]
                doc["kda_fp32"].append(json.loads(last) if p.returncode == 0 and last.startswith("{")
                                       else {"TRITON_F32_DEFAULT": setting, "error": p.stderr.strip()[-600:]})
                save()
    save()
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
