"""The FP8 toggles' ops timed against the reference ops they replace (issue 28 item 1).

    python -m k3verify.perf.fp8_bench --out DIR                # CUDA: k3-small bf16, T = 4096, 32768
    python -m k3verify.perf.fp8_bench --out DIR --smoke        # tiny shapes on the CPU (or CUDA): the test

One MLA layer and one MoE layer of the preset model (load_model, bf16), their inputs made by the
layers' own projections of x ~ N(0, 1) [T, D] (the scale of an RMS-normed hidden state). Cells,
per prompt length T in --lengths:
- mla_prefill (q [T, H, C] over the T cache rows [T, R], q_pos 0..T-1): `reference` is the op
  table's default for the slot (MLAttention.attend with OPS.mla_prefill unset: decompress, then
  blocked_attention, on CUDA its Triton kernel), `mla_fp8_prefill` the cast form,
  `mla_fp8_prefill_scaled` the torch._scaled_mm form;
- moe_experts (h [T, L] with the layer's own routing): `reference` MoE.routed (the slot's
  default), `moe_fp8_stage2` routed_fp8_stage2.
Each arm runs once untimed first (compiles, allocator growth; its output kept for max|Δ| against
the reference arm's, in fp32), then --repeats rounds, the arms in alternating order, one process.
Per arm: the median ms with a distribution-free 95% interval (ab.median_ci: [min, max] below
n = 6 covers less than 95% and says so), and the speedup over the reference as ab.ABResult's
geometric mean of per-round ratios with its 95% t-interval. An arm that raises is recorded with
its error and the cell goes on. DIR/fp8_bench.json is written atomically after every cell
(complete: false until the end): a device call killed at its time limit keeps what it measured.
Prints a table, then one line of JSON. Exit 0; 1 when an arm raised; 2 on bad input.
Shape letters: T tokens, H heads, C qk head dim, R cache row width, L routed-expert width, k experts a token.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

import torch

from k3verify.errors import UsageError
from k3verify.io import atomic_write_json, make_dir
from k3verify.perf.cli_args import int_list

from .ab import ABResult, median_ci

OPS_BENCHED = ("mla", "moe")
MIN_REPEATS = 5
SMOKE_LENGTHS = [16, 40]            # 40: past one 16-key GEMM tile, a 24-wide head padded to 32


class BadInput(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):          # argparse prints usage + a line and exits 2: one line here
        raise BadInput(message)


_ints = int_list(2, "lengths >= 2 (a prefill has more than one query)")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="python -m k3verify.perf.fp8_bench", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for fp8_bench.json")
    p.add_argument("--model", default=None, help="preset or checkpoint (default: k3-small; --smoke: k3-mini)")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--lengths", type=_ints, default=None,
                   help=f"prompt lengths T (default 4096,32768; --smoke {','.join(map(str, SMOKE_LENGTHS))})")
    p.add_argument("--ops", default="mla,moe", help=f"which cells: some of {','.join(OPS_BENCHED)}")
    p.add_argument("--repeats", type=int, default=6, help=f"timed rounds per arm (>= {MIN_REPEATS})")
    p.add_argument("--budget-s", type=float, default=170.0,
                   help="no new cell starts after this many seconds from the start (the caller's timeout is later)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (k3-mini, T = 16, 40): runs on a CPU")
    return p.parse_args(argv)


def _check(args: argparse.Namespace) -> tuple[str, list[str]]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA device here")
    if device == "cpu" and not args.smoke:
        raise BadInput("the full bench needs CUDA (T = 32768 on the CPU reference takes hours); "
                       "--smoke runs tiny shapes on the CPU")
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS_BENCHED]
    if bad or not ops:
        raise BadInput(f"--ops: expected some of {', '.join(OPS_BENCHED)}, got {args.ops!r}")
    if args.repeats < MIN_REPEATS:
        raise BadInput(f"--repeats must be >= {MIN_REPEATS}, got {args.repeats}")
    if args.threads is not None and args.threads < 1:
        raise BadInput(f"--threads must be >= 1, got {args.threads}")
    return device, ops


# ---- the subjects --------------------------------------------------------------------------

def layers(model) -> tuple[Any, Any]:
    """The first MLA mixer and the first MoE block of the model."""
    from optimized_stack.config import MLA
    mla = next((L.self_attn for L in model.model.layers if L.kind == MLA), None)
    moe = next((L.block_sparse_moe for L in model.model.layers if hasattr(L, "block_sparse_moe")), None)
    if mla is None or moe is None:
        raise BadInput(f"the model needs an MLA layer and an MoE layer, got MLA {mla is not None}, "
                       f"MoE {moe is not None}")
    return mla, moe


def mla_arms(layer, t_len: int, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    from optimized_stack.kernels.mla.fp8_prefill import mla_fp8_prefill
    from optimized_stack.kernels.mla.fp8_prefill_scaled import mla_fp8_prefill_scaled
    from optimized_stack.model.ops import OPS
    if OPS.mla_prefill is not None:
        raise BadInput(f"the mla_prefill slot holds {OPS.mla_prefill!r}: the reference arm needs the default")
    q, rows = layer.queries(x), layer.cache_rows(x)                     # [T, H, C], [T, R]
    pos = torch.arange(t_len, device=x.device)
    return {"reference": lambda: layer.attend(q, rows, pos),
            "mla_fp8_prefill": lambda: mla_fp8_prefill(layer, q, rows, pos),
            "mla_fp8_prefill_scaled": lambda: mla_fp8_prefill_scaled(layer, q, rows, pos)}


def moe_arms(moe, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    from optimized_stack.kernels.moe.fp8_stage2 import routed_fp8_stage2
    from optimized_stack.model.moe import MoE
    from optimized_stack.model.ops import OPS
    if OPS.moe_experts is not None:
        raise BadInput(f"the moe_experts slot holds {OPS.moe_experts!r}: the reference arm needs the default")
    idx, w = moe.gate(x)                                                # [T, k], [T, k]
    latent = moe.cfg.routed_expert_hidden_size is not None
    h = OPS.linear(x, moe.routed_expert_down_proj.weight) if latent else x           # [T, L]
    return {"reference": lambda: MoE.routed(moe, h, idx, w),
            "moe_fp8_stage2": lambda: routed_fp8_stage2(moe, h, idx, w)}


# ---- one cell -------------------------------------------------------------------------------

def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_cell(arms: dict[str, Callable[[], torch.Tensor]], repeats: int, device: str,
              log: Callable[[str], None]) -> dict[str, Any]:
    """Warm each arm (its output kept), then `repeats` rounds in alternating order."""
    outputs, errors = {}, {}
    for name, fn in arms.items():
        try:
            with torch.no_grad():
                outputs[name] = fn().float()
            _sync(device)
        except Exception as exc:            # one broken arm must not cost the cell's other figures
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log(f"  {name} raised: {errors[name]}")
    live = [n for n in arms if n in outputs]
    times: dict[str, list[float]] = {n: [] for n in live}
    for r in range(repeats):
        for name in (live if r % 2 == 0 else live[::-1]):
            _sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                arms[name]()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    ref = outputs.get("reference")
    rows = {}
    for name in arms:
        if name in errors:
            rows[name] = {"error": errors[name]}
            continue
        ci = median_ci(times[name])
        row: dict[str, Any] = {"ms_median": ci["median"] * 1e3, "ms_ci95": [ci["low"] * 1e3, ci["high"] * 1e3],
                               "ci_coverage": ci["coverage"], "ms_runs": [t * 1e3 for t in times[name]]}
        if ref is not None and name != "reference":
            ab = ABResult("reference", name, times["reference"], times[name], tokens=0)
            d = (outputs[name] - ref).abs()
            row.update({"speedup": ab.ratio, "speedup_ci95": [ab.ci_low, ab.ci_high],
                        "max_abs_diff": float(d.max()), "max_abs_ref": float(ref.abs().max()),
                        "max_rel_diff": float(d.max() / ref.abs().max().clamp_min(1e-30))})
        rows[name] = row
    return {"arms": rows}


# ---- the run --------------------------------------------------------------------------------

def _table(cells: list[dict[str, Any]]) -> None:
    print(f"{'op':12} {'arm':24} {'T':>6} {'ms median':>10} {'95% interval':>20} {'x ref':>6} "
          f"{'[95% interval]':>16} {'max|d| vs ref':>13}")
    for c in cells:
        for name, r in c["arms"].items():
            if "error" in r:
                print(f"{c['op']:12} {name:24} {c['T']:>6} {r['error']}")
                continue
            lo, hi = r["ms_ci95"]
            sp = f"{r['speedup']:6.2f} [{r['speedup_ci95'][0]:6.2f},{r['speedup_ci95'][1]:6.2f}]" \
                if "speedup" in r else f"{'1':>6} {'':16}"
            diff = f"{r['max_abs_diff']:13.3g}" if "max_abs_diff" in r else f"{'-':>13}"
            print(f"{c['op']:12} {name:24} {c['T']:>6} {r['ms_median']:10.3f} [{lo:8.3f},{hi:9.3f}] {sp} {diff}")
    for c in cells:
        if c.get("skipped"):
            print(f"{c['op']:12} T={c['T']}: skipped ({c['skipped']})")


def run(args: argparse.Namespace) -> int:
    from k3verify.report.environment import git_state
    from optimized_stack import load_model

    device, ops = _check(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lengths = args.lengths or (SMOKE_LENGTHS if args.smoke else [4096, 32768])
    model_name = args.model or ("k3-mini" if args.smoke else "k3-small")
    out_dir = make_dir(args.out)              # before minutes of loading and timing, not after
    t_start = time.monotonic()

    def log(msg: str) -> None:                # stderr, as it happens: a killed call still shows how far it got
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = load_model(model_name, device=device, dtype=dtype, seed=args.seed)
    mla, moe = layers(model)
    log(f"loaded {model_name} ({args.dtype}, {device})")
    cfg = model.config
    doc: dict[str, Any] = {
        "complete": False, "model": model_name, "dtype": args.dtype, "device": device, "lengths": lengths,
        "ops": ops, "repeats": args.repeats, "seed": args.seed, "smoke": args.smoke,
        "dims": {"hidden": cfg.hidden_size, "heads": cfg.num_heads, "qk_head_dim": cfg.qk_head_dim,
                 "v_head_dim": cfg.v_head_dim, "mla_cache_width": cfg.mla_cache_width,
                 "experts": cfg.num_experts, "experts_per_token": cfg.num_experts_per_token,
                 "routed_width": cfg.routed_expert_hidden_size},
        "reference": {"mla": "op table default of mla_prefill: decompress + blocked_attention "
                             "(Triton causal_attention on CUDA)", "moe": "MoE.routed (moe_experts default)"},
        "environment": {"torch": torch.__version__, "git": git_state(), "threads": torch.get_num_threads(),
                        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None},
        "cells": []}
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    failed = False
    for t_len in lengths:
        x = torch.randn(t_len, cfg.hidden_size, generator=gen).to(device=device, dtype=dtype)   # [T, D]
        for op in ops:
            cell: dict[str, Any] = {"op": "mla_prefill" if op == "mla" else "moe_experts", "T": t_len}
            if time.monotonic() - t_start > args.budget_s:
                cell["skipped"] = f"--budget-s {args.budget_s:g} spent before this cell"
                log(f"{cell['op']} T={t_len}: skipped (budget)")
            else:
                with torch.no_grad():
                    arms = mla_arms(mla, t_len, x) if op == "mla" else moe_arms(moe, x)
                cell.update(time_cell(arms, args.repeats, device, log))
                failed = failed or any("error" in r for r in cell["arms"].values())
                log(f"{cell['op']} T={t_len}: " + ", ".join(
                    f"{n} {r['ms_median']:.2f} ms" if "ms_median" in r else f"{n} error"
                    for n, r in cell["arms"].items()))
            doc["cells"].append(cell)
            doc["wall_s"] = time.monotonic() - t_start
            atomic_write_json(out_dir / "fp8_bench.json", doc)
            if device == "cuda":
                torch.cuda.empty_cache()
    doc["complete"] = True
    atomic_write_json(out_dir / "fp8_bench.json", doc)
    _table([c for c in doc["cells"] if "arms" in c] + [c for c in doc["cells"] if "skipped" in c])
    summary = {f"{c['op']}@{c['T']}": c.get("skipped") or {
        n: {k: r[k] for k in ("ms_median", "speedup", "max_abs_diff", "error") if k in r} for n, r in c["arms"].items()}
        for c in doc["cells"]}
    print(json.dumps({"complete": True, "device": device, "model": model_name, "cells": summary}))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(parse(argv))
    except (BadInput, UsageError, ValueError) as exc:      # K3Error is a ValueError
        print(f"fp8_bench: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
