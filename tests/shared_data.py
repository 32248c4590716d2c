"""Where the read-only shared data lives: ../shared beside the checkout (as CI lays it
out), else $K3VERIFY_SHARED, else the development machine's /work/shared."""
from __future__ import annotations

import os
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
    candidates = [os.environ.get("K3VERIFY_SHARED"), _REPO.parent / "shared", "/work/shared"]
    for c in candidates:
        if c and (Path(c) / "data").is_dir():
            return Path(c)
    raise FileNotFoundError(f"shared data not found: looked in {[str(c) for c in candidates if c]}")


SHARED = shared_dir()
