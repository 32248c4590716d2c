"""compare/device_digest.py (m31x4) and the capture's deferred items: the digest every CUDA tensor
gets where it lives, checked on the CPU (the same integer arithmetic runs there; K3_DIGEST=m31x4 puts
CPU tensors on that path too). Each property with the change that must break it: a flipped bit
anywhere, -0.0 against 0.0, another shape or dtype; and the whole selftest judged on m31x4 digests,
its mutant caught."""
from __future__ import annotations

import math

import pytest
import torch

from k3verify.capture.capture import Capture
from k3verify.capture.nonfinite import first_nonfinite
from k3verify.compare import device_digest as dd
from k3verify.compare.tensors import hash_like, hash_tensor

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


def _rand(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 200, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_equal_bits_equal_digest_and_every_flipped_bit_is_seen(dtype):
    t = _rand(dtype, (7, 13))
    assert dd.digest(t) == dd.digest(t.clone()) and dd.scheme_of(dd.digest(t)) == dd.SCHEME
    raw = t.contiguous().view(torch.uint8).reshape(-1)
    gen = torch.Generator().manual_seed(1)
    for pos in torch.randint(0, raw.numel(), (40,), generator=gen).tolist() + [0, raw.numel() - 1]:
        for bit in (0, 7) if dtype != torch.bool else (0,):
            flipped = raw.clone()
            flipped[pos] ^= 1 << bit
            other = flipped.view(t.dtype if dtype != torch.bool else torch.uint8).reshape(t.shape)
            assert dd.digest(other) != dd.digest(t.to(other.dtype) if dtype == torch.bool else t), (pos, bit)


def test_the_digest_sees_bits_not_values_and_names_shape_and_dtype():
    assert dd.digest(torch.tensor([0.0])) != dd.digest(torch.tensor([-0.0])), "0.0 and -0.0 differ in bits"
    a = torch.arange(12, dtype=torch.float32)
    assert dd.digest(a) != dd.digest(a.reshape(3, 4)), "same bytes, another shape"
    assert dd.digest(a) != dd.digest(a.view(torch.int32)), "same bytes, another dtype"
    assert dd.digest(a[::2]) == dd.digest(a[::2].contiguous()), "a strided view digests its values"
    assert dd.digest(torch.zeros(0)) == dd.digest(torch.zeros(0)) and dd.digest(torch.tensor(3.0)).startswith("float32[]:")


def test_rows_digest_like_each_row_alone_and_growing_constants_change_nothing():
    rows = _rand(torch.float32, (5, 300))
    small = dd.digest(rows[0])
    dd.constants(1 << 20, torch.device("cpu"))                # the table grows: the prefix is unchanged
    assert dd.digest(rows[0]) == small
    lanes = dd.digest_lanes(rows, rows=True)
    assert [dd.format_digest(rows.dtype, (300,), r) for r in lanes.tolist()] == [dd.digest(r) for r in rows]


def test_nonfinite_summary_matches_first_nonfinite():
    t = _rand(torch.float32, (4, 50))
    for value, kind in ((math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")):
        bad = t.clone()
        bad[2, 7], bad[3, 1] = value, math.nan
        count, first, code = dd.nonfinite_summary(bad).tolist()
        ref = first_nonfinite(bad)
        assert (count, first, dd.NONFINITE_KINDS[code]) == (ref.count, ref.index, ref.kind) == (2, 107, kind)
    assert dd.nonfinite_summary(t).tolist() == [0, -1, 0]
    assert dd.nonfinite_summary(torch.arange(5)).tolist() == [0, -1, 0]
    per_row = dd.nonfinite_summary(torch.stack([t[0], bad[3]]), rows=True).tolist()
    assert per_row == [[0, -1, 0], [1, 1, 1]]


def test_hash_tensor_by_device_and_hash_like_by_digest(monkeypatch):
    t = _rand(torch.float32, (3, 5))
    assert dd.scheme_of(hash_tensor(t)) == "blake2b", "a CPU tensor keeps blake2b (the golden hashes)"
    monkeypatch.setenv(dd.DIGEST_ENV, dd.SCHEME)
    recorded = hash_tensor(t)
    assert dd.scheme_of(recorded) == dd.SCHEME
    monkeypatch.delenv(dd.DIGEST_ENV)
    assert hash_like(t, recorded) == recorded, "a kept copy checks against its device digest"
    assert hash_tensor(t) != recorded, "two schemes never compare equal"


def test_a_capture_defers_and_reads_every_pending_item_at_once(monkeypatch):
    monkeypatch.setenv(dd.DIGEST_ENV, dd.SCHEME)
    cap = Capture()
    rows = _rand(torch.float32, (3, 40))
    rows[1, 5] = math.inf
    cap.on_logits("r0", 10, rows)

    class State:
        recurrent, conv_q, conv_k, conv_v = (_rand(torch.float32, (2, 4, 4), s) for s in range(4))
    cap.on_kda_state("r0", 13, 0, State)
    assert len(cap._pending.groups) == 5 and all(it._pending is not None for it in cap.requests["r0"].logits.values())
    calls = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(self.shape) or real(self))
    rc = cap.requests["r0"]
    assert rc.logits[11].nonfinite.kind == "inf" and rc.logits[11].nonfinite.index_tuple == (5,)
    assert len(calls) == 1 and not cap._pending.groups, "one transfer for every pending item"
    assert rc.logits[10].nonfinite is None and rc.logits[10].digest == dd.digest(rows[0])
    assert rc.kda[13][(0, "conv_k")].digest == dd.digest(State.conv_k)
    assert "logits" in cap.to_json()["requests"]["r0"]["nonfinite"]


def test_the_selftest_on_device_digests_passes_a_toggle_and_catches_its_mutant(monkeypatch, tmp_path):
    """The whole judging path on m31x4 digests: the exact toggle holds bit for bit, its mutant fails."""
    from k3verify import cli
    from k3verify.report import load_report
    monkeypatch.setenv(dd.DIGEST_ENV, dd.SCHEME)
    suite = tmp_path / "s.toml"
    suite.write_text('version = 2\n[[check]]\nkind = "selftest"\ntoggles = ["state_offload_roundtrip"]\nscale = 0.25\n')
    run = tmp_path / "run"
    assert cli.main(["all", "--suite", str(suite), "--report-dir", str(run)]) == 0
    report = load_report(run)
    assert report["negative_controls"]["caught"] == report["negative_controls"]["total"] >= 1
    assert {v["toggle"]: v["verdict"] for v in report["verdicts"]}["state_offload_roundtrip"] == "counted"


def test_a_one_byte_tensor_sliced_at_an_odd_byte_digests_like_its_copy():
    t = torch.arange(11, dtype=torch.uint8)
    assert dd.digest(t[1:9]) == dd.digest(t[1:9].clone()) != dd.digest(t[0:8])


def test_a_kernel_that_cannot_build_falls_back_to_the_torch_form_once(monkeypatch, capsys):
    """The Triton form's first call compiles it; a failure there is said once and the torch form (the
    same words) is taken from then on, never a capture that dies."""
    import types
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dd, "_KERNEL_CHECKED", False)
    monkeypatch.setattr(dd, "_KERNEL_BROKEN", None)
    calls = []

    def broken(t, rows):
        calls.append(1)
        raise RuntimeError("cannot compile")
    monkeypatch.setitem(__import__("sys").modules, "k3verify.compare.digest_kernel",
                        types.SimpleNamespace(summary_words=broken))
    t = torch.randn(5, 7)
    assert torch.equal(dd.summary_words(t), dd.summary_words_torch(t))
    assert torch.equal(dd.summary_words(t, rows=True), dd.summary_words_torch(t, rows=True))
    assert calls == [1], "tried once, then the torch form"
    err = capsys.readouterr().err
    assert err.count("the device digest kernel could not run (RuntimeError: cannot compile)") == 1
