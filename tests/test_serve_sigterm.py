"""SIGTERM and SIGINT on a real `k3verify serve` subprocess (the embedded k3-mini): it drains and exits
0 on SIGTERM, 130 on SIGINT (Ctrl-C), with no traceback.

One server per test, on a free loopback port; model load ~5 s on 2 cores, every wait bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
START_S = 90   # import torch + load k3-mini on a busy 2-core machine
EXIT_S = 20    # --drain-timeout 1 + cancel + uvicorn's shutdown grace, with room


class Served:
    def __init__(self, *flags: str):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "k3verify", "serve", "--host", "127.0.0.1", "--port", "0",
                                      *flags],
                                     cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.url: str | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + START_S
        while self.url is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"k3verify serve did not start within {START_S} s:\n" + "".join(self.log[-20:]))
            time.sleep(0.05)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            if line.startswith("k3verify serve: ") and " on http://" in line and self.url is None:
                self.url = line.split(" on ", 1)[1].split()[0]  # .../v1

    def sigterm_and_wait(self, signum: int = signal.SIGTERM) -> tuple[int, float]:
        started = time.monotonic()
        self.proc.send_signal(signum)
        try:
            code = self.proc.wait(EXIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"k3verify serve did not exit within {EXIT_S} s of {signal.Signals(signum).name}:\n"
                        + "".join(self.log[-20:]))
        self._reader.join(5)
        return code, time.monotonic() - started

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def test_sigterm_on_an_idle_server_exits_0():
    served = Served("--drain-timeout", "1")
    root = served.url[: -len("/v1")]
    assert httpx.get(f"{root}/health", timeout=30).status_code == 200
    code, seconds = served.sigterm_and_wait()
    assert code == 0, "".join(served.log[-20:])
    assert any("SIGTERM: draining" in line for line in served.log), "".join(served.log[-20:])


def test_sigint_exits_130_without_a_traceback():
    # Issue 29: Ctrl-C gave "TypeError: command 'serve' must return 0, 1 or 2, got 130" and exit 1 (negative
    # control, by hand: with the old exit-code check in cli.py this test fails with "exit 1 after SIGINT").
    served = Served("--drain-timeout", "1")
    root = served.url[: -len("/v1")]
    assert root.startswith("http://127.0.0.1:"), root
    assert httpx.get(f"{root}/health", timeout=30).status_code == 200
    code, seconds = served.sigterm_and_wait(signal.SIGINT)
    log = "".join(served.log)
    assert code == 130, f"exit {code} after SIGINT, expected 130:\n{log[-2000:]}"
    assert "Traceback" not in log and "Error" not in log, log[-2000:]
    ours = [line.strip() for line in served.log if line.startswith("k3verify")]
    assert "k3verify serve: SIGINT: draining (up to 1 s)" in ours, ours


def test_sigterm_with_a_stream_in_flight_drains_then_exits_0():
    served = Served("--drain-timeout", "1")
    lines: list[str] = []
    first = threading.Event()

    def stream():
        body = {"prompt": "Once upon a time", "max_tokens": 4096, "stream": True}
        try:
            with httpx.stream("POST", f"{served.url}/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    first.set()
        except httpx.HTTPError as e:  # a cut connection is an acceptable end too; a hang is not
            lines.append(f"client: {type(e).__name__}")
        first.set()

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    assert first.wait(60), "no first chunk from the server"
    code, seconds = served.sigterm_and_wait()
    client.join(10)
    assert not client.is_alive(), "the streaming client still hangs after the server exited"
    assert code == 0, "".join(served.log[-20:])
    log = "".join(served.log)
    assert "SIGTERM: draining (up to 1 s)" in log, log[-2000:]
    finished = "data: [DONE]" in lines
    cancelled = any("generation ended early" in line for line in lines)
    assert finished or cancelled, f"the stream must end with [DONE] or a cancellation event, got {lines[-3:]}"
    if cancelled:  # 4096 tokens take longer than the 1 s drain on 2 cores
        assert "cancelling unfinished work" in log and seconds < EXIT_S
