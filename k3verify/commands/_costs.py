"""Prior seconds per unit of work on the 2-core dev CPU, for the progress estimate only.

The progress line (commands._progress) rescales each kind by the measured durations as
its items finish, so these only need the right shape (what grows with what) and a rough
scale before the first item of a kind has finished.

Measured 2026-12-01 with the other core busy: a diff/drift check ~0.08 s per scenario token
(prefill_step_api: single 8 s, long_prompt at scale 0.25 36 s, multi_turn 107 s); selftest
94-120 s at scale 1 (NOTES.md); golden check 4 s; gsm8k-synth ~10 s of lm-eval set-up, then
per question ~0.1 s per generated token and ~2 s per few-shot example; needle prefill
1.5 ms/token growing with length (4K 5 s, 8K 15 s, 32K 58-89 s, 108K 426 s: NOTES.md);
kvv against the served model ~60 s.
"""
from __future__ import annotations

import argparse

DIFF_S_PER_TOKEN = 0.08
GSM8K_SETUP_S = 10.0
SELFTEST_S = 120.0          # at scale 1
GOLDEN_S = 5.0
OTHER_S = 60.0              # kvv, and any kind added later


def diff_s(tokens: int) -> float:
    """A reference + candidate run of a scenario with `tokens` prompt + generated tokens."""
    return 1.0 + DIFF_S_PER_TOKEN * tokens


def needle_case_s(length_tokens: int) -> float:
    return 0.0015 * length_tokens * (1 + length_tokens / 65536) + 1.0


def gsm8k_question_s(max_new_tokens: int, num_fewshot: int) -> float:
    return 0.1 * max_new_tokens + 2.0 * num_fewshot


def bench_s(tokens: int, repeats: int) -> float:
    """The contract check, then a warm-up pair and `repeats` timed pairs (a single run is about half a diff)."""
    return diff_s(tokens) + DIFF_S_PER_TOKEN * tokens * (repeats + 1)


def unit_cost_s(unit: dict, args: argparse.Namespace | None = None) -> float:
    """A `k3verify all` unit's prior seconds; `args`: a gate unit's parsed arguments (run_all.precheck)."""
    kind, o = unit["kind"], unit["options"]
    sides = 2 if unit["toggle"] else 1
    if kind in ("diff", "drift"):
        from k3verify.scenarios import workloads
        from k3verify.perf.bench import scenario_tokens
        return diff_s(scenario_tokens(workloads.build(unit["scenario"], scale=o["scale"], seed=o["seed"])))
    if kind == "selftest":
        return SELFTEST_S * o["scale"]
    if kind == "golden":
        return GOLDEN_S
    if kind == "gsm8k":
        new_tokens, shots = (args.max_new_tokens, args.num_fewshot) if args else (256, 5)
        return sides * (GSM8K_SETUP_S + o["limit"] * gsm8k_question_s(new_tokens, shots))
    if kind == "needle":
        samples = args.samples if args else 1
        return sides * samples * len(o["depths"]) * sum(needle_case_s(n) for n in o["lengths"])
    if kind == "bench":
        from k3verify.perf.bench import scenario_tokens, workload
        from k3verify.suites.suite import bench_options
        kw = bench_options(o["args"])
        return bench_s(scenario_tokens(workload(kw["workload"], kw["scale"])), kw["repeats"])
    return OTHER_S
