"""`k3verify all --jobs N`: a suite's units across N processes.

The checks are dispatch-bound (thousands of small ops per step, one Python thread each), so on a
GPU host one process leaves the device idle and on the 2-core CPU a second process uses the second
core (the cores are split between the processes: threads_per_job). Every unit already leaves its own checks file and a resumed run skips finished units, so the
split needs no new state: the parent writes plan.json, starts N-1 workers
(`k3verify all --resume RUN_ID --shard i/N`), runs shard 0 itself, waits, then runs whatever is
still missing (a worker that died costs time, never units) and writes the one report.

Assignment is deterministic (every process computes it from the plan alone): units are grouped
by (model, scenario), so one process computes each scenario's reference capture once, and the
groups go largest first to the least loaded shard by the kinds' cost priors (LPT scheduling).

The kinds' priors are seconds on the 2-core dev CPU, and on a GPU their proportions are wrong by
two orders: on the fifth H200 release run a GSM8K unit's prior was ~8,900 s against 64-400 s
measured, a k3-small selftest unit's a fraction of its ~100 s, so every shard drew one GSM8K unit
and the 13 k3-small units and the speculative group piled onto two shards (1,256 and 1,282 s of
work against a mean of 566 s); idle workers stole them late, each steal paying the model load and
the reference again (~90 s). A suite may therefore name measured priors (`priors = FILE`, a units.tsv
of an earlier run on that device, perf/unit_times.py): a unit found there costs its measured
seconds; one that is not (a new toggle) costs its kind's prior times the median measured/prior ratio
of its kind's units (of all units when its kind has none). Re-planned from the fifth run's own
seconds, the largest shard falls from 1,282 s to 767 s (tests/test_jobs.py keeps the rule).
"""
from __future__ import annotations

import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Mapping

from k3verify import kinds
from k3verify.errors import UsageError
from k3verify.kinds.base import Unit


def parse_shard(text: str) -> tuple[int, int]:
    """'1/4' -> (1, 4); refused in one line unless 0 <= i < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UsageError(f"--shard expects I/N (like 1/4), got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise UsageError(f"--shard expects I/N with 0 <= I < N, got {text!r}")
    return i, n


def prior_key(unit_id: str) -> str:
    """A unit's id without its plan position ('159-gsm8k-synth-moe_fp8_stage2' -> 'gsm8k-synth-
    moe_fp8_stage2'): stable when a new toggle shifts the numbering."""
    return re.sub(r"^\d+-", "", unit_id)


def unit_costs(units: list[Unit], priors: Mapping[str, float] | None = None) -> dict[str, float]:
    """unit id -> prior seconds: measured where `priors` (prior_key -> seconds) has the unit, else the
    kind's prior scaled to the measured ones (module docstring)."""
    base = {u.id: kinds.cost_s(u) for u in units}
    if not priors:
        return base
    measured = {u.id: float(priors[prior_key(u.id)]) for u in units if prior_key(u.id) in priors}
    ratios: dict[str, list[float]] = {}
    for u in units:
        if u.id in measured and base[u.id] > 0:
            ratios.setdefault(u.kind, []).append(measured[u.id] / base[u.id])
    every = [r for rs in ratios.values() for r in rs]
    out = {}
    for u in units:
        if u.id in measured:
            out[u.id] = measured[u.id]
        else:
            rs = ratios.get(u.kind) or every
            out[u.id] = base[u.id] * (statistics.median(rs) if rs else 1.0)
    return out


def assign(units: list[Unit], n: int, priors: Mapping[str, float] | None = None) -> dict[str, int]:
    """unit id -> shard in [0, n): (model, scenario) groups, largest prior cost first, each to the
    least loaded shard (ties to the lowest index).

    A group that alone costs more than a fair share (total / n) is cut into that many parts, each
    its own group: a quality gate's units (one per toggle, one group: the kind is their scenario)
    would otherwise run one after another in one process while the others idle (measured on the
    H200: 12 needle units, ~150 s each, in one shard). Each part pays for its own reference."""
    cost_of = unit_costs(units, priors)
    groups: dict[tuple, list[Unit]] = {}
    for u in units:
        groups.setdefault((u.model or "", u.scenario or u.kind), []).append(u)
    share = sum(cost_of.values()) / n
    for key in sorted(groups):
        members = groups[key]
        cost = sum(cost_of[u.id] for u in members)
        parts = min(len(members), math.ceil(cost / share)) if share > 0 else 1
        if parts > 1:
            del groups[key]
            # parts of near-equal cost: members largest first into the lightest part (a round robin
            # in plan order put three of golden/k3-dims' longest GSM8K units into one 776 s part)
            part_of, part_cost = {}, [0.0] * parts
            for u in sorted(members, key=lambda u: (-cost_of[u.id], u.id)):
                p = min(range(parts), key=lambda i: (part_cost[i], i))
                part_of[u.id] = p
                part_cost[p] += cost_of[u.id]
            for p in range(parts):   # each part keeps plan order
                groups[(*key, p)] = [u for u in members if part_of[u.id] == p]
    load = [0.0] * n
    out: dict[str, int] = {}
    for key in sorted(groups, key=lambda k: (-sum(cost_of[u.id] for u in groups[k]), k)):
        shard = min(range(n), key=lambda s: (load[s], s))
        load[shard] += sum(cost_of[u.id] for u in groups[key])
        for u in groups[key]:
            out[u.id] = shard
    return out


def threads_per_job(n: int) -> int:
    """The cores split between n processes. Measured on the 2-core dev CPU (premerge, 2026-12-02):
    one process at 2 threads 283 s; two at 1 thread each 157 s; two at 2 threads each 813 s (torch's
    threads spin against each other when the cores are oversubscribed)."""
    return max(1, (os.cpu_count() or 1) // n)


def start_workers(run_id: str, run_dir: Path, n: int, extra_args: list[str]) -> list[tuple[int, subprocess.Popen, Path]]:
    """Shards 1..n-1 as `python -m k3verify all --resume RUN_ID --shard i/n`, each logging to
    run_dir/workers/shard-i.log, each with threads_per_job(n) torch threads, as the caller sets
    for itself: one thread count in every process of a run, because it is part of the numerics
    environment that golden hashes are keyed by."""
    logs = run_dir / "workers"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_job(n))}
    procs = []
    for i in range(1, n):
        log = logs / f"shard-{i}.log"
        cmd = [sys.executable, "-m", "k3verify", "all", "--resume", run_id, "--report-dir", str(run_dir),
               "--shard", f"{i}/{n}", *extra_args]
        with open(log, "wb") as fh:
            procs.append((i, subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env), log))
    return procs


class Pace:
    """The expected seconds `--finish-by` tests a unit against, rescaled by how fast this attempt's
    units actually ran against their priors.

    The priors are one earlier run's seconds on one device set-up; the next run can be several times
    faster (CUDA MPS: the exact selftest's unit work fell 3.9x, session 14's A/B on an H100) or slower
    (a shared machine). With the raw priors, a finish-by tuned to the old pace refuses units that
    would fit (a 400 s GSM8K prior against ~100 s of real work), or starts units that cannot end.
    So each process reads the checks files that appeared since it started (this attempt's units,
    written by any shard) and multiplies a unit's prior by the median measured/prior ratio of its
    kind's finished units (>= 2 of them), else of all finished units (>= 3), else by 1: until the
    attempt has measured itself, the priors stand as they are."""

    MIN_KIND, MIN_ALL = 2, 3

    def __init__(self, units: list[Unit], expected: Mapping[str, float], checks_dir: Path):
        self.expected = dict(expected)
        self.kind_of = {u.id: u.kind for u in units}
        self.checks_dir = Path(checks_dir)
        self.seen = set(self._names())          # finished by an earlier attempt: not this pace
        self.ratios: dict[str, list[float]] = {}

    def _names(self) -> list[str]:
        try:
            return [p.name for p in self.checks_dir.glob("*.json")]
        except OSError:
            return []

    def _update(self) -> None:
        import json
        for name in self._names():
            if name in self.seen:
                continue
            try:
                data = json.loads((self.checks_dir / name).read_text(encoding="utf-8"))
                uid, seconds = data["unit"]["id"], float(data["duration_s"])
            except (OSError, ValueError, KeyError, TypeError):
                continue                        # being written (atomic rename: rare) or foreign: next time
            self.seen.add(name)
            prior = self.expected.get(uid)
            if prior and prior > 0 and uid in self.kind_of:
                self.ratios.setdefault(self.kind_of[uid], []).append(seconds / prior)

    def factor(self, unit_id: str) -> float:
        self._update()
        mine = self.ratios.get(self.kind_of.get(unit_id, ""), [])
        if len(mine) >= self.MIN_KIND:
            return statistics.median(mine)
        every = [r for rs in self.ratios.values() for r in rs]
        return statistics.median(every) if len(every) >= self.MIN_ALL else 1.0

    def expect(self, unit_id: str) -> float:
        return self.expected[unit_id] * self.factor(unit_id)
