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
