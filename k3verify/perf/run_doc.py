"""The document of a GPU run: sections of items and a log, saved after every item, so a run cut
short by the device's time limit still leaves what it measured. The runs differ only in what
they write (`save`): gpu_suite.GpuRun, gpu_exactness.Run."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from k3verify.report.environment import environment_fingerprint


class RunDoc:
    def __init__(self, out: Path, budget_s: float):
        self.out, self.budget_s, self.t0 = out, budget_s, time.monotonic()
        self.doc: dict[str, Any] = {"environment": environment_fingerprint(), "sections": {}, "log": []}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.doc["log"].append(line)

    def add(self, section: str, item: dict[str, Any]) -> None:
        self.doc["sections"].setdefault(section, []).append(item)
        self.save()

    def save(self) -> None:
        raise NotImplementedError
