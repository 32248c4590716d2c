"""The GPU reference profile: what the reference primitives compute when their tensors are on
CUDA. bf16 weights and activations, fp32 accumulation, fp32 KDA state; every row op
batch-invariant by construction (docs/design.md, "One reference per device").

The reference primitives in optimized_stack/model/ call into this module when x.is_cuda, and
only then; the CPU path never reaches it (its golden hashes are unchanged):

| primitive (model/)       | CUDA form                                          | why a row's bits cannot depend on its batch |
|--------------------------|----------------------------------------------------|---------------------------------------------|
| ops.row_linear           | cuBLAS F.linear (bf16) or kernels/gemm/invariant.py| see "GEMM" below                            |
| ops.rms_norm, ops.l2_norm, ops.row_sum | kernels/norm/rows.py                 | one program per row, fixed chunks, fp32     |
| AttnResRead.mix          | kernels/attn_res/read.py                           | one program per token, candidates in order  |
| mla.blocked_attention    | kernels/mla/attention.py                           | 64-key blocks to the query's causal limit   |
| kda.kda_scan             | bf16 / fp16 activations: fla chunk_kda on the leading 64-aligned part, fused_recurrent_kda for the T mod 64 tail and for decode; fp32 activations: fused_recurrent_kda for every call | chunk_kda is bitwise across 64-aligned cuts; fused_recurrent_kda gives T tokens in one call == T one-token calls (measured on the H200, NOTES.md) |

GEMM (`K3_GPU_GEMM`, read at every call): `auto` (default) runs cuBLAS for bf16 / fp16 and
the Triton GEMM for fp32; `cublas` and `triton` force one for every dtype. Why auto:
cuBLAS bf16 was row-invariant at every M measured on the H200 (1..32, 48, 64, 100, 128, 200,
256 at the K3-small shapes, default settings and split-K off) and is 1.5-2.2x faster than
the Triton GEMM; but that is a measurement, not a construction, so k3verify/invariance.py
re-proves it at every weight shape of the model on every GPU run, and `triton` is the
by-construction fallback the day a cuBLAS release or a shape breaks it. fp32 cuBLAS was not
invariant at any M tested, so fp32 (the MoE router runs in fp32 in every profile) always
takes the Triton GEMM under auto.

KDA (`K3_GPU_KDA`): `split` (default) as in the table. Cutting a prefill at a multiple of
64 tokens, or after its tail token by token, is then bit-identical to the whole prefill;
a cut inside a 64-token chunk is not (chunk vs recurrent differ by rounding), so the exact
engine toggles hold on the GPU where their cuts sit on the 64-token grid of the call.
`recurrent` runs every call through fused_recurrent_kda: invariant to any cut, slower for
long prompts.

An fp32 model's KDA always takes the recurrent form, whatever K3_GPU_KDA says: chunk_kda runs its
fp32 dots in TF32 (the WY solve explicitly, chunk_intra.SOLVE_TRIL_DOT_PRECISION, the rest by
Triton's fp32 default), so in an fp32 run it was the one TF32 op of a profile that declares TF32
off: two independent fp32 KDA forms (torch's chunked closed form and fla's recurrence) agreed
with each other and missed their fp32 budget against it by the same figures (the fourth H200
release run). fused_recurrent_kda has no tl.dot: fp32 FMAs only. The layer tells the profile its
activations' dtype (`kda_activations`, set by KDAttention.forward around the scan); a bf16
model keeps the split, where TF32 sits far below bf16's own rounding.

Autograd: training calls some of these primitives with autograd on (rms_norm, l2_norm,
AttnResRead.mix); none of the kernels has a backward, so a call that needs a graph
(`torch.is_grad_enabled()` and an input that requires grad) takes torch's plain form.
The reference runs under no_grad, so inference never sees that branch.

The launch helpers at the end are shared by the kernels' entry points.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Callable, Iterator

import torch

from ..errors import K3Error

GEMM_ENV = "K3_GPU_GEMM"
GEMM_CHOICES = ("auto", "cublas", "triton")
KDA_ENV = "K3_GPU_KDA"
KDA_CHOICES = ("split", "recurrent")
KDA_CHUNK = 64          # fla chunk_kda's chunk: prefill is cut only on this grid


def gemm_choice() -> str:
    value = os.environ.get(GEMM_ENV, "auto").strip().lower() or "auto"
    if value not in GEMM_CHOICES:
        raise K3Error(f"{GEMM_ENV} must be one of {', '.join(GEMM_CHOICES)}, got {value!r}")
    return value


def gemm_backend(dtype: torch.dtype) -> str:
    """'cublas' or 'triton': which GEMM the profile runs for inputs of this dtype."""
    choice = gemm_choice()
    if choice == "auto":
        return "triton" if dtype == torch.float32 else "cublas"
    return choice


def kda_choice() -> str:
    value = os.environ.get(KDA_ENV, "split").strip().lower() or "split"
    if value not in KDA_CHOICES:
        raise K3Error(f"{KDA_ENV} must be one of {', '.join(KDA_CHOICES)}, got {value!r}")
    return value


# the dtype of the activations of the KDA layer now calling the scan (None: not told, the split)
_KDA_ACTIVATIONS: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar(
    "k3_kda_activations", default=None)


@contextlib.contextmanager
def kda_activations(dtype: torch.dtype) -> Iterator[None]:
    """Within the block, kda_scan serves a layer whose activations are `dtype` (fp32: recurrent)."""
    token = _KDA_ACTIVATIONS.set(dtype)
    try:
        yield
    finally:
        _KDA_ACTIVATIONS.reset(token)


def kda_form() -> str:
    """'split' or 'recurrent': the KDA form of the call in progress (K3_GPU_KDA, and fp32 -> recurrent)."""
    choice = kda_choice()
    return "recurrent" if _KDA_ACTIVATIONS.get() == torch.float32 else choice


def describe() -> dict[str, object]:
    """The profile's choices with their reasons, for reports (every automatic choice recorded)."""
    gemm = gemm_choice()
    return {
        "gemm": gemm,
        "gemm_bf16": gemm_backend(torch.bfloat16), "gemm_fp32": gemm_backend(torch.float32),
        "gemm_reason": {"auto": "cuBLAS bf16 measured row-invariant on the H200 and re-proved by the "
                                "invariance check; fp32 cuBLAS is not invariant, so fp32 takes the Triton GEMM",
                        "cublas": f"forced by {GEMM_ENV}=cublas (fp32 cuBLAS is NOT batch-invariant)",
                        "triton": f"forced by {GEMM_ENV}=triton (invariant by construction)"}[gemm],
        "kda": kda_choice(), "kda_chunk": KDA_CHUNK, "kda_fp32": "recurrent",
        "kda_reason": "fp32 activations take fused_recurrent_kda (fp32 FMAs): chunk_kda's fp32 dots are TF32; "
                      "bf16 / fp16 take K3_GPU_KDA's form, chunk_kda's TF32 far below bf16's rounding",
        "tf32": False, "reduced_precision_reduction": False,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "cublaslt_workspace_size": os.environ.get("CUBLASLT_WORKSPACE_SIZE"),
    }


# ---- torch's global matmul flags ------------------------------------------------------------
_FLAGS = ("allow_tf32", "allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


@contextlib.contextmanager
def profile() -> Iterator[None]:
    """TF32 and cuBLAS's reduced-precision (bf16 / fp16) reductions off for the block; the
    previous settings come back in `finally`. Every cuBLAS call of the profile runs inside."""
    matmul = torch.backends.cuda.matmul
    saved = {name: getattr(matmul, name) for name in _FLAGS}
    saved_cudnn = torch.backends.cudnn.allow_tf32
    try:
        for name in _FLAGS:
            setattr(matmul, name, False)
        torch.backends.cudnn.allow_tf32 = False
        yield
    finally:
        for name, value in saved.items():
            setattr(matmul, name, value)
        torch.backends.cudnn.allow_tf32 = saved_cudnn


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """True when autograd must record this call (the kernels have no backward)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---- the CUDA forms of the reference primitives -----------------------------------------------
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ops.row_linear on CUDA: y = x @ weight.T, x [.., K], weight [N, K]."""
    if gemm_backend(x.dtype) == "cublas" or needs_autograd(x, weight):
        with profile():
            return torch.nn.functional.linear(x, weight)
    from .gemm.invariant import matmul
    lead = x.shape[:-1]
    return matmul(x.reshape(-1, x.shape[-1]), weight).reshape(*lead, weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """ops.rms_norm on CUDA: normalise each row of x [.., D] in fp32, cast back, times weight."""
    from .norm.rows import rms_norm_rows
    lead, d = x.shape[:-1], x.shape[-1]
    return rms_norm_rows(x.reshape(-1, d), weight, eps).reshape(*lead, d)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """ops.l2_norm on CUDA: x * rsqrt(sum x^2 + eps) per row of x [.., D], in x's dtype."""
    from .norm.rows import l2_norm_rows
    lead, d = x.shape[:-1], x.shape[-1]
    return l2_norm_rows(x.reshape(-1, d), eps).reshape(*lead, d)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """ops.row_sum on CUDA: x.sum(-1, keepdim=True) per row of x [.., D], fp32 sum, x's dtype."""
    from .norm.rows import row_sum as triton_row_sum
    lead, d = x.shape[:-1], x.shape[-1]
    return triton_row_sum(x.reshape(-1, d)).to(x.dtype).reshape(*lead, 1)


def attn_res_mix(candidates: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """AttnResRead.mix on CUDA: N+1 candidates [T, D] -> [T, D] in the partial sum's dtype."""
    from .attn_res.read import attn_res_read
    dtype = candidates[-1].dtype
    vals = torch.stack([c.to(dtype) for c in candidates])                   # [N+1, T, D]
    return attn_res_read(vals, norm_w, proj_w, eps)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              scale: float) -> torch.Tensor:
    """mla.blocked_attention on CUDA: q [T, H, C], k [S, H, C], v [S, H, Vd] -> [T, H, Vd] fp32."""
    from .mla.attention import causal_attention
    return causal_attention(q, k, v, q_pos, scale)


KDAOp = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def kda_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             initial_state: torch.Tensor | None = None, *, chunk: KDAOp | None = None,
             recurrent: KDAOp | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kda.kda_scan on CUDA. q, k, g [T, H, K], v [T, H, V], beta [T, H], state [H, K, V] fp32
    -> (o [T, H, V] fp32, final state [H, K, V] fp32).

    The leading T - T mod 64 tokens go through `chunk` (fla chunk_kda), the rest, and every
    one-token decode, through `recurrent` (fla fused_recurrent_kda), the state carried from
    one to the other; every token through `recurrent` when kda_form() says so (K3_GPU_KDA=recurrent,
    or an fp32 layer: see the module docstring). `chunk` / `recurrent` default to fla's; tests pass stand-ins."""
    if chunk is None or recurrent is None:
        from .kda import fla
        chunk = chunk or fla.fla_chunk
        recurrent = recurrent or fla.fla_recurrent
    t_len = q.shape[0]
    if t_len == 0:
        raise K3Error("kda_scan: expected at least one token, got T = 0")
    aligned = 0 if kda_form() == "recurrent" else t_len - t_len % KDA_CHUNK
    state = initial_state
    outs = []
    if aligned:
        o, state = chunk(q[:aligned], k[:aligned], v[:aligned], g[:aligned], beta[:aligned], state)
        outs.append(o)
    if aligned < t_len:
        o, state = recurrent(q[aligned:], k[aligned:], v[aligned:], g[aligned:], beta[aligned:], state)
        outs.append(o)
    return (outs[0] if len(outs) == 1 else torch.cat(outs)), state


# ---- launch helpers shared by the kernels' entry points -----------------------------------------
def interpreting() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1), how CI runs the kernels."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fail(message: str) -> None:
    """Bad input at a kernel's entry point: one line, what was expected and what arrived."""
    raise K3Error(message)


def check_runnable(**tensors: torch.Tensor) -> None:
    """Every tensor on one CUDA device (or on the CPU under the interpreter)."""
    devices = {t.device for t in tensors.values()}
    for name, t in tensors.items():
        if not t.is_cuda and not interpreting():
            fail(f"{name} must be on a CUDA device (or run under TRITON_INTERPRET=1), got {t.device}")
    if len(devices) > 1:
        listed = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        fail(f"inputs must share one device, got {listed}")
