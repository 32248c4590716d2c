"""A tensor-parallel toggle on CUDA runs over nccl with one GPU per rank, or is skipped with the
count it lacked; never over gloo's CPU ranks with a CUDA model (the H200 release run errored so)."""
from __future__ import annotations

import torch

from k3verify.kinds import selftest
from k3verify.kinds.base import Unit


class _Ctx:
    device = "cuda"
    model = None

    def __init__(self):
        self.asked = []

    def runner(self, world, backend=None):
        self.asked.append((world, backend))
        raise RuntimeError("stop here: the runner was asked for")


def _unit():
    return Unit(kind="selftest", check="selftest", options={"scale": 0.25}, toggle="tp_dedup_router",
                scenario="single", id="x")


def test_one_gpu_skips_with_the_count_it_lacked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ctx = _Ctx()
    (r,) = selftest.run(_unit(), ctx)
    assert r.status == "skip" and "needs 2 GPUs for nccl, found 1" in r.reason and not ctx.asked


def test_enough_gpus_ask_for_nccl(monkeypatch):
    """The control: with the GPUs there, the unit runs (here: asks for an nccl runner)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    ctx = _Ctx()
    try:
        selftest.run(_unit(), ctx)
    except RuntimeError as exc:
        assert "runner was asked" in str(exc)
    assert ctx.asked == [(2, "nccl")]
