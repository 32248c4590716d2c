"""What the verifier's capture costs the engine it watches (issue 27 item 4: <= 5% on the GPU).

    python -m k3verify.perf.capture_bench --out DIR [--model k3-small] [--device cuda] [--batch 64]
        [--context 512] [--new-tokens 32] [--repeats 6] [--per-request] [--after-step]

The counted stack (serving/stack.py) decodes `batch` requests of a copied `context` (fast_bench_setup:
no prefill timed) for `new_tokens` steps, interleaved with the same run under a Capture observer
(hashes of every logits row, KDA state and MLA rows: what `k3verify diff` records), `repeats`
rounds after a warm pair. Each arm times the decode steps after the first (the engine's set-up and
its first step, where graphs are captured, are the same in both and would dilute the figure:
session 15's +55% at B = 16 was of whole runs, ~95% set-up); the whole-run figure stays beside it
as "with_setup". With an observer the batched step keeps its rows (FastDecoder.run
keep_rows) and the capture hashes them, so the overhead is the copies, the hashing and any
device-to-host sync they force. Where the capture's digests are the device's, the counted stack takes
them inside its decode step and graph (engine/fast/step_digests.py; `in_step` in the file says whether
the timed runs did); `--after-step` also times the same capture with the calls after the step
(Capture(in_step=False), the form before 2026-12-07) in its own interleaved pair, and checks that the
two recorded the same digests. Writes DIR/capture_overhead.json: {"overhead": extra time of the
captured run as a fraction, "ci95": its interval, the median seconds of each arm, the setup}; that
file is perf/engine_summary.py's --capture.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from optimized_stack import load_model, toggles

from ..io import atomic_write_text
from .ab import interleaved
from .fast_bench import _options
from .fast_bench_setup import Donor, cache_tokens_for, seeded_engine, sync


class PerRequestCalls:
    """An observer that passes a Capture only the per-request calls (on_logits, on_kda_state): the
    engine, seeing no batched methods, falls back to one call per request and layer."""

    def __init__(self, cap) -> None:
        self.cap = cap
        self.kda_calls = 0

    def on_request(self, *a) -> None:
        self.cap.on_request(*a)

    def on_logits(self, *a) -> None:
        self.cap.on_logits(*a)

    def on_kda_state(self, *a) -> None:
        self.kda_calls += 1
        self.cap.on_kda_state(*a)

    def on_finish(self, *a) -> None:
        self.cap.on_finish(*a)

    def on_step(self, *a) -> None:
        self.cap.on_step(*a)


def _overhead(ab) -> dict:
    return {"overhead": 1.0 / ab.ratio - 1.0, "ci95": [1.0 / ab.ci_high - 1.0, 1.0 / ab.ci_low - 1.0], "ab": ab.to_dict()}


def engine_capture_overhead(model, names: tuple[str, ...], *, batch: int, context: int, new_tokens: int,
                            repeats: int, per_request: bool = False, after_step: bool = False) -> dict:
    """The headline: the decode steps after the first (`overhead`, per step `extra_ms_per_step`):
    a steady engine watched against the same engine unwatched. Beside it `with_setup`: the whole run,
    the engine's construction, the donor's copies and the first step (graph capture) included, the
    figure sessions <= 15 reported (its set-up dilutes the capture's cost)."""
    from k3verify.capture.capture import Capture
    if new_tokens < 2:
        raise ValueError("capture_bench needs new_tokens >= 2: the first step is set-up, the rest are timed")
    donor = Donor.prefill(model, context)
    totals: dict[str, list[float]] = {}
    fast_stats: dict[str, object] = {}          # arm -> its last engine's FastStats (in-step evidence)
    with toggles.applied(list(names)) as ap:
        # a budget that seeds all `batch` requests at once (seeded_engine refuses less): with 256 before
        # 2026-12-07 most requests were prefilled inside the timed steps
        opts = _options(ap.engine_for(model.device), {"max_num_seqs": batch, "kda_pool_slots": batch,
                                                      "token_budget": batch * (context + 1),
                                                      "device_cache_tokens": cache_tokens_for(batch, context, new_tokens)})

        def run(arm: str, observers: tuple) -> float:
            t0 = time.perf_counter()
            eng = seeded_engine(model, opts, donor, batch, new_tokens, observers)
            eng.step()                              # graphs captured, kernels chosen: not steady state
            sync()
            t1 = time.perf_counter()
            eng.run()
            sync()
            t2 = time.perf_counter()
            assert len(eng.results) == batch and all(r.finish_reason == "length" for r in eng.results.values()), \
                "a request stopped early: the arms would not time the same work"
            totals.setdefault(arm, []).append(t2 - t0)
            if eng.fast is not None:
                fast_stats[arm] = eng.fast.stats
            return t2 - t1

        captures: list[Capture] = []
        captures_per_request: list[Capture] = []
        captures_after_step: list[Capture] = []

        def watched(arm: str, wrap, into: list, make=Capture) -> Callable[[], float]:
            def go() -> float:
                cap = make()
                into.append(cap)
                return run(arm, (wrap(cap),))
            return go
        steady_tokens = batch * (new_tokens - 1)
        ab = interleaved(lambda: run("none", ()), watched("capture", lambda c: c, captures), repeats=repeats,
                         tokens=steady_tokens, labels=("no capture", "capture"), self_timed=True)
        setup_ab = _whole_runs(totals, "none", "capture", batch * new_tokens, ("no capture", "capture"))
        before = None
        if per_request:
            totals.pop("none")
            before = interleaved(lambda: run("none", ()), watched("per_request", PerRequestCalls, captures_per_request),
                                 repeats=repeats, tokens=steady_tokens, self_timed=True,
                                 labels=("no capture", "capture, per-request calls"))
            before_setup = _whole_runs(totals, "none", "per_request", batch * new_tokens,
                                       ("no capture", "capture, per-request calls"))
        outside = None
        if after_step:
            totals.pop("none")
            outside = interleaved(lambda: run("none", ()),
                                  watched("after_step", lambda c: c, captures_after_step,
                                          make=lambda: Capture(in_step=False)),
                                  repeats=repeats, tokens=steady_tokens, self_timed=True,
                                  labels=("no capture", "capture, calls after the step"))
        split = {"none": step_split(model, opts, donor, batch, ()),
                 "capture": step_split(model, opts, donor, batch, (Capture(),))}
    rows = sum(len(rc.logits) for rc in captures[-1].requests.values()) if captures else 0
    steps = new_tokens - 1
    doc = {**_overhead(ab), "timed": f"decode steps 2..{new_tokens} (the first step and the set-up are not timed)",
           "extra_ms_per_step": 1e3 * (ab.to_dict()["median_s_b"] - ab.to_dict()["median_s_a"]) / steps,
           "with_setup": _overhead(setup_ab), "stack": list(names), "batch": batch, "context": context,
           "new_tokens": new_tokens, "repeats": repeats, "captured_logits_rows": rows,
           "digest_cost": digest_cost(model, batch), "host_added": host_added(split),
           "step_split": {arm: {k: v for k, v in sp.items() if k != "host"} for arm, sp in split.items()}}
    stats = fast_stats.get("capture")
    doc["in_step"] = {"digest_steps": getattr(stats, "digest_steps", 0), "off": getattr(stats, "digests_off", None)}
    if outside is not None:
        same = captures[-1].to_json()["requests"] == captures_after_step[-1].to_json()["requests"]
        doc["after_step"] = {**_overhead(outside), "same_digests_as_in_step": same,
                             "extra_ms_per_step": 1e3 * (outside.to_dict()["median_s_b"]
                                                         - outside.to_dict()["median_s_a"]) / steps}
    if before is not None:
        # the two forms must have recorded the same digests, or the comparison timed different work
        same = captures[-1].to_json()["requests"] == captures_per_request[-1].to_json()["requests"]
        doc["per_request"] = {**_overhead(before), "same_digests_as_batched": same,
                              "extra_ms_per_step": 1e3 * (before.to_dict()["median_s_b"]
                                                          - before.to_dict()["median_s_a"]) / steps,
                              "with_setup": _overhead(before_setup)}
    return doc


def digest_cost(model, batch: int, reps: int = 10) -> dict:
    """What one step's capture launches cost alone, on tensors of the step's shapes (B rows of every
    KDA layer's four state tensors and of the logits): the stacks and the digests, ms a step, synced.
    Tells the digest's own cost from the engine-side work around it (the next lever's pointer). On
    CUDA the digest the capture takes (the kernel's form with one remainder a block, compare/
    digest_kernel.py) is timed interleaved with the form before session 17 (a remainder a product),
    their words compared."""
    from k3verify.compare import device_digest
    st = model.new_state()
    views = [[t for _ in range(batch)] for kda in st.kda.values() for t in kda.tensors().values()]
    logits = torch.zeros(batch, model.config.vocab_size, dtype=torch.float32, device=model.device)
    kernel = None
    if model.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":   # the interpreter: CI's test
        from k3verify.compare.digest_kernel import summary_words as kernel

    def words(t, form: str):
        if form == "per_element_mod":
            return kernel(t, rows=True, per_element_mod=True)
        return device_digest.summary_words(t, rows=True)

    per_layer = len(views) // max(1, len(st.kda))
    pools = [torch.stack(rows) for rows in views]            # [B, ...] each, as the engine's pools hold them
    slots = torch.arange(batch, device=model.device)

    def one_step(stack: bool, form: str | None) -> list:
        out = []
        if form == "grouped":                       # what Capture.on_kda_states takes: a layer's tensors at once
            for i in range(0, len(views), per_layer):
                out += device_digest.summary_words_many([torch.stack(rows) for rows in views[i:i + per_layer]])
            return out + [words(logits, "default")]
        if form == "in_step":                       # what the fast step launches: every tensor, read in place
            return device_digest.StepDigester().words([logits] + pools, [None] + [slots] * len(pools))
        if form == "in_step_eight_rows":            # the same, up to eight rows a program (slower: session 24)
            from k3verify.compare.digest_kernel import summary_words_many
            return summary_words_many([logits] + pools, [None] + [slots] * len(pools), rows_per_program=8)
        if form == "in_step_wide":                  # the same, the products as 32 x 32 -> 64-bit multiplies
            from k3verify.compare.digest_kernel import summary_words_many
            return summary_words_many([logits] + pools, [None] + [slots] * len(pools), wide=True)
        for rows in views:
            t = torch.stack(rows) if stack or form else None
            if form:
                out.append(words(t, form))
        if form:
            out.append(words(logits, form))
        return out

    arms = [("stack_ms", True, None), ("stack_and_digest_ms", True, "default")]
    if kernel is not None:
        arms.append(("stack_and_digest_per_element_mod_ms", True, "per_element_mod"))
        arms.append(("stack_and_digest_grouped_ms", True, "grouped"))
        arms.append(("in_step_ms", False, "in_step"))
        arms.append(("in_step_eight_rows_ms", False, "in_step_eight_rows"))
        arms.append(("in_step_wide_ms", False, "in_step_wide"))
    times: dict[str, list[float]] = {name: [] for name, _, _ in arms}
    for name, stack, form in arms:                   # compile and warm every form first
        one_step(stack, form)
    sync()
    for _ in range(3):                               # rounds interleave the arms
        for name, stack, form in arms:
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                one_step(stack, form)
            sync()
            times[name].append(1e3 * (time.perf_counter() - t0) / reps)
    out = {name: min(v) for name, v in times.items()}
    if kernel is not None:
        # the device's own time for the step's stacks + digests (sum of its kernels): far below the
        # wall time above means the launches, not the arithmetic, cost the step (session 17's
        # arithmetic change moved the wall time by 2%: 2.80 -> 2.87 ms at B = 64)
        out["stack_and_digest_device_ms"], out["stack_and_digest_launches"] = _device_time(
            lambda: one_step(True, "default"))
        out["stack_and_digest_grouped_device_ms"], out["stack_and_digest_grouped_launches"] = _device_time(
            lambda: one_step(True, "grouped"))
        out["in_step_device_ms"], out["in_step_launches"] = _device_time(lambda: one_step(False, "in_step"))
        out["in_step_eight_rows_device_ms"], _ = _device_time(lambda: one_step(False, "in_step_eight_rows"))
        out["in_step_wide_device_ms"], _ = _device_time(lambda: one_step(False, "in_step_wide"))
        a, b, c = one_step(True, "default"), one_step(True, "per_element_mod"), one_step(True, "grouped")
        # the in-step forms put the logits first, the others last
        d, e, f = ((w[1:] + w[:1]) for w in (one_step(False, "in_step"), one_step(False, "in_step_eight_rows"),
                                             one_step(False, "in_step_wide")))
        out["kernel_broken"] = device_digest._KERNEL_BROKEN        # None: the default arm ran the kernel
        out["grouped_broken"] = device_digest._GROUPED_BROKEN      # None: the grouped arm ran grouped
        same = device_digest.same_words
        out["forms_same_words"] = same(a, b) and same(a, c) and same(a, d) and same(a, e) and same(a, f)
    out["tensors_a_step"] = len(views) + 1
    out["bytes_a_step"] = batch * sum(t.numel() * t.element_size() for kda in st.kda.values()
                                      for t in kda.tensors().values()) + logits.numel() * 4
    return out


def step_split(model, opts, donor, batch: int, observers: tuple, steps: int = 6) -> dict:
    """Where a steady decode step's time goes, watched or not: per step (after the first, which
    captures the graphs) the wall ms of `steps` steps run without the profiler, the device's busy
    ms of `steps` more under it (the sum of its kernels and copies: torch.profiler's start, stop and
    parsing stay out of the wall), and their difference, the host's share the device did not cover.
    The capture's extra wall time a step, set beside its extra device time, says whether the lever is
    the digest kernels or the host work around them (session 23: +2.47 ms a step at B = 64, of which
    the digest kernels measured alone were 0.87 ms). Kernels on two streams that overlap are counted
    twice in the busy time: a bound, not a timeline. `host` is a third run of `steps` steps under
    cProfile: the host's own time a step by Python function (session 24: the capture's steady steps
    carried +1.42 ms of host time the device did not cover, not yet attributed)."""
    import dataclasses
    new_tokens = 4 * steps + 3              # the set-up step, the four runs, and a spare: no request finishes inside
    if opts.device_cache_tokens:
        opts = dataclasses.replace(opts, device_cache_tokens=cache_tokens_for(batch, len(donor.ids), new_tokens))
    eng = seeded_engine(model, opts, donor, batch, new_tokens, observers)
    eng.step()                                       # graphs captured, kernels chosen
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    wall = 1e3 * (time.perf_counter() - t0) / steps
    device_ms, activities = _device_time(lambda: [eng.step() for _ in range(steps)])
    device = device_ms / steps
    host = _host_time(lambda: [eng.step() for _ in range(steps)], steps)
    replays = _replay_times(eng, lambda: [eng.step() for _ in range(steps)])
    assert not eng.results, "a request finished inside the profiled steps: the arms would time other work"
    watched = sum(len(rc.logits) for obs in observers for rc in obs.requests.values())   # the evidence
    return {"steps": steps, "wall_ms": wall, "device_ms": device, "host_uncovered_ms": wall - device,
            "activities": activities / steps, "captured_logits_rows": watched, "host": host,
            "replay": replays}


def _replay_times(eng, fn) -> dict:
    """The graph launches of one call of fn, timed on the host without a profiler: per replay the
    microseconds of the launch call and whether the stream was idle before it (session 24's host
    profile: the watched step's `replay` took +0.71 ms with no more calls; a launch that waits on
    queued work, or one that grew, tell these apart). {} where the engine replays no graph."""
    graphs = getattr(getattr(eng, "fast", None), "graphs", None)
    entries = list(getattr(graphs, "graphs", {}).values())
    if not entries:
        fn()
        return {}
    stream = torch.cuda.current_stream() if torch.cuda.is_available() else None
    us, idle = [], []

    def timed(real):
        def replay() -> None:
            idle.append(stream.query() if stream is not None else True)
            t0 = time.perf_counter_ns()
            real()
            us.append((time.perf_counter_ns() - t0) / 1e3)
        return replay

    saved = [e.replay for e in entries]
    for e in entries:
        e.replay = timed(e.replay)
    try:
        fn()
        sync()
    finally:
        for e, real in zip(entries, saved):
            e.replay = real
    if not us:
        return {}
    return {"replays": len(us), "median_us": sorted(us)[len(us) // 2], "max_us": max(us),
            "stream_idle_before": sum(idle) / len(idle)}


def _host_time(fn, steps: int) -> dict[str, list[float]]:
    """function -> [own ms a step, calls a step] of one call of fn under cProfile (the device waited
    for at its end). The profiler inflates Python time: compare the arms, not the absolute ms."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    fn()
    sync()
    prof.disable()
    root = str(Path(__file__).resolve().parents[2]) + "/"
    out: dict[str, list[float]] = {}
    for (file, line, name), (_, calls, own, _, _) in pstats.Stats(prof).stats.items():
        where = file.removeprefix(root) if file.startswith(root) else Path(file).name
        out[f"{where}:{line}({name})"] = [1e3 * own / steps, calls / steps]
    return out


def host_added(split: dict, top: int = 12) -> list[dict]:
    """The Python functions whose own time a step grew most from the unwatched arm to the watched one
    (step_split's `host` profiles): where the capture's host time goes."""
    none, watched = split["none"]["host"], split["capture"]["host"]
    rows = []
    for f, (ms, calls) in watched.items():
        base_ms, base_calls = none.get(f, (0.0, 0.0))
        rows.append({"function": f, "extra_ms": ms - base_ms, "calls": calls - base_calls})
    return sorted(rows, key=lambda r: -r["extra_ms"])[:top]


def _device_time(fn) -> tuple[float, int]:
    """(device ms, device activities) of one call of fn, from torch.profiler's CUDA events; (0, 0)
    without CUDA, where the profiler has no device activity to take."""
    from torch.profiler import ProfilerActivity, profile
    if not torch.cuda.is_available():
        fn()
        return 0.0, 0
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    acts = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in acts) / 1e3, len(acts)


def _whole_runs(totals: dict[str, list[float]], a: str, b: str, tokens: int, labels: tuple[str, str]):
    """The whole-run seconds the arms recorded, without the warm-up pair's (the first of each)."""
    from .ab import ABResult
    return ABResult(labels[0], labels[1], totals[a][1:], totals[b][1:], tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3verify.perf.capture_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default=None, help="default k3-small on cuda, k3-mini on the cpu")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--per-request", action="store_true",
                    help="also time the capture through the per-request observer calls (the form before batching)")
    ap.add_argument("--after-step", action="store_true",
                    help="also time the capture with its calls after the step (no in-step digests)")
    args = ap.parse_args(argv)
    for name, least in (("batch", 1), ("context", 1), ("new_tokens", 2), ("repeats", 2)):
        if getattr(args, name) < least:
            print(f"error: --{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        print(f"error: --device {args.device}: expected cpu, or cuda where torch.cuda.is_available()", file=sys.stderr)
        return 2
    from k3verify.serving.stack import counted_toggles
    model_name = args.model or ("k3-small" if args.device == "cuda" else "k3-mini")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = load_model(model_name, device=args.device, dtype=dtype)
    doc = {"model": model_name, "device": args.device, "dtype": str(dtype).replace("torch.", ""),
           **engine_capture_overhead(model, counted_toggles(args.device), batch=args.batch, context=args.context,
                                     new_tokens=args.new_tokens, repeats=args.repeats,
                                     per_request=args.per_request, after_step=args.after_step)}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "capture_overhead.json", json.dumps(doc, indent=1))
    ab = doc["ab"]
    print(f"capture overhead on {model_name} {doc['dtype']} {args.device}, B={args.batch}, steady decode: "
          f"{doc['overhead']:+.1%} [{doc['ci95'][0]:+.1%}, {doc['ci95'][1]:+.1%}], {doc['extra_ms_per_step']:+.2f} ms "
          f"a step ({ab['tokens_per_s_a']:.0f} -> {ab['tokens_per_s_b']:.0f} tok/s, an unwatched step "
          f"{1e3 * args.batch / ab['tokens_per_s_a']:.2f} ms); whole run with set-up "
          f"{doc['with_setup']['overhead']:+.1%} ({doc['captured_logits_rows']} logits rows hashed a run)")
    dc = doc["digest_cost"]
    print(f"  one step's {dc['tensors_a_step']} stacks + digests alone ({dc['bytes_a_step'] / 1e6:.1f} MB): "
          f"{dc['stack_and_digest_ms']:.2f} ms (stacks {dc['stack_ms']:.2f} ms)"
          + (f"; the device busy {dc['stack_and_digest_device_ms']:.2f} ms of it, "
             f"{dc['stack_and_digest_launches']} activities" if "stack_and_digest_device_ms" in dc else ""))
    if "stack_and_digest_per_element_mod_ms" in dc:
        print(f"  the kernel's forms, stacks included: one remainder a block {dc['stack_and_digest_ms']:.2f} ms, "
              f"a remainder a product (before) {dc['stack_and_digest_per_element_mod_ms']:.2f} ms, "
              f"a layer's tensors grouped {dc['stack_and_digest_grouped_ms']:.2f} ms (the device busy "
              f"{dc['stack_and_digest_grouped_device_ms']:.2f} ms, {dc['stack_and_digest_grouped_launches']} "
              f"activities); the step's in-place form (what a graph replays) {dc['in_step_ms']:.2f} ms (the "
              f"device busy {dc['in_step_device_ms']:.2f} ms, {dc['in_step_launches']} activities; eight rows "
              f"a program: {dc['in_step_eight_rows_ms']:.2f} ms, the device {dc['in_step_eight_rows_device_ms']:.2f} ms; "
              f"the products as 32 x 32 -> 64-bit multiplies (WIDE): {dc['in_step_wide_ms']:.2f} ms, the device "
              f"{dc['in_step_wide_device_ms']:.2f} ms); "
              f"same words: {dc['forms_same_words']}; kernel failed: {dc['kernel_broken']}")
    sp = doc["step_split"]
    print(f"  a steady step, unwatched / watched: wall {sp['none']['wall_ms']:.2f} / {sp['capture']['wall_ms']:.2f} ms, "
          f"the device busy {sp['none']['device_ms']:.2f} / {sp['capture']['device_ms']:.2f} ms, "
          f"{sp['none']['activities']:.0f} / {sp['capture']['activities']:.0f} activities (profiled)")
    print("  the host's own time the capture adds a step (cProfile, inflated; the top 5): " + "; ".join(
        f"{r['function']} +{r['extra_ms']:.3f} ms ({r['calls']:+.0f} calls)" for r in doc["host_added"][:5]))
    rp = {arm: sp[arm].get("replay") or {} for arm in ("none", "capture")}
    if rp["none"] and rp["capture"]:
        print(f"  a graph launch on the host, unwatched / watched: {rp['none']['median_us']:.0f} / "
              f"{rp['capture']['median_us']:.0f} us (median; max {rp['none']['max_us']:.0f} / "
              f"{rp['capture']['max_us']:.0f}), the stream idle before it "
              f"{rp['none']['stream_idle_before']:.0%} / {rp['capture']['stream_idle_before']:.0%} of the time")
    ins = doc["in_step"]
    print(f"  digests inside the step: {ins['digest_steps']} steps of the last watched run"
          + (f" (turned off: {ins['off']})" if ins["off"] else ""))
    if "after_step" in doc:
        af = doc["after_step"]
        print(f"  the same capture with its calls after the step: {af['overhead']:+.1%} "
              f"[{af['ci95'][0]:+.1%}, {af['ci95'][1]:+.1%}], {af['extra_ms_per_step']:+.2f} ms a step; "
              f"same digests: {af['same_digests_as_in_step']}")
    if "per_request" in doc:
        pr = doc["per_request"]
        print(f"  the same capture through per-request calls: {pr['overhead']:+.1%} "
              f"[{pr['ci95'][0]:+.1%}, {pr['ci95'][1]:+.1%}], {pr['extra_ms_per_step']:+.2f} ms a step; whole run "
              f"{pr['with_setup']['overhead']:+.1%}; same digests: {pr['same_digests_as_batched']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
