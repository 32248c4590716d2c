"""The GPU reference profile's dispatch and choices (optimized_stack/kernels/gpu_reference.py):
KDA cut on the 64-token grid (fla chunk for the aligned part, fused recurrent for the tail and
for decode), unit-tested with stand-ins since fla needs a GPU; the GEMM / KDA knobs; the
matmul flags; the autograd escape; the CPU path never reaching the profile. CUDA-only tests
(`gpu` marker) run the model on the GPU: prefill == chunked prefill == decode == batched."""
from __future__ import annotations

import pytest
import torch

from optimized_stack.errors import K3Error
from optimized_stack.kernels import gpu_reference as gr
from optimized_stack.kernels.kda.chunked import kda_chunked
from optimized_stack.model import ops
from optimized_stack.model.kda import kda_recurrent

from triton_env import DEVICE, bit_equal, needs_triton


class Recorder:
    """A stand-in KDA op that records (name, T, state in) and returns recognisable outputs."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def __call__(self, q, k, v, g, beta, state):
        self.log.append((self.name, q.shape[0], state))
        o = torch.full((q.shape[0], q.shape[1], v.shape[2]), float(len(self.log)))
        return o, torch.full_like(state, float(len(self.log)))


def _kda_inputs(t, h=2, kd=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(t, h, kd, generator=gen), dim=-1) * kd ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, kd, generator=gen), dim=-1)
    v = torch.randn(t, h, kd, generator=gen)
    g = -5 * torch.rand(t, h, kd, generator=gen)
    return q, k, v, g, torch.rand(t, h, generator=gen), torch.zeros(h, kd, kd)


@pytest.mark.parametrize("t_len,calls", [
    (1, [("recurrent", 1)]), (63, [("recurrent", 63)]), (64, [("chunk", 64)]),
    (65, [("chunk", 64), ("recurrent", 1)]), (129, [("chunk", 128), ("recurrent", 1)]),
    (192, [("chunk", 192)])], ids=lambda v: f"T{v}" if isinstance(v, int) else None)
def test_kda_scan_chunks_the_aligned_part_and_recurs_the_tail(t_len, calls, monkeypatch):
    monkeypatch.delenv(gr.KDA_ENV, raising=False)
    log: list = []
    q, k, v, g, beta, s0 = _kda_inputs(t_len)
    o, s = gr.kda_scan(q, k, v, g, beta, s0, chunk=Recorder(log, "chunk"), recurrent=Recorder(log, "recurrent"))
    assert [(name, t) for name, t, _ in log] == calls
    assert log[0][2] is s0, "the first call must start from the given state"
    if len(log) == 2:
        assert torch.equal(log[1][2], torch.full_like(s0, 1.0)), "the tail must start from the chunk's final state"
        assert torch.equal(o[:calls[0][1]], torch.full_like(o[:calls[0][1]], 1.0)), "outputs out of order"
        assert torch.equal(o[calls[0][1]:], torch.full_like(o[calls[0][1]:], 2.0))
    assert o.shape == (t_len, 2, 8) and torch.equal(s, torch.full_like(s0, float(len(log))))


def test_kda_scan_recurrent_profile_never_chunks(monkeypatch):
    monkeypatch.setenv(gr.KDA_ENV, "recurrent")
    log: list = []
    gr.kda_scan(*_kda_inputs(129), chunk=Recorder(log, "chunk"), recurrent=Recorder(log, "recurrent"))
    assert [(n, t) for n, t, _ in log] == [("recurrent", 129)]


@pytest.mark.parametrize("dtype,calls", [
    (torch.float32, [("recurrent", 129)]),
    (torch.bfloat16, [("chunk", 128), ("recurrent", 1)]),
    (None, [("chunk", 128), ("recurrent", 1)])], ids=["fp32", "bf16", "not-told"])
def test_kda_scan_of_an_fp32_layer_never_chunks(dtype, calls, monkeypatch):
    """chunk_kda's fp32 dots are TF32: an fp32 layer's scan must recur every token (fp32 FMAs),
    a bf16 layer keeps the split; the bf16 and not-told rows are the negative controls."""
    monkeypatch.delenv(gr.KDA_ENV, raising=False)
    log: list = []
    args = _kda_inputs(129)
    kw = {"chunk": Recorder(log, "chunk"), "recurrent": Recorder(log, "recurrent")}
    if dtype is None:
        gr.kda_scan(*args, **kw)
    else:
        with gr.kda_activations(dtype):
            assert gr.kda_form() == ("recurrent" if dtype == torch.float32 else "split")
            gr.kda_scan(*args, **kw)
    assert [(n, t) for n, t, _ in log] == calls
    assert gr.kda_form() == "split", "the dtype must not outlive its block"


def test_kda_activations_nest_and_restore():
    with gr.kda_activations(torch.bfloat16):
        with gr.kda_activations(torch.float32):
            assert gr.kda_form() == "recurrent"
        assert gr.kda_form() == "split"
    with pytest.raises(RuntimeError):
        with gr.kda_activations(torch.float32):
            raise RuntimeError("boom")
    assert gr.kda_form() == "split", "an exception must not leave the fp32 form behind"
    assert gr.describe()["kda_fp32"] == "recurrent"


def test_kda_scan_rejects_empty_and_unknown_profile(monkeypatch):
    with pytest.raises(K3Error, match="kda_scan: expected at least one token, got T = 0"):
        gr.kda_scan(*_kda_inputs(0), chunk=kda_chunked, recurrent=kda_recurrent)
    monkeypatch.setenv(gr.KDA_ENV, "chunky")
    with pytest.raises(K3Error, match=r"K3_GPU_KDA must be one of split, recurrent, got 'chunky'"):
        gr.kda_scan(*_kda_inputs(3), chunk=kda_chunked, recurrent=kda_recurrent)


def _scan(*a):
    return gr.kda_scan(*a, chunk=kda_chunked, recurrent=kda_recurrent)


def _cut(inputs, cuts):
    """The scan called on consecutive pieces [0, c1), [c1, c2), ... with the state carried."""
    q, k, v, g, beta, state = inputs
    outs, bounds = [], [0, *cuts, q.shape[0]]
    for a, b in zip(bounds, bounds[1:]):
        o, state = _scan(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state)
        outs.append(o)
    return torch.cat(outs), state


@pytest.mark.parametrize("t_len,cuts", [
    (129, [128]),                  # prefill 128, then one decode step
    (150, [64]),                   # a prefill cut on the grid, continued as a prefill
    (192, [64, 128]),
    (70, [64, 65, 66, 67, 68, 69]),   # aligned prefill, then token-by-token decode
    (100, [64, 80]),               # decode tail in two calls: both through the recurrence
], ids=lambda v: str(v))
def test_cuts_on_the_grid_are_bit_identical_with_stand_ins(t_len, cuts, monkeypatch):
    """With stand-ins that share fla's structure (a chunked form, bitwise across 64-aligned
    cuts; a recurrence, T tokens == T one-token calls) the split form is cut-invariant where
    the profile claims it is."""
    monkeypatch.delenv(gr.KDA_ENV, raising=False)
    inputs = _kda_inputs(t_len, seed=t_len)
    whole_o, whole_s = _scan(*inputs)
    o, s = _cut(inputs, cuts)
    assert bit_equal(o, whole_o) and bit_equal(s, whole_s), f"cuts {cuts} of {t_len} not bit-identical"


@pytest.mark.parametrize("profile,expect_equal", [("split", False), ("recurrent", True)])
def test_a_cut_off_the_grid_continued_as_prefill(profile, expect_equal, monkeypatch):
    """The split profile's documented limit (and the control of the invariance check): a
    prefill cut at 37 then continued as one prefill chunks tokens 37..100 on a shifted grid.
    The recurrent profile is invariant to any cut."""
    monkeypatch.setenv(gr.KDA_ENV, profile)
    inputs = _kda_inputs(130, seed=5)
    whole_o, whole_s = _scan(*inputs)
    o, s = _cut(inputs, [37])
    assert (bit_equal(o, whole_o) and bit_equal(s, whole_s)) is expect_equal


def test_gemm_choice(monkeypatch):
    monkeypatch.delenv(gr.GEMM_ENV, raising=False)
    assert gr.gemm_choice() == "auto"
    assert (gr.gemm_backend(torch.bfloat16), gr.gemm_backend(torch.float32)) == ("cublas", "triton")
    monkeypatch.setenv(gr.GEMM_ENV, "triton")
    assert gr.gemm_backend(torch.bfloat16) == "triton"
    monkeypatch.setenv(gr.GEMM_ENV, "cublas")
    assert gr.gemm_backend(torch.float32) == "cublas"
    assert "NOT batch-invariant" in gr.describe()["gemm_reason"]
    monkeypatch.setenv(gr.GEMM_ENV, "cutlass")
    with pytest.raises(K3Error, match=r"K3_GPU_GEMM must be one of auto, cublas, triton, got 'cutlass'"):
        gr.gemm_backend(torch.float32)


def test_profile_turns_reduced_precision_off_and_restores():
    m = torch.backends.cuda.matmul
    names = ("allow_tf32", "allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
    saved = {n: getattr(m, n) for n in names}
    try:
        for n in names:
            setattr(m, n, True)
        with pytest.raises(RuntimeError, match="inside"):
            with gr.profile():
                assert not any(getattr(m, n) for n in names) and not torch.backends.cudnn.allow_tf32
                raise RuntimeError("inside")
        assert all(getattr(m, n) for n in names), "profile() did not restore the flags"
    finally:
        for n, value in saved.items():
            setattr(m, n, value)


def test_needs_autograd():
    w = torch.ones(3, requires_grad=True)
    assert gr.needs_autograd(torch.ones(3), w)
    assert not gr.needs_autograd(torch.ones(3), None)
    with torch.no_grad():
        assert not gr.needs_autograd(torch.ones(3), w)


def test_kernels_refuse_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(K3Error, match=r"x must be on a CUDA device \(or run under TRITON_INTERPRET=1\), got cpu"):
        gr.check_runnable(x=torch.zeros(2))


def test_cpu_reference_never_reaches_the_gpu_profile(monkeypatch):
    """The CPU path is byte-for-byte the old one: a forward never touches gpu_reference."""
    from optimized_stack import load_model

    class Trap:
        def __getattr__(self, name):
            raise AssertionError(f"the CPU reference reached gpu_reference.{name}")
    monkeypatch.setattr(ops, "_GPU_REFERENCE", Trap())
    model = load_model()
    logits = model.logits(torch.tensor([257, 72, 105, 33, 10, 72, 105]))
    assert logits.shape == (7, model.config.vocab_size)


def test_row_sum_on_cpu_is_torch_sum():
    w = torch.rand(9, 4)
    assert bit_equal(ops.row_sum(w), w.sum(-1, keepdim=True))


# ---- the profile's forms through the interpreter (CI) or on a GPU -------------------------------------
@needs_triton
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
@pytest.mark.parametrize("lead", [(5,), (2, 3)], ids=["2d", "3d"])
def test_linear_triton_form_keeps_leading_dims(lead, monkeypatch):
    monkeypatch.setenv(gr.GEMM_ENV, "triton")
    x, w = torch.randn(*lead, 32, device=DEVICE), torch.randn(24, 32, device=DEVICE)
    y = gr.linear(x, w)
    assert y.shape == (*lead, 24)
    assert float((y.cpu().double() - x.cpu().double() @ w.cpu().double().T).abs().max()) < 1e-4


# ---- on a CUDA GPU: the model on the profile ---------------------------------------------------------------
def _fla_ok() -> bool:
    try:
        import fla.ops.kda  # noqa: F401
        import triton  # noqa: F401
        return torch.cuda.is_available()
    except Exception:
        return False


needs_fla = pytest.mark.skipif(not _fla_ok(), reason="needs a CUDA GPU with triton and fla-core")


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_model_prefill_decode_and_batch_are_bit_identical(dtype):
    from optimized_stack import load_model
    model = load_model(device="cuda", dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (70,), generator=gen)
    other = torch.randint(0, 256, (23,), generator=gen)
    whole = model.logits(ids)
    st = model.new_state()                                   # prefill 64, then 6 decode steps
    steps = [model.forward(ids[:64], st)] + [model.forward(ids[t:t + 1], st) for t in range(64, 70)]
    assert bit_equal(torch.cat(steps), whole), "prefill 64 + decode != prefill 70 on the GPU profile"
    a, b = model.new_state(), model.new_state()
    batched = model.forward_batch([(ids, a), (other, b)])
    assert bit_equal(batched[0], whole), "batched with another request != alone on the GPU profile"
    assert bit_equal(batched[1], model.logits(other))


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("dtype,chunk_calls", [(torch.float32, 0), (torch.bfloat16, None)], ids=["fp32", "bf16"])
def test_cuda_fp32_model_never_reaches_chunk_kda(dtype, chunk_calls, monkeypatch):
    """The wiring of kda_activations: an fp32 model's 128-token prefill never calls fla's chunk
    kernel (its fp32 dots are TF32); the bf16 model's does (the negative control)."""
    from optimized_stack import load_model
    from optimized_stack.kernels.kda import fla
    calls = []
    real = fla.fla_chunk
    monkeypatch.setattr(fla, "fla_chunk", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.delenv(gr.KDA_ENV, raising=False)
    model = load_model(device="cuda", dtype=dtype)
    model.logits(torch.arange(128) % 256)
    if chunk_calls is None:
        assert calls and all(t == 128 for t in calls), f"the bf16 prefill should chunk, calls {calls}"
    else:
        assert len(calls) == chunk_calls, f"an fp32 prefill reached chunk_kda: {calls}"
