"""The fused SiTU-GLU (optimized_stack/kernels/moe/situ.py) against the torch formula it replaces
(model/ops.py situ), the exact toggle fused_situ's claim.

On CUDA the claim is bit for bit (the `gpu` test below, and the toggle's exact verdict). Under
Triton's interpreter (how CI runs this file) the kernel's tanh and exp are numpy's, not torch's CPU
functions, so here the formula is held within a few ULP (FP32_ULP, NARROW_ULP: why below), and
what the interpreter can prove bit for bit is the kernel's own: a row's bits whatever the batch
and whatever the strides. Without a GPU the PTX the kernel compiles to for sm_90 is read for the
instructions the bitwise argument rests on. Each check has a negative control that must fail (the
seeded fault that drops linear_beta, a function whose rows mix, the PTX of the variants each
instruction check guards against). Bad input is one line. Through the engine, the option reaches
the decode step and the sorted prefill experts and fires its event in both.
Shape letters: R rows, F expert width, E experts, T tokens."""
from __future__ import annotations

import collections

import pytest
import torch

from triton_env import DEVICE, ENGINE_PROMPTS, INTERPRET, MARKS, bit_equal, engine_run, row_mismatches

pytestmark = MARKS + [pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")]

BETA, LINEAR_BETA = 4.0, 25.0          # the K3 config's situ_beta, situ_linear_beta
# Under the interpreter: torch's CPU tanh and exp are within ~1 ULP (Sleef u10), numpy's exp within
# ~2, the interpreter's tanh (exp in fp64) within ~0.5; the sigmoid adds its division, the three
# products their roundings. Measured at most 7 ULP in fp32 over 3M elements, gate scales 1e-3..100.
# A narrower output rounds those few fp32 ULP once more: at most one step of its own.
FP32_ULP, NARROW_ULP = 8, 1


def _situ():
    from optimized_stack.kernels.moe import situ
    return situ


def _inputs(shape, dtype, scale=1.0, seed=0):
    """gate, up of `shape`. gate is kept within +-60: below -87 the sigmoid is subnormal and so can
    be the output, and Triton 3.6's interpreter converts subnormal fp32 <-> bf16 wrongly
    (interpreter.py _convert_float renormalises them); the GPU test covers that range."""
    gen = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=gen) * scale).clamp(-60, 60)
    up = torch.randn(shape, generator=gen) * scale * 5
    return gate.to(dtype=dtype, device=DEVICE), up.to(dtype=dtype, device=DEVICE)


def _reference(gate, up):
    from optimized_stack.model.ops import situ
    return situ(gate, up, BETA, LINEAR_BETA)


def _close(ref, got):
    from k3verify.compare.tensors import compare_tensors
    bound = FP32_ULP if ref.dtype == torch.float32 else NARROW_ULP
    return compare_tensors(ref, got, label="fused_situ vs ops.situ", max_ulp=bound)


DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0], ids=["small", "unit", "large"])
def test_the_kernel_is_the_torch_formula_within_the_interpreters_ulp(dtype, scale):
    gate, up = _inputs((33, 200), dtype, scale)
    ref = _reference(gate, up)
    got = _situ().fused_situ(gate, up, BETA, LINEAR_BETA)
    assert got.dtype == dtype and got.shape == ref.shape and got.is_contiguous()
    finding = _close(ref, got)
    assert finding.passed, finding.message()
    # negative control: the seeded fault (lb * tanh(u / lb) without its lb) is far outside the bound
    bad = _close(ref, _situ().fused_situ(gate, up, BETA, LINEAR_BETA, fault="no_linear_beta"))
    assert not bad.passed, "the check held with linear_beta dropped: it proves nothing"


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's blind spot (on a GPU the gpu test shows the fault)")
def test_the_fast_exp_fault_is_invisible_to_the_interpreter():
    """Why mut_fused_situ_fast_exp's control is the GPU test: the interpreter runs tl.exp and
    libdevice's expf both as numpy's exp."""
    gate, up = _inputs((9, 64), torch.float32, 3.0)
    fused = _situ().fused_situ
    assert bit_equal(fused(gate, up, BETA, LINEAR_BETA, fault="fast_exp"), fused(gate, up, BETA, LINEAR_BETA))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_row_is_the_same_alone_and_in_a_batch_of_1_7_64(dtype):
    """The definition (batch_invariant_ops): the kernel on rows [a, b) against the same rows of
    the 71-row call, bitwise; gate and up as the halves of one [R, 2, F] tensor (strided)."""
    gate, up = _inputs((71, 96), dtype, 3.0, seed=2)
    x = torch.stack([gate, up], dim=1)                                     # [R, 2, F]
    fused = _situ().fused_situ
    assert row_mismatches(lambda t: fused(t[:, 0], t[:, 1], BETA, LINEAR_BETA), x, ms=(1, 7, 64)) == []
    # negative control: a form whose row reads another row's up (the batch reversed) must be caught
    mixed = row_mismatches(lambda t: fused(t[:, 0], t[:, 1].flip(0), BETA, LINEAR_BETA), x, ms=(1, 7, 64))
    assert mixed, "the invariance check passed a form whose rows depend on the batch"


@pytest.mark.parametrize("view", ["columns-of-wider", "transposed", "experts-slice"])
def test_strided_inputs_give_the_contiguous_bits(view):
    """The callers hand contiguous [E, T, F] / [T*k, F] tensors; any view must give the same bits."""
    fused = _situ().fused_situ
    if view == "columns-of-wider":
        gate, up = _inputs((19, 2 * 80), torch.bfloat16, 2.0)
        gate, up = gate[:, 80:], up[:, :80]                                  # row stride 160
    elif view == "transposed":
        gate, up = _inputs((64, 21), torch.bfloat16, 2.0)
        gate, up = gate.t(), up.t()                                          # [21, 64], column stride 21
    else:
        gate, up = _inputs((4, 12, 48), torch.bfloat16, 2.0)
        gate, up = gate[1:3, ::2], up[1:3, 1::2]                             # [2, 6, 48] with gaps
    assert not gate.is_contiguous()
    got = fused(gate, up, BETA, LINEAR_BETA)
    assert bit_equal(got, fused(gate.contiguous(), up.contiguous(), BETA, LINEAR_BETA))
    finding = _close(_reference(gate, up), got)
    assert finding.passed, finding.message()


@pytest.mark.parametrize("shape", [(0, 32), (3, 0, 32), (4, 0)], ids=["R0", "E3-T0", "F0"])
def test_empty_input_gives_an_empty_output(shape):
    gate, up = _inputs(shape, torch.bfloat16)
    out = _situ().fused_situ(gate, up, BETA, LINEAR_BETA)
    assert out.shape == shape and out.dtype == torch.bfloat16


@pytest.mark.parametrize("change,match", [
    (lambda a: {**a, "up": a["up"].float()}, r"gate and up must share one of bfloat16, float16, float32, got "
                                              r"torch.bfloat16 and torch.float32"),
    (lambda a: {**a, "gate": a["gate"].long(), "up": a["up"].long()}, r"must share one of .* got torch.int64"),
    (lambda a: {**a, "up": a["up"][:, :8]}, r"one shape \[..., F\], got \(3, 16\) and \(3, 8\)"),
    (lambda a: {**a, "beta": 0.0}, r"beta must be a finite non-zero number, got 0.0"),
    (lambda a: {**a, "linear_beta": float("inf")}, r"linear_beta must be a finite non-zero number, got inf"),
    (lambda a: {**a, "fault": "fast-exp"}, r"fault must be None or one of fast_exp, no_linear_beta, got 'fast-exp'"),
], ids=["dtypes-differ", "integer", "shapes-differ", "beta-zero", "linear-beta-inf", "unknown-fault"])
def test_bad_input_is_one_line(change, match):
    from optimized_stack.errors import K3Error
    gate, up = _inputs((3, 16), torch.bfloat16)
    args = change({"gate": gate, "up": up, "beta": BETA, "linear_beta": LINEAR_BETA, "fault": None})
    with pytest.raises(K3Error, match=match) as err:
        _situ().fused_situ(args["gate"], args["up"], args["beta"], args["linear_beta"], fault=args["fault"])
    assert "\n" not in str(err.value)


# Compiles _situ_kernel for sm_90 (no GPU needed: Triton's bundled ptxas) in a process without the
# interpreter, with the entry point's LAUNCH options changed by each variant's; prints, per variant,
# how many times each instruction appears in the PTX.
_PTX = r"""
import collections, json, re, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from optimized_stack.kernels.moe import situ
sig = {"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*bf16", "n_rows": "i32", "width": "i32",
       "stride_gr": "i32", "stride_gc": "constexpr", "stride_ur": "i32", "stride_uc": "constexpr",
       "stride_or": "i32", "beta": "fp32", "inv_beta": "fp32", "linear_beta": "fp32", "inv_linear_beta": "fp32",
       "OUT": "constexpr", "BLOCK_R": "constexpr", "BLOCK_F": "constexpr", "FAST_EXP": "constexpr",
       "NO_LINEAR_BETA": "constexpr", "INTERPRET": "constexpr"}
out = []
for variant in json.loads(sys.argv[1]):
    consts = {"stride_gc": 1, "stride_uc": 1, "OUT": tl.bfloat16, "BLOCK_R": 16, "BLOCK_F": 128,
              "FAST_EXP": variant.pop("fault", None) == "fast_exp", "NO_LINEAR_BETA": False, "INTERPRET": False}
    kernel = triton.compile(ASTSource(fn=situ._situ_kernel, signature=sig, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options={**situ.LAUNCH, **variant})
    out.append(collections.Counter(re.findall(r"^\s+([a-z][a-z0-9]*\.[a-z0-9.]+)", kernel.asm["ptx"], re.M)))
print(json.dumps(out))
"""


def _ptx_ops(*variants: dict) -> list[dict]:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", _PTX, json.dumps(list(variants))], env=env, text=True,
                         capture_output=True, cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return [collections.Counter(c) for c in json.loads(run.stdout.strip().splitlines()[-1])]


def test_the_sm90_ptx_has_the_instructions_the_bitwise_argument_needs():
    """What kernels/moe/situ.py's docstring argues, read in the PTX of the launch's options: the
    sigmoid's IEEE division (div.rn, not Triton's div.full), libdevice's accurate expf (its range
    reduction rounds down: fma.rm), no flush to zero but in the two approximations libdevice always
    runs ftz (ex2, rcp: the same in torch's build), every fp32 multiply and add rounded on its own
    (.rn: no contraction), the output rounded to nearest even. Each check fails on the variant it
    guards against: the fast-exp fault, libdevice's ftz paths, FMA contraction on."""
    ops, fast, ftz, fused = _ptx_ops({}, {"fault": "fast_exp"}, {"enable_reflect_ftz": True},
                                     {"enable_fp_fusion": True})
    assert ops["div.rn.f32"] and not [k for k in ops if k.startswith(("div.full", "div.approx"))], ops
    assert ops["fma.rm.f32"] and not fast["fma.rm.f32"] and fast["ex2.approx.f32"], (ops, fast)

    def ftz_ops(c):
        return [k for k in c if ".ftz" in k and not k.startswith(("ex2.approx", "rcp.approx"))]
    assert not ftz_ops(ops) and ftz_ops(ftz), (ops, ftz)

    def bare(c):
        return [k for k in c if k in ("mul.f32", "add.f32", "sub.f32")]
    assert not bare(ops) and bare(fused) and fused["fma.rn.f32"] > ops["fma.rn.f32"], (ops, fused)
    assert ops["cvt.rn.bf16.f32"], ops


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter form of the engine test (on a GPU the selftest judges it)")
def test_the_engine_runs_the_kernel_in_decode_and_sorted_prefill_and_fires_its_event():
    """The option's wiring: the batched decode step's static experts (the event counts its rows,
    one a request a step) and, with prefill_sorted_experts, the prefill's (T * k rows a MoE layer).
    The interpreter's tanh is not torch's, so tokens, not bits, are what the plain run must share."""
    from optimized_stack import load_model
    model = load_model("k3-mini", device="cpu", dtype=torch.bfloat16)
    tokens, rows, events = engine_run(model, ENGINE_PROMPTS)
    d_tokens, _, d_events = engine_run(model, ENGINE_PROMPTS, fused_situ=True)
    assert events.get("fused_situ", 0) == 0, "the control fired the fused SiTU-GLU's event"
    assert d_events["fused_situ"] == d_events["fast_decode_rows"], "decode alone: one row a request a step"
    p_tokens, p_rows, p_events = engine_run(model, ENGINE_PROMPTS, fused_situ=True, prefill_sorted_experts=True)
    moe_layers = sum(model.config.is_moe_layer(i) for i in range(model.config.num_layers))
    prefill_rows = sum(map(len, ENGINE_PROMPTS)) * model.config.num_experts_per_token * moe_layers
    assert p_events["fused_situ"] == p_events["fast_decode_rows"] + prefill_rows
    assert p_events.get("fused_situ_wide", 0) == 0, "k3-mini's experts are 32 wide: the fast-exp fault is not judged"
    assert d_tokens == p_tokens == tokens
    # negative control: the dropped linear_beta through the same wiring changes the logits
    _, m_rows, m_events = engine_run(model, ENGINE_PROMPTS, fused_situ=True, prefill_sorted_experts=True,
                                     faults={"mut_fused_situ_no_linear_beta"})
    assert m_events["fused_situ"] == p_events["fused_situ"]
    assert all(not bit_equal(m_rows[k], rows[k]) for k in rows), "a logits row survived the dropped linear_beta"


def _magnitudes(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """n values of every binade the dtype holds, subnormals included (2^-140 .. 2^16), both signs,
    with zeros, +-inf and the sigmoid's edges (exp(-g) overflows past 88.7, turns subnormal past 87.3)."""
    edges = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 87.0, -87.0, 88.5, -88.5, 89.0, -89.0,
                          100.0, -100.0, 1e4, -1e4])
    gen = torch.Generator().manual_seed(seed)
    m = n - edges.numel()
    mant = 1 + torch.rand(m, generator=gen)
    exp2 = torch.randint(-140, 17, (m,), generator=gen).double()
    sign = torch.where(torch.rand(m, generator=gen) < 0.5, -1.0, 1.0)
    return torch.cat([(sign * mant * torch.exp2(exp2)).to(dtype), edges.to(dtype)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA (the claim is bit for bit on the GPU)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_on_cuda_the_kernel_is_the_torch_formula_bit_for_bit(dtype):
    """torch's CUDA ops (ops.situ on CUDA tensors) against the kernel over ~1M elements of every
    magnitude; the fast-exp fault (tl.exp's ex2.approx in the sigmoid) must differ: its control, in
    fp32, where its few ULP show wherever |g| > ~0.35 (in bf16 ~2^-16 of them cross a rounding, too
    few in a sweep that gives most elements to tiny and huge binades)."""
    from k3verify.compare.tensors import compare_tensors
    n = 1 << 20
    gate = _magnitudes(n, dtype, seed=0).cuda()
    up = _magnitudes(n, dtype, seed=1)[torch.randperm(n, generator=torch.Generator().manual_seed(2))].cuda()
    gate, up = gate.view(-1, 64)[:, :48], up.view(-1, 64)[:, 16:]          # [R, 48], strided like a slice
    ref = _reference(gate, up)
    got = _situ().fused_situ(gate, up, BETA, LINEAR_BETA)
    finding = compare_tensors(ref, got, label="fused_situ vs ops.situ on CUDA")
    assert finding.equal, finding.message()
    gen = torch.Generator().manual_seed(3)
    g32, u32 = ((torch.randn(1024, 256, generator=gen) * 4).cuda() for _ in range(2))
    fast = _situ().fused_situ(g32, u32, BETA, LINEAR_BETA, fault="fast_exp")
    assert not bit_equal(fast, _reference(g32, u32)), "tl.exp gave expf's bits on every element: the check shows nothing"
