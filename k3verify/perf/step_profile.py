"""Where a decode step's time goes, on a GPU: the engine step's wall time split into the device's
part (the captured graph replayed alone) and the host's (scheduler, block tables, the input copy,
the read-back), and the kernels of one eager step ranked by device time.

    python -m k3verify.perf.step_profile --out DIR [--batches 1,64,256] [--context 512]
        [--stacks cuda_graphs,+fused,...] [--prefill 2048] [--prefill-stacks +fused,+sorted]

Writes step_profile.json (per stack and batch: engine step ms, replay ms, eager forward ms, host
ms = step - replay, device activities per eager step and their device ms) and step_kernels.txt
(torch.profiler's table for an eager step at each batch). Timings are of real copied contexts
(fast_bench_setup.seeded_engine), as the benchmark's are. --prefill N profiles one engine step that
prefills an N-token prompt on each of --prefill-stacks, side by side (prefill runs the reference
forward, or with +sorted its routed experts through kernels/moe/sorted.py, with +situ their SiTU-GLU
as one Triton launch too: the fast step only takes plain decodes), the step that dominates GSM8K's
five-shot prompts on the GPU. --sites adds, per stack and batch, the eager step's device time by the
model line that launched it (torch.profiler with stacks, the innermost optimized_stack frame):
step_sites.txt, the pointer to which casts and copies a fused kernel would remove (2026-12-02:
copies and casts were ~28% of the step's device time).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from optimized_stack import load_model, toggles

from optimized_stack.engine.engine import Engine
from optimized_stack.engine.options import SamplingParams

from ..io import atomic_write_text as atomic_write
from .fast_bench import _options
from .fast_bench_setup import Donor, cache_tokens_for, seeded_engine, sync

GRAPHS = ("continuous_batching", "projected_kv_cache", "batched_decode", "cuda_graphs")
FUSED = ("fused_kda_conv", "fused_moe_combine")
STACKS = {
    "cuda_graphs": GRAPHS,
    # the exact stack with the fused decode kernels (issue 27 item 2): what GSM8K's counted stack runs
    "+fused": GRAPHS + FUSED,
    "+moe_grouped_static": GRAPHS + ("moe_grouped_static",),
    # moe_grouped_static replaces the experts op, combine included: only the conv kernel runs beside it
    "+moe_grouped_static+fused_conv": GRAPHS + ("moe_grouped_static", "fused_kda_conv"),
    # the counted stack with prefill's routed experts on one host sync per layer (issue 27 item 3)
    "+sorted": GRAPHS + FUSED + ("prefill_sorted_experts",),
    # and the routed experts' SiTU-GLU as one launch, in decode and in the sorted prefill (fused_situ switches
    # the sorted experts on itself, so it is timed here against +sorted, not beside +fused)
    "+situ": GRAPHS + FUSED + ("prefill_sorted_experts", "fused_situ"),
}
DEFAULT_STACKS = "cuda_graphs,+moe_grouped_static"


def device_activities(prof, repeats: int) -> tuple[float, float]:
    """(device activities per step, their device ms per step) from a profile of `repeats` steps:
    every kernel, memcpy and memset the device ran, the count the graph replays as well."""
    acts = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(acts) / repeats, sum(e.device_time for e in acts) / 1e3 / repeats


def _ms(fn, repeats: int) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeats * 1e3


def launch_sites(prof, top: int = 40, time_of=None) -> str:
    """The profiled device time by the innermost optimized_stack frame of the op that launched it:
    'ms  launches  file:line  op' rows, most device time first, then the device time no such op owns.
    A kernel is attached only to the frontend op that launched it (torch links them through the op's
    correlation id), so a Triton launch outside any aten op or autograd.Function (this repository's
    kernels, fla's _fwd entry points) has no CPU event: the last row is the device's own total (its
    CUDA events) less what the rows own. `time_of(event)` is an op's own time in us, default its own
    device time (a kernel counts once, for the innermost op); a CPU test passes the CPU time, and the
    total is then the CPU events' own. The profile needs with_stack and stacks_config(): without the
    verbose experimental config torch 2.11-2.13 record no stacks in events() (the first H100 call of
    --sites, 2026-12-07, printed an empty table)."""
    device = time_of is None
    time_of = time_of or (lambda e: getattr(e, "self_device_time_total", 0.0) or 0.0)
    by: dict[tuple[str, str], list[float]] = {}
    stacks = owned = 0.0
    total = 1e3 * device_activities(prof, 1)[1] if device else 0.0      # the device's kernels, copies, sets
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        own = time_of(e)
        if not device:
            total += own
        stacks += bool(e.stack)
        frames = [f for f in (e.stack or []) if "optimized_stack/" in f]
        if not own or not frames:
            continue
        site = frames[0].split("optimized_stack/", 1)[1].split(": ")[0].strip()      # file.py(line)
        row = by.setdefault((site, e.name), [0.0, 0])
        row[0] += own / 1e3
        row[1] += 1
        owned += own
    if not stacks:
        raise RuntimeError("launch_sites: the profile recorded no stacks (profile it with with_stack=True "
                           "and experimental_config=stacks_config())")
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    lines = [f"{ms:8.3f} ms {n:6d}  {site}  {name}" for (site, name), (ms, n) in rows]
    lines.append(f"{(total - owned) / 1e3:8.3f} ms          (no optimized_stack op: launched outside an "
                 f"aten op, or from outside the model; of {total / 1e3:.3f} ms in all)")
    return "\n".join(lines)


def stacks_config():
    """The profiler's experimental config under which events() carry their Python stacks."""
    from torch._C._profiler import _ExperimentalConfig
    return _ExperimentalConfig(verbose=True)


def profile_cell(model, names, donor: Donor, batch: int, repeats: int, kernels: list[str],
                 sites: list[str] | None = None) -> dict:
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
                          fast.step.spare_slot, padded_size(len(reqs)), pin=model.device.type == "cuda").meta
        # replays and eager forwards write this step's rows again at the same positions: timing only
        replay_ms = _ms(lambda: fast.graphs.run(meta), repeats) if fast.graphs is not None else None
        dev_meta = meta.to(model.device)
        eager_ms = _ms(lambda: fast.step.forward(dev_meta), repeats)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fast.step.forward(dev_meta)
            sync()
        kernels.append(f"==== {'+'.join(names)} B={batch} ctx={context}: eager step x3 ====\n"
                       + prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
        acts, act_ms = device_activities(prof, 3)
        if sites is not None:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                         experimental_config=stacks_config()) as prof_s:
                fast.step.forward(dev_meta)
                sync()
            sites.append(f"==== {'+'.join(names)} B={batch} ctx={context}: one eager step, device ms by the "
                         f"model line that launched it ====\n" + launch_sites(prof_s))
        fired = {k: v for k, v in eng.events.items() if k.startswith("fast_")}
    del eng
    torch.cuda.empty_cache()
    return {"batch": batch, "context": context, "rows": len(reqs), "step_ms": step_ms, "replay_ms": replay_ms,
            "eager_forward_ms": eager_ms, "host_ms": step_ms - (replay_ms if replay_ms is not None else eager_ms),
            "tok_s": batch / step_ms * 1e3, "device_activities_per_step": acts, "device_ms_per_step": act_ms,
            "events": fired}


def profile_prefill(model, names, length: int, kernels: list[str]) -> dict:
    """One engine step that prefills a `length`-token prompt (token_budget = length), timed warm
    (a first engine pays the compiles), then profiled."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist()

    def one(profiled: bool):
        with toggles.applied(list(names)) as ap:
            opts = _options(ap.engine, {"max_num_seqs": 1, "kda_pool_slots": 1, "token_budget": length,
                                        "device_cache_tokens": cache_tokens_for(1, length, 8)})
            eng = Engine(model, opts)
            eng.add_request(ids, SamplingParams(max_new_tokens=2, ignore_eos=True), request_id="p")
            sync()
            t0 = time.perf_counter()
            if profiled:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    eng.step()
                    sync()
            else:
                eng.step()
                sync()
            ms = (time.perf_counter() - t0) * 1e3
            assert eng.metrics.tokens_computed == length, "the step must prefill the whole prompt"
        return ms, (prof if profiled else None)

    one(False)                                          # compiles, fla's tuning at this length
    ms = min(one(False)[0] for _ in range(2))
    _, prof = one(True)
    acts, act_ms = device_activities(prof, 1)
    kernels.append(f"==== prefill {length} tokens on {'+'.join(names)} ====\n"
                   + prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    return {"prefill_tokens": length, "step_ms": ms, "tok_s": length / ms * 1e3,
            "device_activities": acts, "device_ms": act_ms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3verify.perf.step_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="k3-small")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--stacks", default=DEFAULT_STACKS, help=f"comma list of {', '.join(STACKS)}")
    ap.add_argument("--prefill", default="", help="prompt lengths whose prefill step to profile (comma list)")
    ap.add_argument("--prefill-stacks", default="+fused,+sorted", help="the stacks whose prefill step is "
                    "profiled, side by side (default: the fused stack, and it with the sorted prefill experts)")
    ap.add_argument("--sites", action="store_true", help="also the eager step's device time by launching "
                    "model line (step_sites.txt)")
    args = ap.parse_args(argv)
    stacks = [x for x in args.stacks.split(",") if x]
    prefill_stacks = [x for x in args.prefill_stacks.split(",") if x]
    unknown = [x for x in stacks + prefill_stacks if x not in STACKS]
    if unknown:
        print(f"error: --stacks: unknown {', '.join(unknown)} (known: {', '.join(STACKS)})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the step profile needs CUDA; torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model, device="cuda", dtype=torch.bfloat16)
    donor = Donor.prefill(model, args.context)
    cells, prefills, kernels = [], [], []
    sites: list[str] | None = [] if args.sites else None

    def save() -> None:                                 # after every cell: the call's limit is a hard kill
        atomic_write(args.out / "step_profile.json",
                     json.dumps({"model": args.model, "cells": cells, "prefill": prefills}, indent=1))
        atomic_write(args.out / "step_kernels.txt", "\n\n".join(kernels))
        if sites is not None:
            atomic_write(args.out / "step_sites.txt", "\n\n".join(sites))

    for b in (int(x) for x in args.batches.split(",") if x):
        for stack in stacks:                            # stacks side by side at each batch
            cell = {"stack": stack, **profile_cell(model, STACKS[stack], donor, b, args.repeats, kernels, sites)}
            print(json.dumps(cell), flush=True)
            cells.append(cell)
            save()
    for n in (int(x) for x in args.prefill.split(",") if x):
        for stack in prefill_stacks:                    # side by side at each length
            cell = {"stack": stack, **profile_prefill(model, STACKS[stack], n, kernels)}
            print(json.dumps(cell), flush=True)
            prefills.append(cell)
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
