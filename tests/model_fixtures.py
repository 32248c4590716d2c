"""The embedded k3-mini as a module-scoped fixture, run on one thread (import `model`)."""
from __future__ import annotations

import pytest
import torch

from optimized_stack import load_model


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # 2-core box shared with other jobs: one thread is faster
    try:
        yield load_model("k3-mini")
    finally:
        torch.set_num_threads(threads)
