"""Where the Triton kernel tests run: on a CUDA GPU when there is one, else on the CPU through
Triton's interpreter (TRITON_INTERPRET=1, `make test-triton`, its own venv: numpy < 2.3).
A test module sets `pytestmark = MARKS` (skips with the reason where neither is there)."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"

if not HAVE_TRITON:
    REASON = "needs triton: run `make test-triton` (.venv-triton, TRITON_INTERPRET=1)"
elif DEVICE == "cpu" and not INTERPRET:
    REASON = "Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (`make test-triton`)"
else:
    REASON = ""

needs_triton = pytest.mark.skipif(bool(REASON), reason=REASON or "runs")
# The interpreter (triton 3.6.0 on numpy 2.2) warns on every scalar index; it is not ours to fix.
MARKS = [needs_triton, pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")]


def tol(dtype: torch.dtype) -> float:
    """Max relative error (max|Δ| / max|ref|) against an fp64 reference, per output dtype:
    fp32 accumulation of O(100) terms ~ 1e-6; one bf16 rounding of the output 2^-8."""
    return {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]


def max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double().cpu()
    return float((out.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    from k3verify.compare.invariance import bit_equal as eq
    return eq(a, b)


# The row counts of the invariance tests (tiny: the interpreter runs a kernel in numpy).
MS = (1, 2, 3, 5, 8, 13, 17, 33)


def row_mismatches(fn, x: torch.Tensor, ms=MS, dim: int = 0) -> list[str]:
    """Where fn's rows differ from the same rows of the n-row call: 'first M' / 'last M' labels.
    The test IS the definition (batch_invariant_ops): fn(x[a:b]) against fn(x)[a:b], bitwise."""
    n = x.shape[dim]
    full = fn(x)
    bad = []
    for m in ms:
        first = fn(x.narrow(dim, 0, m))
        if not bit_equal(first, full.narrow(0, 0, m)):
            bad.append(f"first {m}")
        last = fn(x.narrow(dim, n - m, m))
        if not bit_equal(last, full.narrow(0, n - m, m)):
            bad.append(f"last {m}")
    return bad


# ---- a decode kernel through the engine (the fused decode toggles' interpreter tests) -------------
ENGINE_PROMPTS = [list(range(1, 12)), list(range(5, 9)), list(range(20, 37))]


def engine_run(model, prompts, **options):
    """Batched decode of `prompts` (5 new tokens each, arrivals staggered so batches change) with
    engine `options` on top -> (tokens per request, every logits row by (request, position), the
    engine's path events)."""
    from optimized_stack import toggles
    from optimized_stack.engine.engine import Engine, EngineObserver
    from optimized_stack.engine.options import EngineOptions, SamplingParams

    class Rows(EngineObserver):
        def __init__(self):
            self.rows = {}

        def on_logits(self, request_id, start_pos, rows):
            self.rows[(request_id, start_pos)] = rows.clone()
    with toggles.applied(["batched_decode"]) as ap:
        opts = EngineOptions.from_dict({**ap.engine, "max_num_seqs": len(prompts), "kda_pool_slots": len(prompts),
                                        **options})
    cap = Rows()
    eng = Engine(model, opts, [cap])
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(max_new_tokens=5, ignore_eos=True), request_id=f"r{i}", arrival_step=i % 2)
    with torch.no_grad():
        out = eng.run()
    return {r: o.tokens for r, o in out.items()}, cap.rows, dict(eng.events)
