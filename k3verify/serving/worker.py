"""The generation worker: the one thread that owns the backend, fed by a bounded queue.

Why this shape: the backend serves one generation at a time (one model, one incremental
state per request). Before, every request drove the backend from a thread-pool thread and
held the backend's lock across each streamed token. A client that went away mid-stream left
the lock held for good; 41 concurrent streams put 40 pool threads (anyio's default limit)
to sleep on the lock while its holder needed a 41st thread for its next token. Now:

- only this worker's threads call the backend (one thread for the reference backend, which serves
  one generation at a time; as many as a batching backend runs together); nothing else waits on it;
- a request is a Job in a FIFO of at most `max_queue` waiting jobs behind the running one;
  past that, submit() raises QueueFull at once (HTTP 429 with Retry-After), never blocks;
- the event loop only awaits a job's own asyncio queue, so a waiting request holds no
  thread and no lock;
- cancel() (client gone, server draining) drops a queued job, or stops a running one after
  the token in flight: one forward at most, then the backend's stream is closed.

Readiness: the worker stamps `progress` at every token and every idle wake-up (each
IDLE_TICK_S); a worker that is busy without progress for `stall_s` is wedged. An idle
worker is probed with a real one-token generation (see ready()).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque

from k3verify.serving.generation import Generation

IDLE_TICK_S = 0.5  # an idle worker wakes this often, so its progress stamp stays fresh
# Retry-After (issue 29): the expected wait for the jobs ahead, from a running estimate of one job's
# wall time. The old answer was one job's time (1-2 s) while a full queue of 32 needed ~30 s, so 48 of
# 100 clients that honoured it gave up. The prior stands until the first job is measured.
JOB_S_PRIOR = 1.0        # seconds per job before any is measured: ~256 tokens of k3-mini on 2 cores
JOB_S_WEIGHT = 0.2       # weight of the newest measurement in the moving average
WORKERS = 1              # generation threads by default: the reference backend serves one generation at a time
MAX_RETRY_AFTER_S = 3600  # a bound on the header, not on the estimate's honesty: past an hour, ask again


class QueueFull(Exception):
    """The queue holds max_queue waiting jobs; retry_after_s is the expected wait for a slot."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Draining(Exception):
    """The worker takes no new work: the server is shutting down."""


class JobCancelled(Exception):
    """The job was cancelled before it finished; the message says why."""


class Job:
    """One request's generation, from the worker thread to the event loop that submitted it."""

    def __init__(self, gen: Generation, loop: asyncio.AbstractEventLoop):
        self.gen = gen
        self._loop = loop
        self._items: asyncio.Queue = asyncio.Queue()  # ("piece", (text, events)) | ("done", None) | ("error", exc)
        self._cancelled = threading.Event()
        self.cancel_reason = ""
        self.probe = False  # a readiness probe: one token, not a request, so not in the wait estimate

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _emit(self, kind: str, value=None) -> None:
        """Called on the worker thread; hands one item to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._cancelled.set()

    async def pieces(self):
        """The (text, events) pieces in order; then gen's finish_reason, tool_calls and usage are final.
        Raises JobCancelled if the job was cancelled, or the backend's own exception."""
        while True:
            kind, value = await self._items.get()
            if kind == "piece":
                yield value
            elif kind == "done":
                return
            else:
                raise value  # JobCancelled, or what the backend raised


class GenerationWorker:
    """Owns `backend` calls on one daemon thread; see the module docstring."""

    def __init__(self, max_queue: int, stall_s: float, name: str = "k3verify-generate",
                 job_s_prior: float = JOB_S_PRIOR, workers: int = WORKERS):
        """workers: generations run at once, one thread each (a batching backend, such as the engine
        backend, serves that many together; the reference backend serves one)."""
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        self.max_queue, self.stall_s, self.workers = max_queue, stall_s, workers
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._accepting, self._stopped = True, False
        self._progress = time.monotonic()
        self._job_s, self._jobs_measured = job_s_prior, 0  # moving average of a job's wall time, s
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}" if i else name, daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def _alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    # ---- called from the event loop ---------------------------------------------------------

    def submit(self, gen: Generation, front: bool = False) -> Job:
        """Queue a generation; QueueFull past max_queue waiting jobs, Draining once shutdown began.
        front=True (readiness probes only) jumps the queue and does not count against its depth."""
        job = Job(gen, asyncio.get_running_loop())
        with self._cond:
            if not self._accepting:
                raise Draining("the server is shutting down and takes no new requests")
            if not self._alive():  # queued work would never run: refuse it, never hang it
                raise Draining("the generation worker thread has stopped; restart the server")
            busy = len(self._running) >= self.workers or self._waiting
            if not front and len(self._waiting) >= self.max_queue and busy:
                wait_s = self._retry_after_s()
                raise QueueFull(f"the generation queue is full ({len(self._waiting)} waiting behind the running "
                                f"request, --max-queue {self.max_queue}); retry after {wait_s} s "
                                f"(~{self._job_s:.2g} s per request)", wait_s)
            job.probe = front
            (self._waiting.appendleft if front else self._waiting.append)(job)
            self._cond.notify_all()
        return job

    def _retry_after_s(self) -> int:
        """Seconds until the jobs ahead of a newcomer (the running one and the queue) should be done:
        ceil(depth * seconds per job / workers), at least 1. Called with _cond held."""
        depth = len(self._waiting) + len(self._running)
        return min(MAX_RETRY_AFTER_S, max(1, math.ceil(depth * self._job_s / self.workers)))

    def _measure(self, job: Job, seconds: float) -> None:
        """Fold one finished job's wall time into the estimate (called with _cond held). Probes and
        cancelled jobs are left out: they end early and would make the queue look faster than it is."""
        if job.probe or job.cancelled:
            return
        self._jobs_measured += 1
        self._job_s = seconds if self._jobs_measured == 1 else \
            (1 - JOB_S_WEIGHT) * self._job_s + JOB_S_WEIGHT * seconds

    def cancel(self, job: Job, reason: str) -> None:
        """Stop a job: dropped if still queued, ended after the token in flight if running. Idempotent."""
        with self._cond:
            if job.cancelled:
                return
            job.cancel_reason = reason
            job._cancelled.set()
            if job in self._waiting:
                self._waiting.remove(job)
                job._emit("error", JobCancelled(reason))
            self._cond.notify_all()

    def state(self) -> dict:
        with self._cond:
            return {"alive": self._alive(), "accepting": self._accepting,
                    "running": bool(self._running), "running_jobs": len(self._running), "waiting": len(self._waiting),
                    "since_progress_s": round(time.monotonic() - self._progress, 3)}

    async def ready(self, probe: Generation, timeout_s: float) -> tuple[bool, dict]:
        """Readiness: (ok, detail). Idle: a real one-token generation must finish within timeout_s.
        Busy: the worker must have made progress (a token, a job start) within stall_s."""
        st = self.state()
        if not st["alive"]:
            return False, {**st, "reason": "the generation worker thread has stopped"}
        if not st["accepting"]:
            return False, {**st, "reason": "the server is draining for shutdown"}
        if st["running"] or st["waiting"]:
            if st["since_progress_s"] > self.stall_s:
                return False, {**st, "reason": f"no generation progress for {st['since_progress_s']:.1f} s "
                                               f"(stall limit {self.stall_s:g} s): the worker is wedged"}
            return True, {**st, "reason": "busy and making progress"}
        started = time.monotonic()
        try:
            job = self.submit(probe, front=True)
        except Draining as e:
            return False, {**st, "reason": str(e)}
        try:
            await asyncio.wait_for(_drain(job), timeout_s)
        except asyncio.TimeoutError:
            return False, {**self.state(), "reason": f"a one-token probe generation did not finish in {timeout_s:g} s"}
        except Exception as e:  # the backend raised: not ready
            return False, {**self.state(), "reason": f"the probe generation failed: {type(e).__name__}: {e}"}
        finally:
            self.cancel(job, "readiness probe ended")
        return True, {**self.state(), "reason": "a one-token probe generation finished",
                      "probe_ms": round(1000 * (time.monotonic() - started), 1)}

    # ---- shutdown (any thread) ----------------------------------------------------------------

    def drain(self, timeout_s: float, abort: threading.Event | None = None) -> bool:
        """Take no new work; wait up to timeout_s for the running and queued jobs. True if all finished."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._accepting = False
            while self._running or self._waiting:
                left = deadline - time.monotonic()
                if left <= 0 or (abort is not None and abort.is_set()):
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    def stop(self, reason: str, join_s: float = 5.0) -> bool:
        """Cancel everything and end the thread; True if it ended within join_s (a wedged backend
        call cannot be interrupted; the thread is a daemon, so it does not keep the process alive)."""
        with self._cond:
            self._accepting, self._stopped = False, True
            jobs = list(self._waiting) + list(self._running)
        for job in jobs:
            self.cancel(job, reason)
        with self._cond:
            self._cond.notify_all()
        deadline = time.monotonic() + join_s
        for t in self._threads:
            if threading.current_thread() is not t:
                t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    # ---- the worker thread --------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopped:
                    self._progress = time.monotonic()
                    self._cond.wait(IDLE_TICK_S)
                if self._stopped:
                    return
                job = self._waiting.popleft()
                self._running.append(job)
                self._progress = started = time.monotonic()
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running.remove(job)
                    self._progress = time.monotonic()
                    self._measure(job, self._progress - started)
                    self._cond.notify_all()

    def _tick(self, job: Job) -> bool:
        self._progress = time.monotonic()
        return job.cancelled

    def _run(self, job: Job) -> None:
        if job.cancelled:  # cancelled between leaving the queue and starting: no prefill for nobody
            job._emit("error", JobCancelled(job.cancel_reason))
            return
        try:
            for piece in job.gen.deltas(lambda: self._tick(job)):
                job._emit("piece", piece)
        except Exception as e:  # the backend's error goes to the request, the worker lives on
            job._emit("error", e)
            return
        if job.gen.stopped_early:  # a job that finished before its cancel took effect is delivered whole
            job._emit("error", JobCancelled(job.cancel_reason))
        else:
            job._emit("done")


async def _drain(job: Job) -> None:
    async for _ in job.pieces():
        pass
