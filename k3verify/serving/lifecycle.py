"""Running the server: on a background thread (tests, `kvv --self`) or as `k3verify serve`.

`k3verify serve` runs uvicorn on a thread and keeps the main thread for signals, so that
SIGTERM means drain, not die: new requests get 503, in-flight work has --drain-timeout
seconds to finish, what is left is cancelled (each job within one forward), and the
process exits 0. Ctrl-C does the same and exits 130, as every command does; a second
signal skips the rest of the drain. (uvicorn's own handlers would re-raise SIGTERM after
its shutdown, so the process would die of the signal instead of exiting 0.)
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from k3verify.serving.validation import ServeLimits
from optimized_stack.errors import K3Error

SHUTDOWN_GRACE_S = 5.0  # after the worker stopped: time for connections to send their last bytes


class ServerThread:
    """Run an app with uvicorn on a background thread; port 0 = ephemeral. Leaving the block stops
    the app's generation worker (cancelling what runs) and then the server."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 access_log: bool = False):
        import uvicorn
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    lifespan="off", access_log=access_log,
                                                    timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
        self.host = host
        self._thread = threading.Thread(target=self.server.run, name="k3verify-serve", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._stop_worker()
                raise K3Error(f"the server did not start on {self.host}:{self.server.config.port} "
                              "(is the port in use?)")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://{self.host}:{self.port}/v1"
        return self

    def _stop_worker(self) -> None:
        worker = getattr(getattr(self.app, "state", None), "worker", None)
        if worker is not None:  # apps built elsewhere (the tests' fake servers) have none
            worker.stop("the server is shutting down")
        close = getattr(getattr(getattr(self.app, "state", None), "backend", None), "close", None)
        if callable(close):     # the engine backend's stepper thread, and its toggles' op slots
            close()

    def __exit__(self, *exc) -> None:
        self._stop_worker()
        self.server.should_exit = True
        self._thread.join(timeout=SHUTDOWN_GRACE_S + 5)


def build_embedded_app(model=None, enforce_contract: bool = True, limits: ServeLimits = ServeLimits(),
                       stack=None, batch_window_s: float = 0.0, **load_options):
    """Load a model (preset name, path, or None for the embedded default) and wrap it in the app;
    load_options go to load_model (allow_nonfinite, allow_dtype_cast, device, dtype). `stack`
    (serving/stack.py ServeStack; None = the reference) picks the backend: an engine stack is served
    by the engine backend, batching concurrent requests (batch_window_s: its arrival window)."""
    from k3verify.serving.app import create_app
    from k3verify.serving.backends.embedded import EmbeddedBackend
    from k3verify.serving.backends.engine_backend import EngineBackend
    from optimized_stack import load_model
    from optimized_stack.tokenizer import load_tokenizer

    loaded = load_model(model, **load_options)
    tokenizer = load_tokenizer(model) if isinstance(model, str) else load_tokenizer(None)
    if tokenizer.vocab_size != loaded.config.vocab_size:
        raise K3Error(f"tokenizer vocab {tokenizer.vocab_size} does not match the model's {loaded.config.vocab_size}")
    name = str(model) if model is not None else "k3-mini"
    if stack is not None and stack.device != loaded.device.type:
        raise K3Error(f"the stack was chosen for {stack.device}, the model is on {loaded.device.type}")
    backend = (EngineBackend(loaded, tokenizer, stack, batch_window_s) if stack is not None and stack.engine
               else EmbeddedBackend(loaded, tokenizer))
    return create_app(backend, tokenizer, name, enforce_contract, limits)


def serve_main(model=None, host: str = "127.0.0.1", port: int = 8000, limits: ServeLimits = ServeLimits(),
               stack=None, **load_options) -> int:
    """`k3verify serve`: serve the embedded engine until SIGTERM (exit 0) or SIGINT (exit 130)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise K3Error(f"port must be an integer in [0, 65535], got {port!r}")
    app = build_embedded_app(model, limits=limits, stack=stack, **load_options)
    asked, forced, got = threading.Event(), threading.Event(), []

    def on_signal(signum, frame):
        got.append(signum)
        (forced if asked.is_set() else asked).set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with ServerThread(app, host, port, log_level="info", access_log=True) as server:
            health = f"http://{host}:{server.port}/health"
            print(f"k3verify serve: {app.state.model_name} on {server.base_url} as {app.state.backend.stack.label} "
                  f"(readiness: {health})",
                  file=sys.stderr, flush=True)
            while not asked.wait(0.25):
                if not server.alive:
                    raise K3Error("the HTTP server stopped on its own; see its log above")
            name = signal.Signals(got[0]).name
            print(f"k3verify serve: {name}: draining (up to {limits.drain_s:g} s)", file=sys.stderr, flush=True)
            drained = app.state.worker.drain(limits.drain_s, abort=forced)
            print("k3verify serve: " + ("in-flight work finished" if drained else "cancelling unfinished work"),
                  file=sys.stderr, flush=True)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 130 if got and got[0] == signal.SIGINT else 0
