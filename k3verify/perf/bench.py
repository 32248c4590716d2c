"""Counted speedups on the CPU: a toggle's contract judged first, then (only then) interleaved
A/B timing of the reference against it on a bench workload (perf/ab.py: the statistic).

A contract that failed on non-finite numbers (NaN / inf in either run, or a run the sampler
stopped) is not timed at all: a stopped run is shorter than the workload, so its time would
be a fake speedup, and it is never counted.
"""
from __future__ import annotations

import statistics
from typing import Any

from k3verify.perf.ab import interleaved
from k3verify.run.runner import Runner
from k3verify.run.sequential import run_scenario
from k3verify.scenarios.chooser import scenario_tokens, workload
from k3verify.scenarios.workloads import build
from k3verify.verdict.gate import check_toggle


def decode_roofline(model, sc, seconds: float, hbm_bytes_per_s: float) -> dict[str, float]:
    """Bytes a one-request-at-a-time decode of the scenario must move (gpu_bench's per-step
    bytes at batch 1, at each request's mean context) per second of `seconds`, and that rate
    as a fraction of the measured HBM bandwidth."""
    from k3verify.perf.gpu_bench import decode_step_bytes
    total = 0.0
    for r in sc.requests:
        mean_ctx = len(r.prompt_ids) + r.max_new_tokens // 2
        total += r.max_new_tokens * decode_step_bytes(model, 1, mean_ctx)["total"]
    rate = total / seconds
    return {"decode_bytes": total, "achieved_bytes_per_s": rate, "roofline_fraction": rate / hbm_bytes_per_s}


def bench_toggle(model, toggle: str, *, workload_name: str = "decode", scale: float = 1.0,
                 repeats: int = 5, hbm_bytes_per_s: float | None = None) -> dict[str, Any]:
    """Judge the toggle's contract, then (only then) time it against the reference.
    With hbm_bytes_per_s (measured on a GPU) a decode workload also reports its roofline
    fraction (prefill time included, so it is a lower bound)."""
    sc = workload(workload_name, scale)
    results = check_toggle(model, toggle, sc, runner=Runner(model))
    failed = [r for r in results if r.status == "fail"]
    skipped = [r for r in results if r.status == "skip"]
    if skipped and len(skipped) == len(results):      # it does not run here (device, world size)
        return {"toggle": toggle, "workload": workload_name, "scenario": sc.name, "counted": False,
                "why": f"contract not checked: {skipped[0].reason}", "a": "reference", "b": toggle,
                "ratio": None, "ci95": None, "checks": [{"check": r.check, "status": r.status,
                                                         "reason": r.reason} for r in results]}
    nonfinite = next((r for r in failed if r.evidence.get("nonfinite")), None)
    if nonfinite is not None:
        return {"toggle": toggle, "workload": workload_name, "scenario": sc.name, "counted": False,
                "why": f"contract failed on {sc.name}: {nonfinite.check}: {nonfinite.reason}; not timed "
                       f"(non-finite numbers)", "a": "reference", "b": toggle, "ratio": None, "ci95": None,
                "checks": [{"check": r.check, "status": r.status, "reason": r.reason} for r in results]}
    ab = interleaved(lambda: run_scenario(model, sc), lambda: run_scenario(model, sc, (toggle,)),
                     repeats=repeats, tokens=scenario_tokens(sc), labels=("reference", toggle))
    unexercised = [r for r in results if r.status == "not_exercised"]
    if failed:
        counted, why = False, f"contract failed on {sc.name}: {failed[0].check}: {failed[0].reason}"
    elif unexercised:                   # a speedup on a workload that never ran the toggle's path
        counted, why = False, f"not exercised on {sc.name}: {unexercised[0].reason}"
    else:
        counted, why = True, f"contract {results[0].contract} held on {sc.name} in this run"
    roof = {}
    if hbm_bytes_per_s and workload_name == "decode":
        roof = {"roofline_reference": decode_roofline(model, sc, statistics.median(ab.times_a), hbm_bytes_per_s),
                "roofline_candidate": decode_roofline(model, sc, statistics.median(ab.times_b), hbm_bytes_per_s)}
    return {"toggle": toggle, "workload": workload_name, "scenario": sc.name, "counted": counted,
            "why": why, **ab.to_dict(), **roof,
            "checks": [{"check": r.check, "status": r.status, "reason": r.reason} for r in results]}


class _NullObserver:
    def on_logits(self, *a): pass
    def on_kda_state(self, *a): pass
    def on_finish(self, *a): pass
    def on_step(self, *a): pass


def capture_overhead(model, *, scale: float = 1.0, repeats: int = 7) -> dict[str, Any]:
    """Hash capture (the default) against the same run whose observer does nothing."""
    from k3verify.capture.capture import Capture
    from k3verify.run.sequential import _run_sequential
    sc = build("multi_length", scale=scale)

    def plain():
        _run_sequential(model, sc, {}, [_NullObserver()], None)

    def captured():
        _run_sequential(model, sc, {}, [Capture()], None)
    ab = interleaved(plain, captured, repeats=repeats, tokens=scenario_tokens(sc),
                     labels=("no capture", "hash capture"))
    d = ab.to_dict()
    d["overhead"] = 1.0 / ab.ratio - 1.0                   # extra time of the captured run
    return d
