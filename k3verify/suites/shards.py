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
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

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


def assign(units: list[Unit], n: int) -> dict[str, int]:
    """unit id -> shard in [0, n): (model, scenario) groups, largest prior cost first, each to the
    least loaded shard (ties to the lowest index).

    A group that alone costs more than a fair share (total / n) is cut into that many parts, each
    its own group: a quality gate's units (one per toggle, one group: the kind is their scenario)
    would otherwise run one after another in one process while the others idle (measured on the
    H200: 12 needle units, ~150 s each, in one shard). Each part pays for its own reference."""
    groups: dict[tuple, list[Unit]] = {}
    for u in units:
        groups.setdefault((u.model or "", u.scenario or u.kind), []).append(u)
    share = sum(kinds.cost_s(u) for u in units) / n
    for key in sorted(groups):
        members = groups[key]
        cost = sum(kinds.cost_s(u) for u in members)
        parts = min(len(members), math.ceil(cost / share)) if share > 0 else 1
        if parts > 1:
            del groups[key]
            for p in range(parts):   # round-robin in plan order: parts of near-equal cost
                groups[(*key, p)] = members[p::parts]
    load = [0.0] * n
    out: dict[str, int] = {}
    for key in sorted(groups, key=lambda k: (-sum(kinds.cost_s(u) for u in groups[k]), k)):
        shard = min(range(n), key=lambda s: (load[s], s))
        load[shard] += sum(kinds.cost_s(u) for u in groups[key])
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
