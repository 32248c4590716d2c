"""HTTP plumbing between the app's endpoints and the generation worker (serving/worker.py).

- read_body: the body, refused with 413 past max_body_bytes before it is all read;
- submit: a job on the worker, or 429 / 503 with Retry-After instead of waiting;
- collect: a whole answer, abandoned (and its job cancelled) the moment the client hangs up;
- JobStream: a streamed answer whose job is cancelled however the response ends.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from k3verify.serving.generation import Generation
from k3verify.serving.validation import RequestError
from k3verify.serving.worker import Draining, GenerationWorker, Job, QueueFull

# OpenAI's error types by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "server_error"}
CLIENT_GONE = 499  # nginx's "client closed request": never seen by the client, only in logs


class ClientGone(Exception):
    """The client hung up before its answer was ready."""


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(exc: RequestError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, headers=exc.headers,
                        content=error_body(str(exc), exc.status, exc.param, exc.code))


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body; 413 as soon as it (declared or counted) passes max_bytes, so a huge body is
    never held in memory."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(f"the request body is {int(declared)} bytes; this server accepts at most {max_bytes} "
                           "(--max-body-bytes)", None, 413, "body_too_large")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > max_bytes:
            raise RequestError(f"the request body passed {max_bytes} bytes; this server accepts at most "
                               f"{max_bytes} (--max-body-bytes)", None, 413, "body_too_large")
    return bytes(buf)


def submit(worker: GenerationWorker, gen: Generation) -> Job:
    try:
        return worker.submit(gen)
    except QueueFull as e:
        raise RequestError(str(e), None, 429, "queue_full", {"Retry-After": str(e.retry_after_s)}) from None
    except Draining as e:
        raise RequestError(str(e), None, 503, "shutting_down", {"Retry-After": "5"}) from None


async def _hangup(request: Request) -> None:
    """Returns when the client disconnects (the body is read by now, so receive() only reports that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(worker: GenerationWorker, job: Job, request: Request) -> list:
    """All of a job's pieces; ClientGone (and the job cancelled) as soon as the client hangs up."""
    async def gather():
        return [piece async for piece in job.pieces()]
    answer, gone = asyncio.ensure_future(gather()), asyncio.ensure_future(_hangup(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        if answer.done():
            return answer.result()  # the backend's exception or JobCancelled propagates from here
        raise ClientGone()
    finally:
        answer.cancel()
        gone.cancel()
        worker.cancel(job, "the client disconnected")


class JobStream(StreamingResponse):
    """A streamed answer tied to its job. Starlette cancels the body when the client disconnects
    (ASGI < 2.4: listen_for_disconnect), and uvicorn cancels it past the shutdown timeout; either
    way the finally below stops the job, so the worker never generates for nobody."""

    def __init__(self, content, worker: GenerationWorker, job: Job):
        super().__init__(content, media_type="text/event-stream")
        self._worker, self._job = worker, job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._worker.cancel(self._job, "the client disconnected")


def gone_response() -> Response:
    return Response(status_code=CLIENT_GONE)
