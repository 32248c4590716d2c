"""Our engine against transformers' Kimi Linear, measured fairly (fair_baseline.py says how).

    python -m k3verify.perf.fair_bench --out DIR                 # CUDA: k3-small bf16, B = 1, 64, 256
    python -m k3verify.perf.fair_bench --out DIR --model k3-mini --device cpu --batches 1,2 \\
        --context 16 --new-tokens 4 --skip-tokens 2 --repeats 5     # the CPU run the test makes

The engine side is fast_bench's: the stack's rows are contract-checked in this run
(fast_bench.section_contracts) and the top counted row is timed with fast_bench.decode_cell on
requests seeded with a real context (fast_bench_setup.Donor). The peer is transformers'
KimiLinearForCausalLM at our model's dims (transformers_kimi.KimiLinearPeer; --peer-checkpoint
loads a checkpoint instead). Writes DIR/fair_baseline.json (everything) and DIR/summary.json,
prints a table, then one line of JSON. Exit 0; 1 when the peer's decode cross-check disagrees;
2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

from k3verify.errors import UsageError
from k3verify.io import atomic_write_text, make_dir
from k3verify.perf.cli_args import int_list

from .fair_baseline import FairConfig, Subjects, run_fair_baseline, summary_fields

GPU_ARMS = "dynamic,masked,static,static_compiled"
CPU_ARMS = "dynamic,masked,static"


class BadInput(Exception):
    pass


_ints = int_list(1, "positive integers")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="k3-small")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--batches", type=_ints, default=[1, 64, 256])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128, help="N, the decode tokens timed")
    p.add_argument("--skip-tokens", type=int, default=8, help="k: generate(k+N) - generate(k)")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--prefill", type=_ints, default=None, help="prefill lengths (default 4096 on cuda, none on cpu)")
    p.add_argument("--arms", default=None, help=f"transformers arms (default cuda: {GPU_ARMS}; cpu: {CPU_ARMS})")
    p.add_argument("--engine-row", default=None, help="stack row to time (default: the top counted row)")
    p.add_argument("--peer-checkpoint", default=None, help="a KimiLinear checkpoint dir instead of our dims")
    p.add_argument("--budget-s", type=float, default=300.0, help="for the measurement after the contracts")
    p.add_argument("--cross-check-tol", type=float, default=0.15)
    p.add_argument("--headline-batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--cold", action="store_true", help="diagnostic: skip every warm-up (not a fair figure)")
    return p.parse_args(argv)


def pick_engine_row(contracts: list[dict[str, Any]], wanted: str | None) -> str:
    counted = [c["row"] for c in contracts if c["counted"]]
    if wanted is None:
        return counted[-1]
    if wanted not in counted:
        raise BadInput(f"--engine-row {wanted!r} is not a counted row in this run (counted: {', '.join(counted)})")
    return wanted


def engine_subjects(model, row_names: tuple[str, ...], context: int):
    """decode(batch, steps) and prefill(tokens) closures over fast_bench's timing."""
    from . import fast_bench
    from .fast_bench_setup import Donor, sync
    donor = Donor.prefill(model, context)

    def decode(batch: int, steps: int) -> float:
        cell = fast_bench.decode_cell(model, row_names, donor, batch,
                                      SimpleNamespace(warmup=1, steps=steps, cell_budget_s=1e12), None)
        if "skipped" in cell:
            raise RuntimeError(f"engine row {row_names}: {cell['skipped']}")
        return cell["step_ms"] * cell["steps"] / 1e3

    def prefill(tokens: int) -> float:
        ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens))
        ids = ids.to(model.device)
        sync()
        t0 = time.perf_counter()
        model.logits(ids)
        sync()
        return time.perf_counter() - t0
    return decode, prefill


def print_table(doc: dict[str, Any], s: dict[str, Any], dtype: str) -> None:
    print(f"model {doc['model']} {dtype} on {doc['device']}; engine row {doc['engine_row']}; "
          f"context {doc['context']}; N={doc['fair']['config']['new_tokens']} "
          f"k={doc['fair']['config']['skip_tokens']}; {doc['fair']['config']['repeats']} interleaved rounds; "
          f"median [CI, coverage {s['ci_coverage']:.3f}]")
    print(f"{'B':>5} {'engine tok/s':>26} {'arm':>16} {'transformers tok/s':>26} {'x-check':>9} "
          f"{'ratio [95% CI]':>22}")
    for b, c in doc["fair"]["decode"].items():
        e = c["engine"]
        print(f"{b:>5} {e['median']:10.1f} [{e['ci95'][0]:6.1f},{e['ci95'][1]:6.1f}]", end="")
        first = True
        for a, d in c["arms"].items():
            lead = "" if first else " " * 33
            r = d["ratio"]
            star = "*" if a == c["best_arm"] else " "
            print(f"{lead} {a + star:>16} {d['median']:10.1f} [{d['ci95'][0]:6.1f},{d['ci95'][1]:6.1f}] "
                  f"{d['difference']['median']:9.1f}{'' if d['cross_check']['agree'] else '!'} "
                  f"{r['engine_over_arm']:7.2f}x [{r['ci95'][0]:5.2f},{r['ci95'][1]:5.2f}]")
            first = False
        if not c["arms"]:
            print(f" {'(no arm measured)':>16}")
        for a, why in c["dropped"].items():
            print(f"{'':33} {a:>16} {why}")
    for t, c in doc["fair"]["prefill"].items():
        print(f"prefill {t}: engine {c['engine']['median']:.0f} tok/s, transformers "
              f"{c.get('peer', {}).get('median', float('nan')):.0f} tok/s")
    for a, why in doc["fair"]["rejected_arms"].items():
        print(f"arm {a}: {why}")
    print(f"(* the best arm; ! cross-check disagrees beyond {doc['fair']['config']['cross_check_tol']:.0%})")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return run(args)
    except (BadInput, UsageError, ValueError) as exc:
        print(f"fair_bench: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    from optimized_stack import load_model
    from . import fast_bench
    from .transformers_kimi import ARMS, MASKED_ARM, KimiLinearPeer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA device here")
    arm_names = [a for a in (args.arms or (GPU_ARMS if device == "cuda" else CPU_ARMS)).split(",") if a]
    unknown = [a for a in arm_names if a not in ARMS]
    if unknown:
        raise BadInput(f"--arms: unknown {', '.join(unknown)}; expected some of {', '.join(ARMS)}")
    prefill = args.prefill if args.prefill is not None else ([4096] if device == "cuda" else [])
    if args.threads is not None:
        if args.threads < 1:
            raise BadInput(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    cfg_probe = FairConfig(batches=tuple(args.batches), new_tokens=args.new_tokens, skip_tokens=args.skip_tokens,
                           repeats=args.repeats, prefill=tuple(prefill), warm=not args.cold,
                           cross_check_tol=args.cross_check_tol, headline_batch=args.headline_batch)
    if args.context < 1:
        raise BadInput(f"--context must be >= 1, got {args.context}")
    out_dir = make_dir(args.out)              # before minutes of measuring, not after

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = load_model(args.model, device=device, dtype=dtype)
    with torch.no_grad():
        # the engine's figure counts only for a row whose contract held in this run
        contract_args = fast_bench.parse(["--out", str(out_dir)] + (["--smoke"] if device == "cpu" else []))
        contracts = fast_bench.section_contracts(model, fast_bench._rows_of(()), contract_args, log)
        row = pick_engine_row(contracts, args.engine_row)
        row_names = dict(fast_bench._rows_of(()))[row]
        decode, engine_prefill = engine_subjects(model, row_names, args.context)
        peer = KimiLinearPeer(model.config, dtype, device, args.context, checkpoint=args.peer_checkpoint)
        arms, rejected = {}, {}
        for name in arm_names:
            try:
                arms[name] = peer.arm(name)
            except ValueError as exc:
                rejected[name] = f"rejected: {exc}"
        subjects = Subjects(decode, arms, MASKED_ARM if MASKED_ARM in arms else None, rejected,
                            engine_prefill, peer.prefill)
        budget = args.budget_s - (time.monotonic() - t_start)
        cfg = FairConfig(**{**cfg_probe.__dict__, "budget_s": max(budget, 0.0)})
        def checkpoint(partial: dict[str, Any]) -> None:
            atomic_write_text(out_dir / "fair_baseline.partial.json",
                              json.dumps({"model": args.model, "dtype": args.dtype, "device": device,
                                          "engine_row": row, "complete": False, "fair": partial}, indent=1, default=str))
        fair = run_fair_baseline(subjects, cfg, log, checkpoint)
    doc: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "device": device, "context": args.context,
                           "engine_row": row, "engine_toggles": list(row_names), "contracts": contracts,
                           "peer": {**peer.info, "evidence": peer.evidence}, "fair": fair,
                           "args": vars(args), "environment": fast_bench.environment(device)}
    doc["summary"] = {**summary_fields(fair, args.dtype), "engine_row": row, "model": args.model,
                      "context": args.context, "new_tokens": args.new_tokens}
    doc["wall_s"] = time.monotonic() - t_start
    # default=str: the contract rows carry engine stats objects; the summary is plain JSON
    atomic_write_text(out_dir / "fair_baseline.json", json.dumps(doc, indent=1, default=str))
    atomic_write_text(out_dir / "summary.json", json.dumps(doc["summary"], indent=1))
    print_table(doc, doc["summary"], args.dtype)
    print(json.dumps(doc["summary"]))
    if not fair["cross_check_ok"]:
        log("the peer's decode cross-check disagrees (generate(k+N) - generate(k) against the stamped rate): "
            "this baseline is not valid")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
