"""compare/digest_kernel.py: the one-launch m31x4 digest and finiteness summary, word for word the
torch form's (compare/device_digest.summary_words_torch), across dtypes, rows, odd byte counts,
several blocks per row and non-finite values. Runs on a GPU or under TRITON_INTERPRET=1
(`make test-triton`); the negative control shows the comparison can fail (a changed element)."""
from __future__ import annotations

import math

import pytest
import torch

from k3verify.compare import device_digest as dd

from triton_env import DEVICE, MARKS

pytestmark = MARKS


def _kernel(t, rows=False, per_element_mod=False):
    from k3verify.compare.digest_kernel import summary_words
    return summary_words(t.to(DEVICE), rows, per_element_mod=per_element_mod).cpu()


def _torch(t, rows=False):
    return dd.summary_words_torch(t.to(DEVICE), rows).cpu()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # lanes compared mod p (the kernel leaves partial sums), the rest word for word
    return torch.equal(a[:, :dd.LANES] % dd.P, b[:, :dd.LANES] % dd.P) and torch.equal(a[:, dd.LANES:], b[:, dd.LANES:])


@pytest.mark.parametrize("dtype,shape", [
    (torch.float32, (700,)), (torch.float32, (3, 5, 7)), (torch.bfloat16, (1500,)), (torch.float16, (9, 33)),
    (torch.int64, (300,)), (torch.uint8, (7, 3)), (torch.bool, (11,)), (torch.float64, (260,))],
    ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else "x".join(map(str, v)))
def test_kernel_words_are_the_torch_forms(dtype, shape):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) > 0.5
    elif dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
    else:
        t = torch.randint(0, 250, shape, generator=g).to(dtype)
    assert _same(_kernel(t), _torch(t))


def test_rows_and_nonfinite_values_word_for_word():
    from k3verify.compare.digest_kernel import BLOCK
    width = BLOCK // 2 + 400                          # BLOCK + 800 halves a row: two blocks of the lanes
    t = torch.randn(4, width)
    t[1, BLOCK // 2 + 100], t[1, 3], t[2, width - 1], t[3, 5] = math.inf, math.nan, -math.inf, math.nan
    t[3, 6] = math.inf
    k, r = _kernel(t, rows=True), _torch(t, rows=True)
    assert _same(k, r)
    assert [dd.read_words(row.tolist())[1] for row in k] == [None, (2, 3, 1), (1, width - 1, 3), (2, 5, 1)]
    bf = t.to(torch.bfloat16)
    assert _same(_kernel(bf, rows=True), _torch(bf, rows=True))


def test_negative_control_a_changed_element_changes_the_words():
    t = torch.randn(600)
    other = t.clone()
    other[555] = torch.nextafter(other[555], torch.tensor(math.inf))
    assert not _same(_kernel(t), _kernel(other))
    assert dd.read_words(_kernel(t)[0].tolist())[0] == [int(v) for v in dd.digest_lanes(t)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=lambda d: str(d)[6:])
def test_one_remainder_a_block_reads_as_a_remainder_a_product(dtype):
    """The block-sum form (one remainder per 4096 products) and the form before it (a remainder per
    product, perf/capture_bench.py's A/B) leave the same words mod p; the lanes' raw partial sums
    differ, which shows the two forms did run different arithmetic."""
    from k3verify.compare.digest_kernel import BLOCK
    g = torch.Generator().manual_seed(3)
    t = (torch.rand(3, BLOCK + 5, generator=g) * 250).to(dtype)
    new, old = _kernel(t, rows=True), _kernel(t, rows=True, per_element_mod=True)
    assert _same(new, old) and _same(new, _torch(t, rows=True))
    assert not torch.equal(new[:, :dd.LANES], old[:, :dd.LANES])


# ---- the grouped form: one words buffer, one launch per up to four tensors of a kind -----------------
def _mixed(seed: int = 0) -> list[torch.Tensor]:
    """Tensors of several kinds, interleaved, two of them spanning blocks, one kind with 5 members
    (past one launch's four slots), non-finite values in two."""
    from k3verify.compare.digest_kernel import BLOCK
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(3, 2 * BLOCK + 7, generator=g), torch.randn(3, 50, generator=g).to(torch.bfloat16),
          torch.randn(2, 3, 40, generator=g), torch.rand(2, 9, generator=g) > 0.5,
          torch.randint(0, 200, (4, 7), generator=g).to(torch.uint8), torch.randn(3, 11, generator=g),
          torch.randn(1, BLOCK + 1, generator=g), torch.randn(5, 3, generator=g)]
    ts[2][1, 0, 5], ts[0][2, BLOCK + 3] = math.nan, -math.inf
    return ts


def _many(ts):
    from k3verify.compare.digest_kernel import summary_words_many
    return [w.cpu() for w in summary_words_many([t.to(DEVICE) for t in ts])]


def test_grouped_words_are_each_tensors_own(monkeypatch):
    from k3verify.compare import digest_kernel
    launches = []
    real = digest_kernel._launch_group
    monkeypatch.setattr(digest_kernel, "_launch_group", lambda p, *a: (launches.append(len(p)), real(p, *a)))
    ts = _mixed()
    many = _many(ts)
    assert [w.shape[0] for w in many] == [t.shape[0] for t in ts]
    assert all(_same(m, _kernel(t, rows=True)) and _same(m, _torch(t, rows=True)) for m, t in zip(many, ts))
    # five fp32 tensors: two launches (4 + 1); the bf16 one its own; the bool (as uint8) and the uint8
    # rows, both of an odd byte count, one launch together: 4 launches for 8 tensors, not 8 x 3
    assert sorted(launches) == [1, 1, 2, 4], launches


def test_rows_a_program_keep_every_sm_busy_and_refuse_zero():
    """The grouped launch takes up to ROWS_PER_PROGRAM rows a program, a power of two, only while the
    launch keeps ~4 programs an SM (one SM off the GPU: the interpreter's device)."""
    from k3verify.compare.digest_kernel import _rows_a_program
    cpu = torch.device("cpu")
    assert _rows_a_program(256, 64, 8, cpu) == 8          # a KDA layer's four pool tensors at B = 64
    assert _rows_a_program(3, 1, 8, cpu) == 1             # 3 programs: none to spare
    assert _rows_a_program(16, 1, 8, cpu) == 4            # 16 -> 4 programs, the floor
    assert _rows_a_program(256, 64, 3, cpu) == 2          # a power of two, at most the asked count
    with pytest.raises(ValueError, match="rows_per_program must be >= 1"):
        _rows_a_program(8, 1, 0, cpu)


@pytest.mark.parametrize("rows", [1, 3, 8, 64])
def test_rows_a_program_change_no_word(rows):
    """The grouped launch's programs take `rows` rows of a block each (ROWS_PER_PROGRAM by default; the
    bench times eight against one): every tensor's words stay the torch form's, for
    row counts that do and do not divide the launch's rows, indexed pool rows among them."""
    from k3verify.compare import digest_kernel
    from k3verify.compare.digest_kernel import summary_words_many
    taken = []
    real = digest_kernel._rows_a_program
    digest_kernel._rows_a_program = lambda *a: taken.append(real(*a)) or taken[-1]
    try:
        g = torch.Generator().manual_seed(3)
        # on the kernel's device (a GPU run launched the CPU tensors: "cannot be accessed from Triton")
        ts = [t.to(DEVICE) for t in _mixed(2)] + [torch.randn(70, 33, generator=g).to(DEVICE)]  # 70 rows: a ragged end
        got = [w.cpu() for w in summary_words_many(ts, rows_per_program=rows)]
        assert all(_same(a, _torch(t, rows=True)) for a, t in zip(got, ts))
        pool = torch.randn(9, 3, 5, 4, generator=g).to(DEVICE)
        slots = torch.randint(0, 9, (40,), generator=g).to(DEVICE)                # repeats, any order
        (w,) = summary_words_many([pool], [slots], rows_per_program=rows)
        assert _same(w.cpu(), _torch(pool.index_select(0, slots), rows=True))
    finally:
        digest_kernel._rows_a_program = real
    # the grouping did vary: 70 rows of one block keep >= 4 programs up to 16 rows a program
    assert max(taken) == {1: 1, 3: 2, 8: 8, 64: 16}[rows], taken


def test_negative_control_a_changed_element_changes_only_its_tensors_row():
    ts = _mixed(1)
    other = [t.clone() for t in ts]
    other[5][1, 4] = torch.nextafter(other[5][1, 4], torch.tensor(math.inf))
    a, b = _many(ts), _many(other)
    changed = [(i, r) for i, (x, y) in enumerate(zip(a, b)) for r in range(x.shape[0]) if not _same(x[r:r + 1], y[r:r + 1])]
    assert changed == [(5, 1)]


def test_indexed_rows_read_in_place_are_the_gathered_rows_words():
    """summary_words_many(ts, index): a pool's rows at given slots (repeats and any order) read where they
    lie give the words of the gathered copy; beside an unindexed tensor of the same kind (its own launch).
    The control: the next slot over gives other words."""
    from k3verify.compare.digest_kernel import summary_words_many
    g = torch.Generator().manual_seed(7)
    pool = torch.randn(6, 3, 5, 4, generator=g).to(DEVICE)          # fp32 [slots, H, K, V]
    conv = torch.randn(6, 3, 8, generator=g).to(torch.bfloat16).to(DEVICE)
    logits = torch.randn(4, 33, generator=g).to(DEVICE)
    slots = torch.tensor([4, 0, 4, 2], device=DEVICE)
    got = [w.cpu() for w in summary_words_many([logits, pool, conv], [None, slots, slots])]
    want = [_torch(logits, rows=True), _torch(pool.index_select(0, slots), rows=True),
            _torch(conv.index_select(0, slots), rows=True)]
    assert all(_same(a, b) for a, b in zip(got, want))
    shifted = summary_words_many([pool], [(slots + 1) % 6])[0].cpu()
    assert not any(_same(shifted[r:r + 1], want[1][r:r + 1]) for r in range(4)), "the index was not read"


def test_a_capture_of_batched_states_reads_as_the_per_request_calls(monkeypatch):
    """Capture.on_kda_states (the grouped digests) and on_kda_state per request record the same items."""
    from types import SimpleNamespace
    from k3verify.capture.capture import KDA_TENSORS, Capture
    monkeypatch.setenv(dd.DIGEST_ENV, dd.SCHEME)
    g = torch.Generator().manual_seed(2)
    shapes = {"recurrent": (2, 16, 16), "conv_q": (3, 32), "conv_k": (3, 32), "conv_v": (3, 32)}
    stacked = {n: torch.randn(3, *s, generator=g).to(DEVICE) for n, s in shapes.items()}
    points = [("a", 5), ("b", 6), ("c", 7)]
    batched, single = Capture(), Capture()
    dd.summary_words(stacked["recurrent"], rows=True)         # the process's first, checked kernel call
    from k3verify.compare import digest_kernel
    launches = []
    real = digest_kernel._launch_group
    monkeypatch.setattr(digest_kernel, "_launch_group", lambda p, *a: (launches.append(len(p)), real(p, *a)))
    batched.on_kda_states(points, 1, stacked)
    assert launches == [4], "the layer's four fp32 tensors in one grouped launch"
    for i, (rid, n) in enumerate(points):
        single.on_kda_state(rid, n, 1, SimpleNamespace(**{k: stacked[k][i] for k in KDA_TENSORS}))
    assert batched.to_json()["requests"] == single.to_json()["requests"]
    assert all(":m31x4:" in it.digest for rc in batched.requests.values() for pt in rc.kda.values() for it in pt.values())


@pytest.mark.parametrize("wide", [False, True], ids=["int64-products", "wide-products"])
def test_both_product_forms_give_the_torch_forms_words(wide):
    """_row_block's WIDE (int32 halves and constants widened for the product) against the int64 form:
    the torch form's words for every dtype class (bytes, halves of bf16 / fp32 / int64, bool), rows
    read in place among them; the byte-odd and all-NaN rows are there so the shift and the
    finiteness take both paths."""
    from k3verify.compare.digest_kernel import summary_words_many
    g = torch.Generator().manual_seed(11)
    ts = [t.to(DEVICE) for t in _mixed(3)] + [torch.randint(-2 ** 40, 2 ** 40, (5, 7), generator=g).to(DEVICE),
                                               torch.rand(4, 9, generator=g).gt(0.5).to(DEVICE),
                                               torch.full((3, 6), float("nan")).to(DEVICE)]
    got = [w.cpu() for w in summary_words_many(ts, wide=wide)]
    assert all(_same(a, _torch(t, rows=True)) for a, t in zip(got, ts))
    pool = torch.randn(9, 3, 5, 4, generator=g).to(torch.bfloat16).to(DEVICE)
    slots = torch.randint(0, 9, (12,), generator=g).to(DEVICE)
    (w,) = summary_words_many([pool], [slots], wide=wide)
    assert _same(w.cpu(), _torch(pool.index_select(0, slots), rows=True))
    # control: a flipped bit of one row changes that row's words in this form too
    flipped = ts[-3].clone()
    flipped[2, 3] ^= 1
    (a,), (b,) = summary_words_many([ts[-3]], wide=wide), summary_words_many([flipped], wide=wide)
    assert torch.equal(a[:2], b[:2]) and not torch.equal(a[2], b[2])


def test_the_benchs_digest_cost_runs_every_form_and_finds_their_words_equal():
    """perf/capture_bench.digest_cost's arms (the per-tensor kernel, the form before session 17, the
    grouped form, the fast step's in-place form) on k3-mini's step shapes: the same words, so its A/B
    times the same work."""
    from k3verify.perf.capture_bench import digest_cost
    from optimized_stack import load_model
    # on the device the model must be there too: digest_cost takes the kernel's arms only for a CUDA
    # model or under the interpreter (the first GPU run of this test loaded it on the CPU and failed)
    dc = digest_cost(load_model("k3-mini", device=DEVICE), batch=2, reps=1)
    assert dc["forms_same_words"] is True and dc["kernel_broken"] is None
    assert {"stack_and_digest_grouped_ms", "stack_and_digest_per_element_mod_ms", "in_step_ms", "in_step_eight_rows_ms",
            "in_step_eight_rows_device_ms", "in_step_wide_ms", "in_step_wide_device_ms"} <= set(dc)


@pytest.mark.parametrize("fault", ["raises", "differs"])
def test_a_grouped_form_that_fails_or_differs_on_its_first_call_is_not_used(monkeypatch, capsys, fault):
    """The grouped kernel's first call in a process is checked against the per-tensor kernel: a launch
    that fails, or words that differ, leave the per-tensor words (never a wrong digest) and say why."""
    from k3verify.compare import digest_kernel
    monkeypatch.setattr(dd, "_GROUPED_CHECKED", False)
    monkeypatch.setattr(dd, "_GROUPED_BROKEN", None)
    ts = [t.to(DEVICE) for t in _mixed(3)[:3]]
    dd.summary_words(ts[0], rows=True)                        # the per-tensor kernel checked first

    def bad(xs):
        if fault == "raises":
            raise RuntimeError("no launch here")
        return [torch.zeros_like(w) for w in digest_kernel.summary_words_many(xs)]
    monkeypatch.setattr(digest_kernel, "summary_words_many", bad)
    got = dd.summary_words_many(ts)
    assert all(_same(g.cpu(), _kernel(t, rows=True)) for g, t in zip(got, ts))
    assert dd._GROUPED_BROKEN and "grouped device digest could not be used" in capsys.readouterr().err
    assert all(_same(g.cpu(), _kernel(t, rows=True)) for g, t in zip(dd.summary_words_many(ts), ts))


def test_negative_control_a_sound_grouped_form_is_checked_once_then_taken(monkeypatch):
    from k3verify.compare import digest_kernel
    monkeypatch.setattr(dd, "_GROUPED_CHECKED", False)
    monkeypatch.setattr(dd, "_GROUPED_BROKEN", None)
    ts = [t.to(DEVICE) for t in _mixed(4)[:3]]
    dd.summary_words(ts[0], rows=True)
    calls = []
    real = digest_kernel.summary_words_many
    monkeypatch.setattr(digest_kernel, "summary_words_many", lambda xs: (calls.append(1), real(xs))[1])
    first, second = dd.summary_words_many(ts), dd.summary_words_many(ts)
    assert dd._GROUPED_BROKEN is None and dd._GROUPED_CHECKED and len(calls) == 2
    assert all(_same(a.cpu(), b.cpu()) for a, b in zip(first, second))
