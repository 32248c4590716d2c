"""Process groups for tensor parallelism: spawn W ranks, run jobs on all of them, return
rank 0's result. torch.distributed does the communication (gloo on CPU, NCCL on GPU);
this file only starts the ranks and wraps the collectives the TP model uses.

    with RankPool(2, init=build, init_args=(model,)) as pool:   # ranks start once
        out = pool.run(job, scenario)       # job(ctx, scenario) on every rank -> rank 0's value

A pool is kept alive across jobs because starting a rank (importing torch in a fresh
process) costs seconds on the 2-core CI machine, much more than a small scenario.
Collectives at world size 1 are the identity, so the TP model also runs in-process
without any process group (`Comm(0, 1)`).
"""
from __future__ import annotations

import atexit
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import K3Error

BACKENDS = ("gloo", "nccl")


class Comm:
    """The collectives of one rank. Every rank must make the same calls in the same order."""

    def __init__(self, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise K3Error(f"rank: expected 0 <= rank < world size {world_size}, got {rank}")
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or max) over ranks; returns a new tensor, identical bits on every rank."""
        t = t.contiguous().clone()
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (same shape on all ranks), in rank order."""
        t = t.contiguous()
        if self.world_size == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t)
        return out

    def gather_parts(self, t: torch.Tensor, sizes: list[int], dim: int = 0) -> list[torch.Tensor]:
        """Uneven all-gather: rank r holds sizes[r] entries along `dim`; returns the W parts
        in rank order (padded to the largest for the collective, trimmed after)."""
        if t.shape[dim] != sizes[self.rank]:
            raise K3Error(f"gather_parts: rank {self.rank} expected {sizes[self.rank]} entries on dim {dim}, "
                          f"got {t.shape[dim]}")
        top = max(sizes)
        if t.shape[dim] < top:
            pad_shape = list(t.shape)
            pad_shape[dim] = top - t.shape[dim]
            t = torch.cat([t, t.new_zeros(pad_shape)], dim)
        parts = self.all_gather(t)
        return [p.narrow(dim, 0, n) for p, n in zip(parts, sizes)]

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        t = t.contiguous().clone()
        if self.world_size > 1:
            dist.broadcast(t, src)
        return t


def split_sizes(n: int, world_size: int) -> list[int]:
    """Contiguous shard sizes of n items over W ranks, the first n % W ranks one larger
    (a rank may own nothing when n < W)."""
    base, extra = divmod(n, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def shard_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    sizes = split_sizes(n, world_size)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


@dataclass
class RankContext:
    """What a job sees on its rank; `state` keeps per-rank objects between jobs."""

    rank: int
    world_size: int
    device: torch.device
    comm: Comm
    state: dict[str, Any] = field(default_factory=dict)


def _worker(rank: int, world_size: int, store: str, backend: str, threads: int, timeout_s: float,
            inbox, outbox, init: Callable | None, init_args: tuple) -> None:
    try:
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        ctx = RankContext(rank, world_size, device, Comm(rank, world_size))
        if init is not None:
            init(ctx, *init_args)
        outbox.put((rank, "ready", True, None))
    except BaseException:
        outbox.put((rank, "ready", False, traceback.format_exc()))
        return
    while True:
        job = inbox.get()
        if job is None:
            break
        job_id, fn, args = job
        try:
            out = fn(ctx, *args)
            # plain pickle: tensors travel by value (no shared-memory file handle per tensor)
            outbox.put((rank, job_id, True, pickle.dumps(out) if rank == 0 else None))
        except BaseException:
            outbox.put((rank, job_id, False, traceback.format_exc()))
            break                           # the group is in an unknown state: stop this rank
    dist.destroy_process_group()


class RankPool:
    """W ranks of one process group, started once; `run` executes a job on all of them."""

    def __init__(self, world_size: int, *, init: Callable | None = None, init_args: tuple = (),
                 backend: str = "gloo", threads_per_rank: int | None = None, timeout_s: float = 600.0):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise K3Error(f"world size: expected an integer >= 1, got {world_size!r}")
        if backend not in BACKENDS:
            raise K3Error(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise K3Error(f"nccl at world size {world_size} needs {world_size} GPUs, found {torch.cuda.device_count()}")
        self.world_size, self.backend, self.timeout_s = world_size, backend, timeout_s
        # ranks share the cores: oversubscribed threads would only slow every rank down
        threads = threads_per_rank or max(1, torch.get_num_threads() // world_size)
        self._dir = tempfile.mkdtemp(prefix="k3tp-")
        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_worker, daemon=True, args=(
            r, world_size, os.path.join(self._dir, "store"), backend, threads, timeout_s,
            self._inboxes[r], self._outbox, init, init_args)) for r in range(world_size)]
        self._jobs = 0
        self.closed = False
        t0 = time.perf_counter()
        for p in self._procs:
            p.start()
        atexit.register(self.close)
        try:
            self._collect("ready")
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - t0

    def run(self, fn: Callable, *args: Any) -> Any:
        """fn(ctx, *args) on every rank (fn must be importable: it is pickled by name);
        returns rank 0's value. A failure on any rank raises and closes the pool."""
        if self.closed:
            raise RuntimeError("RankPool.run: the pool is closed")
        self._jobs += 1
        job_id = f"job{self._jobs}"
        for box in self._inboxes:
            box.put((job_id, fn, args))
        try:
            return self._collect(job_id)
        except BaseException:
            self.close()
            raise

    def _collect(self, tag: str) -> Any:
        results: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(results) < self.world_size:
            try:
                rank, got, ok, payload = self._outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited (code {self._procs[dead[0]].exitcode}) "
                                       f"before answering {tag}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{tag}: no answer from every rank within {self.timeout_s:g} s")
                continue
            if got != tag:
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed in {tag}:\n{payload}")
            results[rank] = payload
        return None if results[0] is None else pickle.loads(results[0])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for box in self._inboxes:
            try:
                box.put(None)
            except (OSError, ValueError):
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch(fn: Callable, world_size: int, *args: Any, backend: str = "gloo") -> Any:
    """One job on W fresh ranks: fn(ctx, *args) everywhere, rank 0's value returned."""
    with RankPool(world_size, backend=backend) as pool:
        return pool.run(fn, *args)
