"""Where a decode step's time goes, on a GPU: the engine step's wall time split into the device's
part (the captured graph replayed alone) and the host's (scheduler, block tables, the input copy,
the read-back), and the kernels of one eager step ranked by device time.

    python -m k3verify.perf.step_profile --out DIR [--batches 1,64,256] [--context 512]

Writes step_profile.json (per stack and batch: engine step ms, replay ms, eager forward ms, host
ms = step - replay) and step_kernels.txt (torch.profiler's table for an eager step at each batch).
Timings are of real copied contexts (fast_bench_setup.seeded_engine), as the benchmark's are.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from optimized_stack import load_model, toggles

from .fast_bench import _options
from .fast_bench_setup import Donor, cache_tokens_for, seeded_engine, sync

STACKS = {
    "cuda_graphs": ("continuous_batching", "projected_kv_cache", "batched_decode", "cuda_graphs"),
    "+moe_grouped_static": ("continuous_batching", "projected_kv_cache", "batched_decode", "cuda_graphs",
                            "moe_grouped_static"),
}


def _ms(fn, repeats: int) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeats * 1e3


def profile_cell(model, names, donor: Donor, batch: int, repeats: int, kernels: list[str]) -> dict:
    context = len(donor.ids)
    new = 3 * repeats + 8
    with toggles.applied(list(names)) as ap:
        opts = _options(ap.engine, {"max_num_seqs": batch, "kda_pool_slots": batch,
                                    "token_budget": batch * (context + 1),
                                    "device_cache_tokens": cache_tokens_for(batch, context, new)})
        eng = seeded_engine(model, opts, donor, batch, new)
        for _ in range(3):                              # capture + warm
            eng.step()
        step_ms = _ms(eng.step, repeats)
        fast = eng.fast
        reqs = list(eng.scheduler.running)
        from optimized_stack.engine.fast.batch import build_meta, padded_size
        meta = build_meta([r.tokens[-1] for r in reqs], [r.num_computed for r in reqs], [r.slot for r in reqs],
                          fast.step.spare_slot, padded_size(len(reqs)), pin=True).meta
        # replays and eager forwards write this step's rows again at the same positions: timing only
        replay_ms = _ms(lambda: fast.graphs.run(meta), repeats) if fast.graphs is not None else None
        dev_meta = meta.to(model.device)
        eager_ms = _ms(lambda: fast.step.forward(dev_meta), repeats)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fast.step.forward(dev_meta)
            sync()
        kernels.append(f"==== {'+'.join(names[-1:])} B={batch} ctx={context}: eager step x3 ====\n"
                       + prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
    del eng
    torch.cuda.empty_cache()
    return {"batch": batch, "context": context, "rows": len(reqs), "step_ms": step_ms, "replay_ms": replay_ms,
            "eager_forward_ms": eager_ms, "host_ms": step_ms - (replay_ms if replay_ms is not None else eager_ms),
            "tok_s": batch / step_ms * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3verify.perf.step_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="k3-small")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the step profile needs CUDA; torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model, device="cuda", dtype=torch.bfloat16)
    donor = Donor.prefill(model, args.context)
    cells, kernels = [], []
    for stack, names in STACKS.items():
        for b in (int(x) for x in args.batches.split(",")):
            cell = {"stack": stack, **profile_cell(model, names, donor, b, args.repeats, kernels)}
            print(json.dumps(cell), flush=True)
            cells.append(cell)
    (args.out / "step_profile.json").write_text(json.dumps({"model": args.model, "cells": cells}, indent=1))
    (args.out / "step_kernels.txt").write_text("\n\n".join(kernels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
