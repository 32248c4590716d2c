"""Retry-After on a full queue is the queue's measured wait (issue 29).

The old header said one job's time (1-2 s) while a full queue of 32 needed ~30 s: 48 of 100 clients
that honoured it gave up. The rule tested here: a client refused with 429 that comes back after
Retry-After seconds finds the jobs that were ahead of it done, give or take a factor of 2; it is
measured on a backend whose jobs take a known time. A client that returned when the first slot
freed would race every other refused client for that one slot, so the time until the queue ahead
has cleared is the wait that matters.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from k3verify.serving.app import create_app  # noqa: E402
from k3verify.serving.backends.base import TokenEvent  # noqa: E402
from k3verify.serving.lifecycle import ServerThread  # noqa: E402
from k3verify.serving.validation import ServeLimits  # noqa: E402
from k3verify.serving.worker import GenerationWorker  # noqa: E402
from optimized_stack.tokenizer import ByteTokenizer  # noqa: E402

TOK = ByteTokenizer()
TOKEN_S = 0.02      # each token of the fake backend takes this long
JOB_TOKENS = 20     # so each job takes ~0.4 s
MAX_QUEUE = 8       # 1 running + 8 waiting: the queue ahead of a refused client takes ~3.6 s
FACTOR = 2.0        # Retry-After must be within this factor of the measured wait (+1 s for its ceil)
BOUND_S = 30        # every wait in this file ends by then


class Timed:
    """Each generation takes JOB_TOKENS * TOKEN_S seconds."""

    def generate(self, prompt_ids, params, constraint=None):
        for i in range(params.max_tokens):
            time.sleep(TOKEN_S)
            yield TokenEvent(token_id=ord("a") + i % 26, logprob=-0.5)


def fits(retry_after_s: int, waited_s: float) -> bool:
    return waited_s / FACTOR <= retry_after_s <= waited_s * FACTOR + 1


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {BOUND_S} s waiting for {what}"
        time.sleep(0.005)


def retry_after_and_actual_wait() -> tuple[int, float]:
    """Fill the queue, get one 429 -> (its Retry-After, seconds until the jobs ahead were all done)."""
    app = create_app(Timed(), TOK, "fake", limits=ServeLimits(max_queue=MAX_QUEUE))
    worker = app.state.worker
    body = {"prompt": "a", "max_tokens": JOB_TOKENS}
    with ServerThread(app) as server, httpx.Client(base_url=server.base_url, timeout=BOUND_S) as client:
        assert client.post("/completions", json=body).status_code == 200  # one measured job for the estimate
        statuses: list[int] = []

        def one():
            statuses.append(httpx.post(f"{server.base_url}/completions", json=body, timeout=BOUND_S).status_code)

        threads = [threading.Thread(target=one, daemon=True) for _ in range(MAX_QUEUE + 1)]
        with contextlib.ExitStack() as stack:
            stack.callback(lambda: [t.join(BOUND_S) for t in threads])
            for t in threads:
                t.start()
            wait_until(lambda: worker.state()["running"] and worker.state()["waiting"] == MAX_QUEUE,
                       "the queue to fill")
            refused = client.post("/completions", json=body)
            refused_at = time.monotonic()
            assert refused.status_code == 429, refused.text
            wait_until(lambda: not worker.state()["running"] and worker.state()["waiting"] == 0,
                       "the jobs ahead to finish")
            waited_s = time.monotonic() - refused_at
        assert statuses == [200] * (MAX_QUEUE + 1), statuses
        return int(refused.headers["retry-after"]), waited_s


def test_retry_after_is_the_measured_wait_for_the_queue_ahead():
    retry_after_s, waited_s = retry_after_and_actual_wait()
    assert fits(retry_after_s, waited_s), \
        f"Retry-After {retry_after_s} s, but the jobs ahead took {waited_s:.2f} s (allowed: within x{FACTOR:g})"


def test_negative_control_the_old_one_job_estimate_fails(monkeypatch):
    # The old rule: one job's time, at least 1 s. On a full queue it must be caught as too short.
    monkeypatch.setattr(GenerationWorker, "_retry_after_s", lambda self: min(60, max(1, math.ceil(self._job_s))))
    retry_after_s, waited_s = retry_after_and_actual_wait()
    assert not fits(retry_after_s, waited_s), \
        f"the old rule's Retry-After {retry_after_s} s passed for a wait of {waited_s:.2f} s: the check cannot fail"


def test_probes_and_cancelled_jobs_do_not_count_toward_the_estimate():
    from k3verify.serving.worker import JOB_S_PRIOR, Job

    worker = GenerationWorker(max_queue=1, stall_s=10)
    try:
        probe, cancelled, real = (Job(None, None) for _ in range(3))
        probe.probe = True
        cancelled._cancelled.set()
        with worker._cond:
            worker._measure(probe, 0.001)
            worker._measure(cancelled, 0.001)
            assert worker._job_s == JOB_S_PRIOR, "a probe or a cancelled job moved the estimate"
            worker._measure(real, 3.0)
            assert worker._job_s == 3.0, "the first measured job must replace the prior"
            worker._measure(real, 1.0)
            assert worker._job_s == pytest.approx(0.8 * 3.0 + 0.2 * 1.0)
    finally:
        worker.stop("test over")
