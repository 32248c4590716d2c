"""Interleaved A/B timing: a speedup counts only after the toggle's contract passed.

Each repeat runs the reference then the candidate (order alternates every repeat to
cancel drift), on the same workload in one process, after a warm-up pair that is not
timed. The speedup is the geometric mean of per-pair ratios ref_time / cand_time with a
95% t-interval on the log ratios. A contract that failed on non-finite numbers (NaN / inf
in either run, or a run the sampler stopped) is not timed at all: a stopped run is shorter
than the workload, so its time would be a fake speedup, and it is never counted.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from k3verify.scenarios import workloads
from k3verify.verdict.gate import ReferenceRuns, check_toggle
from k3verify.run.sequential import run_scenario

# two-sided 95% t quantiles by degrees of freedom (1..30); normal beyond
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042]


@dataclass
class ABResult:
    label_a: str
    label_b: str
    times_a: list[float]
    times_b: list[float]
    tokens: int
    ratio: float = field(init=False)          # time_a / time_b: > 1 means b is faster
    ci_low: float = field(init=False)
    ci_high: float = field(init=False)

    def __post_init__(self) -> None:
        logs = [math.log(a / b) for a, b in zip(self.times_a, self.times_b)]
        mean = statistics.fmean(logs)
        n = len(logs)
        half = 0.0 if n < 2 else (_T95[min(n - 2, 29)] if n - 1 <= 30 else 1.96) * statistics.stdev(logs) / math.sqrt(n)
        self.ratio, self.ci_low, self.ci_high = math.exp(mean), math.exp(mean - half), math.exp(mean + half)

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.label_a, "b": self.label_b, "ratio": self.ratio, "ci95": [self.ci_low, self.ci_high],
                "median_s_a": statistics.median(self.times_a), "median_s_b": statistics.median(self.times_b),
                "tokens_per_s_a": self.tokens / statistics.median(self.times_a),
                "tokens_per_s_b": self.tokens / statistics.median(self.times_b),
                "repeats": len(self.times_a), "tokens": self.tokens}


def interleaved(run_a: Callable[[], Any], run_b: Callable[[], Any], *, repeats: int, tokens: int,
                labels: tuple[str, str] = ("reference", "candidate")) -> ABResult:
    run_a(), run_b()                                        # warm-up, not timed
    ta, tb = [], []
    for i in range(repeats):
        order = (("a", run_a), ("b", run_b)) if i % 2 == 0 else (("b", run_b), ("a", run_a))
        for which, fn in order:
            t0 = time.perf_counter()
            fn()
            (ta if which == "a" else tb).append(time.perf_counter() - t0)
    return ABResult(labels[0], labels[1], ta, tb, tokens)


def workload(name: str, scale: float):
    """agentic | decode | prefill -> a Scenario."""
    if name == "agentic":
        return workloads.build("agentic", scale=scale)
    if name == "decode":
        return workloads.build("single", scale=scale)
    if name == "prefill":
        return workloads.build("long_prompt", scale=scale)
    raise ValueError(f"workload must be agentic, decode or prefill, got {name!r}")


def scenario_tokens(sc) -> int:
    return sum(len(r.prompt_ids) + r.max_new_tokens for r in sc.requests)


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
    refs = ReferenceRuns(model)
    results = check_toggle(model, toggle, sc, references=refs)
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
    if failed:
        counted, why = False, f"contract failed on {sc.name}: {failed[0].check}: {failed[0].reason}"
    else:
        counted, why = True, f"contract {results[0].contract} held on {sc.name} in this run"
    roof = {}
    if hbm_bytes_per_s and workload_name == "decode":
        import statistics
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
    sc = workloads.build("multi_length", scale=scale)

    def plain():
        _run_sequential(model, sc, {}, [_NullObserver()], None)

    def captured():
        _run_sequential(model, sc, {}, [Capture()], None)
    ab = interleaved(plain, captured, repeats=repeats, tokens=scenario_tokens(sc),
                     labels=("no capture", "hash capture"))
    d = ab.to_dict()
    d["overhead"] = 1.0 / ab.ratio - 1.0                   # extra time of the captured run
    return d
