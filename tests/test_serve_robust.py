"""The server survives its clients (issue 16): disconnects cancel generation, concurrency is bounded
by a queue that answers 429 instead of hanging, bad bodies get 4xx, /health tells a wedged worker.

All on loopback over fake backends (no model): a Ticker emits a token every delay_s and counts what
it produced and whether its stream was closed; a Wedged backend never returns its first token.
Every wait is bounded; after each failure mode a normal request must succeed within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from k3verify.serving.app import create_app  # noqa: E402
from k3verify.serving.backends.base import TokenEvent  # noqa: E402
from k3verify.serving.lifecycle import ServerThread  # noqa: E402
from k3verify.serving.validation import ServeLimits  # noqa: E402
from optimized_stack.tokenizer import ByteTokenizer  # noqa: E402

TOK = ByteTokenizer()
HI = [{"role": "user", "content": "hi"}]
NORMAL_S = 5.0  # a normal request after a failure mode must finish within this


class Ticker:
    def __init__(self, delay_s: float = 0.0):
        self.delay_s, self.produced, self.started, self.closed = delay_s, 0, 0, 0

    def generate(self, prompt_ids, params, constraint=None):
        self.started += 1
        try:
            for i in range(params.max_tokens):
                time.sleep(self.delay_s)
                self.produced += 1
                yield TokenEvent(token_id=ord("a") + i % 26, logprob=-0.5)
        finally:
            self.closed += 1


class Wedged:
    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def generate(self, prompt_ids, params, constraint=None):
        self.entered.set()
        self.release.wait(60)  # a hung kernel; the test releases it at the end
        yield TokenEvent(token_id=ord("a"), logprob=-0.5)


@contextlib.contextmanager
def serving(backend, **limits):
    with ServerThread(create_app(backend, TOK, "fake", limits=ServeLimits(**limits))) as server:
        with httpx.Client(base_url=server.base_url, timeout=NORMAL_S) as client:
            yield server, client


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.01)


def assert_normal_request_works(client) -> None:
    started = time.monotonic()
    r = client.post("/chat/completions", json={"messages": HI, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3 and time.monotonic() - started < NORMAL_S


def health(server) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=NORMAL_S)


def produced_during(backend, seconds: float) -> int:
    before = backend.produced
    time.sleep(seconds)
    return backend.produced - before


# ---- a client that goes away ------------------------------------------------------------------

@pytest.mark.parametrize("route", ["chat", "completions"])
def test_stream_disconnect_cancels_generation_and_frees_the_worker(route):
    backend = Ticker(delay_s=0.01)
    body = {"messages": HI} if route == "chat" else {"prompt": "hi"}
    with serving(backend) as (server, client):
        with client.stream("POST", f"/{route.replace('chat', 'chat/completions')}",
                           json={**body, "max_tokens": 4000, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            # negative control: while the client reads, the backend does produce tokens
            assert produced_during(backend, 0.2) > 3, "the measurement must see a live generation"
        wait_until(lambda: backend.closed == 1, 2.0, "the backend stream to be closed after the disconnect")
        assert produced_during(backend, 0.3) == 0, "tokens were produced after the client left"
        assert backend.produced < 400
        assert_normal_request_works(client)


def test_whole_answer_disconnect_cancels_generation():
    backend = Ticker(delay_s=0.01)
    with serving(backend) as (server, client):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base_url}/completions", json={"prompt": "hi", "max_tokens": 4000}, timeout=0.3)
        wait_until(lambda: backend.closed == 1, 2.0, "the backend stream to be closed after the disconnect")
        assert produced_during(backend, 0.3) == 0 and backend.produced < 400
        assert_normal_request_works(client)


def test_a_queued_request_whose_client_left_never_runs():
    backend = Ticker(delay_s=0.01)
    with serving(backend) as (server, client):
        with client.stream("POST", "/completions", json={"prompt": "a", "max_tokens": 4000, "stream": True}) as r:
            lines = r.iter_lines()  # held: a dropped iterator closes the response, which is a disconnect too
            next(lines)
            with pytest.raises(httpx.ReadTimeout):  # queued behind the stream, then abandoned
                httpx.post(f"{server.base_url}/completions", json={"prompt": "b", "max_tokens": 5}, timeout=0.3)
            wait_until(lambda: health(server).json()["waiting"] == 0, 2.0, "the abandoned request to leave the queue")
        wait_until(lambda: backend.closed == 1, 2.0, "the stream's generation to end")
        assert_normal_request_works(client)
        assert backend.started == 2, f"expected the stream and the normal request only, got {backend.started} runs"


# ---- many clients at once ---------------------------------------------------------------------

async def _stream_once(client: httpx.AsyncClient) -> tuple[int, str, dict]:
    """-> (status, 'done' | 'cut', headers or error body)."""
    body = {"messages": HI, "max_tokens": 4, "stream": True}
    async with client.stream("POST", "/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, "refused", {"retry_after": r.headers.get("retry-after"), **r.json()}
        lines = [line async for line in r.aiter_lines() if line]
        return 200, "done" if lines[-1] == "data: [DONE]" else "cut", {}


async def _hundred_streams(base_url: str, n: int, timeout_s: float = 60) -> list:
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits) as client:
        return await asyncio.wait_for(asyncio.gather(*(_stream_once(client) for _ in range(n))), timeout_s)


@pytest.mark.parametrize("max_queue,delay_s,must_refuse", [(4, 0.02, True), (128, 0.002, False)],
                         ids=["queue4-some-refused", "queue128-all-served"])
def test_100_concurrent_streams_are_served_or_told_to_retry(max_queue, delay_s, must_refuse):
    # More than anyio's 40 pool threads: the old server hung for good at 41 concurrent streams.
    backend = Ticker(delay_s=delay_s)
    with serving(backend, max_queue=max_queue) as (server, client):
        results = asyncio.run(_hundred_streams(server.base_url, 100))
        served = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] != 200]
        assert all(r[1] == "done" for r in served), "a served stream must end with data: [DONE]"
        for status, _, info in refused:
            assert status == 429 and info["error"]["type"] == "rate_limit_error", info
            assert info["retry_after"] is not None and int(info["retry_after"]) >= 1, info
            assert "--max-queue" in info["error"]["message"]
        assert served, "at least the first requests must be served"
        assert bool(refused) == must_refuse, f"{len(refused)} refused with --max-queue {max_queue}"
        assert_normal_request_works(client)


# ---- bad bodies -----------------------------------------------------------------------------------

def _chunks(total: int):
    yield b'{"prompt": "'
    for _ in range(total // 65536):
        yield b"x" * 65536
    yield b'"}'


NESTED = b"[" * 100_000 + b"]" * 100_000
DEEP_BUT_PARSEABLE = {"messages": HI, "metadata": {"a": json.loads("[" * 40 + "1" + "]" * 40)}}  # 42 levels
BAD_BODIES = {
    "body-2MiB": ("/completions", {"content": b'{"prompt": "' + b"x" * (2 << 20) + b'"}'}, 413,
                  r"the request body is 2097166 bytes; this server accepts at most 1048576 \(--max-body-bytes\)"),
    "body-chunked-2MiB": ("/completions", {"content": _chunks(2 << 20)}, 413,
                          r"the request body passed 1048576 bytes"),
    "nested-100k": ("/chat/completions", {"content": NESTED}, 400, r"nests arrays/objects deeper than"),
    "nested-42-levels": ("/chat/completions", {"json": DEEP_BUT_PARSEABLE}, 400,
                         r"nests arrays/objects more than 32 levels deep"),
    "prompt-too-long": ("/completions", {"json": {"prompt": "x" * 300}, }, 400,
                        r"the prompt is 300 tokens; this server accepts at most 256 \(--max-prompt-tokens\)"),
    "context-too-long": ("/completions", {"json": {"prompt": "x" * 200, "max_tokens": 400}}, 400,
                         r"prompt \(200 tokens\) \+ max_tokens \(400\) = 600 exceeds this server's context of 512"),
    "chat-prompt-too-long": ("/chat/completions", {"json": {"messages": [{"role": "user", "content": "y" * 300}]}},
                             400, r"the prompt is 3\d\d tokens; this server accepts at most 256"),
    "unknown-param": ("/chat/completions", {"json": {"messages": HI, "frobnicate": 1}}, 400,
                      r"unknown parameter 'frobnicate' for /v1/chat/completions; accepted: "),
    "misspelt-param": ("/completions", {"json": {"prompt": "hi", "max_token": 3}}, 400,
                       r"unknown parameter 'max_token' for /v1/completions; did you mean 'max_tokens'\?"),
    "logit-bias": ("/chat/completions", {"json": {"messages": HI, "logit_bias": {"65": 5}}}, 400,
                   r"logit_bias is not supported by this server"),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_body_gets_a_4xx_then_a_normal_request_works(name):
    path, send, status, match = BAD_BODIES[name]
    with serving(Ticker(), max_prompt_tokens=256, max_model_len=512, max_json_depth=32) as (server, client):
        headers = {"content-type": "application/json"}
        r = client.post(path, headers=headers, **send)
        assert r.status_code == status, r.text
        message = r.json()["error"]["message"]
        assert "\n" not in message and re.search(match, message), message
        assert_normal_request_works(client)


@pytest.mark.parametrize("fields", [
    {"thinking": {"type": "disabled"}},                       # KVV think_mode kimi
    {"chat_template_kwargs": {"thinking": False}},            # KVV think_mode opensource
    {"temperature": 0, "seed": 1234, "stop": ["\n"], "user": "u", "logit_bias": {}, "parallel_tool_calls": True,
     "max_completion_tokens": 2, "stream": False, "n": 1, "metadata": {"run": "x"}, "store": False},
], ids=["kvv-kimi", "kvv-opensource", "openai-extras"])
def test_parameters_clients_legitimately_send_are_accepted(fields):
    with serving(Ticker()) as (server, client):
        r = client.post("/chat/completions", json={"model": "fake", "messages": HI, "max_tokens": 2, **fields})
        assert r.status_code == 200, r.text


def test_lm_eval_local_completions_payload_is_accepted():
    # lm-eval 0.4.13 LocalCompletionsAPI._create_payload(generate=True), as k3verify gsm8k --base-url sends it
    payload = {"prompt": "Question: 1+1?\nAnswer:", "model": "fake", "max_tokens": 4, "temperature": 0.0,
               "stop": ["Question:", "</s>", "<|im_end|>"], "seed": 1234}
    with serving(Ticker()) as (server, client):
        r = client.post("/completions", json=payload)
        assert r.status_code == 200, r.text


# ---- readiness -------------------------------------------------------------------------------------

def test_health_is_200_when_a_probe_generation_completes():
    backend = Ticker()
    with serving(backend) as (server, client):
        r = health(server)
        assert r.status_code == 200 and r.json()["reason"] == "a one-token probe generation finished", r.text
        assert backend.started == 1, "readiness must run a real generation on an idle worker"


def test_health_is_503_when_the_worker_is_wedged():
    backend = Wedged()
    with serving(backend, stall_s=0.3, probe_timeout_s=0.5, max_queue=1) as (server, client):
        try:
            r = health(server)  # idle: the probe itself hangs
            assert r.status_code == 503 and "did not finish in 0.5 s" in r.json()["reason"], r.text
            assert client.get("/models").status_code == 200, "/v1/models answers; it is not readiness"
            time.sleep(0.4)
            r = health(server)  # busy with the hung probe, no progress past stall_s
            assert r.status_code == 503 and "the worker is wedged" in r.json()["reason"], r.text
            # a wedged worker still answers new requests at once: one queued, the next refused, never a hang
            body = {"prompt": "p", "max_tokens": 1, "stream": True}
            with client.stream("POST", "/completions", json=body) as held:
                assert held.status_code == 200  # headers go out at once; the job waits behind the hung probe
                r = client.post("/completions", json=body)
                assert r.status_code == 429 and r.headers["retry-after"], r.text
        finally:
            backend.release.set()
        wait_until(lambda: health(server).status_code == 200, NORMAL_S, "readiness after the backend recovered")


# ---- shutdown ----------------------------------------------------------------------------------------

def test_drain_refuses_new_work_then_stop_cancels_what_runs():
    backend = Ticker(delay_s=0.01)
    app = create_app(backend, TOK, "fake")
    with ServerThread(app) as server, httpx.Client(base_url=server.base_url, timeout=NORMAL_S) as client:
        with client.stream("POST", "/completions", json={"prompt": "a", "max_tokens": 4000, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            assert app.state.worker.drain(0.2) is False, "a 40 s generation cannot finish in a 0.2 s drain"
            refused = client.post("/completions", json={"prompt": "b", "max_tokens": 1})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
            assert refused.json()["error"]["code"] == "shutting_down"
            ready = health(server)
            assert ready.status_code == 503 and "draining" in ready.json()["reason"], ready.text
            assert app.state.worker.stop("the server is shutting down") is True
            rest = [line for line in lines if line]
    assert rest[-1].startswith("data: {\"error\"") and "the server is shutting down" in rest[-1], rest[-3:]
    assert "data: [DONE]" not in rest, "a cancelled stream must not claim to be complete"
    assert backend.closed == 1 and backend.produced < 400


# ---- the backend's ownership rule ------------------------------------------------------------------

def test_embedded_backend_refuses_a_second_open_generation_instead_of_waiting():
    from types import SimpleNamespace

    from k3verify.serving.backends.base import CompletionParams
    from k3verify.serving.backends.embedded import EmbeddedBackend
    from optimized_stack.errors import K3Error

    stub = SimpleNamespace(config=SimpleNamespace(vocab_size=TOK.vocab_size), new_state=None, forward=None)
    stub.new_state = stub.forward = lambda *a: None

    def tokens(model, prompt_ids, params, constraint=None):
        for _ in range(params.max_tokens):
            yield TokenEvent(token_id=65, logprob=-0.1)

    backend = EmbeddedBackend(stub, TOK, decode_fn=tokens)
    first = backend.generate([65], CompletionParams(max_tokens=5))
    next(first)
    with pytest.raises(K3Error, match="runs one generation at a time and one is still open"):
        next(backend.generate([65], CompletionParams(max_tokens=1)))
    first.close()  # cancel: the next generation may open at once
    assert len(list(backend.generate([65], CompletionParams(max_tokens=2)))) == 2


# ---- configuration --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,match", [
    ({"max_queue": -1}, r"max_queue must be an integer >= 0, got -1"),
    ({"max_body_bytes": 0}, r"max_body_bytes must be an integer >= 1, got 0"),
    ({"drain_s": 0}, r"drain_s must be a number of seconds > 0, got 0"),
    ({"max_prompt_tokens": 100, "max_model_len": 100},
     r"max_prompt_tokens \(100\) must be below max_model_len \(100\)"),
], ids=["queue-neg", "body-0", "drain-0", "prompt-ge-context"])
def test_serve_limits_refuse_bad_values(fields, match):
    from optimized_stack.errors import K3Error
    with pytest.raises(K3Error, match=match):
        ServeLimits(**fields)


@pytest.mark.parametrize("argv,message", [
    (["--max-queue", "-1"], "--max-queue must be an integer >= 0, got -1"),
    (["--drain-timeout", "0"], "--drain-timeout must be a number of seconds > 0, got 0.0"),
    (["--max-prompt-tokens", "9000", "--max-model-len", "4096"],
     "--max-prompt-tokens (9000) must be below --max-model-len (4096): a prompt needs room for at least one new token"),
], ids=["queue", "drain", "prompt-vs-context"])
def test_serve_cli_refuses_bad_limits_before_loading(capsys, argv, message):
    from k3verify.cli import main
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"k3verify: error: {message}", err
