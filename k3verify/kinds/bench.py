"""Check kind `bench`: interleaved A/B speed of a toggle against the reference on a bench
workload (agentic, decode, prefill), counted only when its contract held in the same run
(perf/bench.py). One unit per toggle; `capture_overhead` adds one unit that times hash capture
itself (a measurement, recorded and never counted). A bench result passes when its speedup
counts, and is a skip (with the reason) when it was not timed or does not count.
"""
from __future__ import annotations

import time

from k3verify.scenarios.chooser import BENCH_WORKLOADS, scenario_tokens, workload
from k3verify.scenarios.workloads import build
from k3verify.verdict.result import REFERENCE, Result, Subject

from .base import (CheckSpec, Context, OptionError, Unit, check_int, check_scale, check_toggles, select_toggles,
                   units_for)
from .diff import DIFF_S_PER_TOKEN

NAME = "bench"
OPTIONS = {"toggles": "all", "workload": "decode", "scale": 1.0, "repeats": 3, "capture_overhead": False}
OVERHEAD = "capture_overhead"
OVERHEAD_SCENARIO = "multi_length"


def validate(o: dict) -> None:
    check_toggles(o["toggles"])
    if o["workload"] not in BENCH_WORKLOADS:
        raise OptionError("workload", f"must be one of {', '.join(BENCH_WORKLOADS)}, got {o['workload']!r}")
    check_scale(o["scale"])
    check_int(o["repeats"], "repeats", 2, "an interval needs two pairs")
    if not isinstance(o["capture_overhead"], bool):
        raise OptionError("capture_overhead", f"must be true or false, got {o['capture_overhead']!r}")
    if o["toggles"] is None and not o["capture_overhead"]:
        raise OptionError("toggle", "names what to time (or ask for the capture overhead)")


def plan(spec: CheckSpec) -> list[Unit]:
    o = spec.options
    overhead = [Unit(spec.kind, spec.name, o, None, OVERHEAD_SCENARIO, check_index=spec.index)] \
        if o["capture_overhead"] else []
    return overhead + units_for(spec, select_toggles(o["toggles"], NAME))


def cost_s(unit: Unit) -> float:
    """The contract check, then a warm-up pair and `repeats` timed pairs (a single run is about half a diff)."""
    o = unit.options
    sc = build(OVERHEAD_SCENARIO, scale=o["scale"]) if unit.toggle is None else workload(o["workload"], o["scale"])
    tokens = scenario_tokens(sc)
    return 1.0 + DIFF_S_PER_TOKEN * tokens * (o["repeats"] + 2)


def label(unit: Unit) -> str:
    return "capture overhead" if unit.toggle is None else f"{unit.toggle} on {unit.options['workload']}"


def run(unit: Unit, ctx: Context) -> list[Result]:
    from k3verify.perf.bench import bench_toggle, capture_overhead

    o = unit.options
    t0 = time.perf_counter()
    if unit.toggle is None:
        row = capture_overhead(ctx.model, scale=o["scale"], repeats=o["repeats"])
        return [overhead_result(row, time.perf_counter() - t0)]
    hbm = None
    if ctx.device == "cuda" and o["workload"] == "decode":
        from k3verify.perf.gpu_bench import hbm_copy_bandwidth
        hbm = hbm_copy_bandwidth()
    row = bench_toggle(ctx.model, unit.toggle, workload_name=o["workload"], scale=o["scale"], repeats=o["repeats"],
                       hbm_bytes_per_s=hbm)
    return [bench_result(row, time.perf_counter() - t0)]


def bench_result(row: dict, duration_s: float) -> Result:
    """A bench row (perf/bench.py bench_toggle) as a result: pass when its speedup counts."""
    subject = Subject.of(row["toggle"])
    if row["ratio"] is None:                      # not timed: the toggle does not run here
        return Result.skipped(subject, NAME, row["why"], scenario=row["scenario"], duration_s=duration_s, row=row)
    speedup = {"ratio": row["ratio"], "ci": row["ci95"], "counted": row["counted"], "workload": row["workload"],
               "tokens_per_s_ref": row["tokens_per_s_a"], "tokens_per_s_cand": row["tokens_per_s_b"]}
    return Result.make("pass" if row["counted"] else "skip", subject, NAME,
                       f"{row['ratio']:.3f}x on {row['scenario']}: {row['why']}", scenario=row["scenario"],
                       speedup=speedup, duration_s=duration_s, row=row)


def overhead_result(row: dict, duration_s: float) -> Result:
    """A measurement, not a toggle's speedup: its ratio is recorded and never counted."""
    return Result.passed(REFERENCE, OVERHEAD, f"hash capture costs {row['overhead']:+.1%} time against no "
                                                f"capture ({row['repeats']} pairs)", scenario=OVERHEAD_SCENARIO,
                         duration_s=duration_s, row=row,
                         speedup={"ratio": row["ratio"], "ci": row["ci95"], "counted": False,
                                  "workload": OVERHEAD_SCENARIO})
