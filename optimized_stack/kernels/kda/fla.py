"""fla-core's KDA kernels (CUDA, Triton): the op-table forms and the batched training form.

- `fla_chunk`: chunk_kda over one sequence with a start state (toggle kda_fla_chunk);
- `fla_recurrent`: fused_recurrent_kda, the whole call in one kernel with the state in
  registers (toggle kda_fla_recurrent; the decode-step kernel);
- `fla_chunk_rows` / `fla_recurrent_rows`: the same kernels over one token of each of B
  requests, B sequences of length 1 in one call: the fast decode step's form of the two
  toggles (engine/fast/kda_step.py ROW_FORMS), in place of B calls of one row each;
- `kda_chunk_batched`: chunk_kda over [B, T, ...] from a zero state, for training;
- `fla_chunk_varlen`: chunk_kda over several sequences packed along T (cu_seqlens), the
  negative control of the GPU invariance check (k3verify/invariance.py): a packed batch is
  NOT bit-identical to each sequence alone (measured on the H200, fla-core 0.6.0), which is
  why the GPU reference runs KDA one request at a time.
Op forms take the reference's arguments (model/ops.py): q, k, g [T, H, K], v [T, H, V],
beta [T, H], state [H, K, V] fp32, and return (o [T, H, V] fp32, final state [H, K, V] fp32).
q arrives l2-normed and scaled, so scale=1.0 and no in-kernel norm. fla is imported inside
the functions: this module imports on a machine without fla or a GPU. Leading-underscore
arguments switch in the mutants.
"""
from __future__ import annotations

import os

import torch

# Where fla's chunk kernels round: `fla` (default) as fla-core ships them: the WY triangular
# solve's dots explicitly in TF32 (chunk_intra.SOLVE_TRIL_DOT_PRECISION) and Triton's default
# fp32 dots (TF32 on CUDA) elsewhere; `ieee`: every fp32 dot in IEEE fp32 (the solve's constant
# patched before the first compile, TRITON_F32_DEFAULT=ieee for the rest). A diagnostic of the
# chunk kernel's drift (issue 18): set it before fla compiles, with a Triton cache of its own.
DOTS_ENV = "K3_FLA_DOTS"
_configured: str | None = None


def dots_choice() -> str:
    value = os.environ.get(DOTS_ENV, "fla").strip().lower() or "fla"
    if value not in ("fla", "ieee"):
        from ...errors import K3Error
        raise K3Error(f"{DOTS_ENV} must be 'fla' or 'ieee', got {value!r}")
    return value


def _configure() -> None:
    """Apply K3_FLA_DOTS once, before fla's first kernel call in this process."""
    global _configured
    choice = dots_choice()
    if _configured == choice:
        return
    if _configured is not None:
        from ...errors import K3Error
        raise K3Error(f"{DOTS_ENV} changed from {_configured!r} to {choice!r} after fla compiled")
    if choice == "ieee":
        import triton.language as tl
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
        from fla.ops.kda import chunk_intra
        chunk_intra.SOLVE_TRIL_DOT_PRECISION = tl.constexpr("ieee")
    _configured = choice


def _state_in(state: torch.Tensor | None, transpose: bool) -> torch.Tensor | None:
    if state is None:
        return None
    s = state.float()
    if transpose:
        s = s.transpose(-1, -2)
    return s.unsqueeze(0).contiguous()


def fla_chunk(q, k, v, g, beta, initial_state=None, *, _drop_state: bool = False,
              _beta_sigmoid_again: bool = False):
    """fla-core chunk_kda (chunks of 64 tokens; a T < 64 call is one padded chunk)."""
    _configure()
    from fla.ops.kda import chunk_kda
    init = None if _drop_state else _state_in(initial_state, False)
    o, final = chunk_kda(q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0),
                         g=g.float().unsqueeze(0), beta=beta.float().unsqueeze(0), scale=1.0,
                         initial_state=init, output_final_state=True,
                         use_beta_sigmoid_in_kernel=_beta_sigmoid_again)
    return o[0].float(), final[0].float()


def fla_recurrent(q, k, v, g, beta, initial_state=None, *, _transpose_state: bool = False):
    """fla-core fused_recurrent_kda: the whole call in one kernel, state in registers."""
    _configure()
    from fla.ops.kda import fused_recurrent_kda
    if initial_state is None:
        initial_state = q.new_zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float32)
    o, final = fused_recurrent_kda(q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0),
                                   g=g.float().unsqueeze(0), beta=beta.float().unsqueeze(0), scale=1.0,
                                   initial_state=_state_in(initial_state, _transpose_state),
                                   output_final_state=True)
    final = final[0].float()
    if _transpose_state:
        final = final.transpose(-1, -2).contiguous()
    return o[0].float(), final


def _rows_in(q, k, v, g, beta):
    """One token of B requests [B, H, ...] as B sequences of length 1 [B, 1, H, ...]."""
    return dict(q=q.unsqueeze(1), k=k.unsqueeze(1), v=v.unsqueeze(1), g=g.float().unsqueeze(1),
                beta=beta.float().unsqueeze(1))


def fla_chunk_rows(q, k, v, g, beta, states):
    """fla_chunk for one token of each of B requests in one chunk_kda call: q, k, g [B, H, K],
    v [B, H, V], beta [B, H], states [B, H, K, V] fp32 -> (o [B, H, V] fp32, finals [B, H, K, V]
    fp32). Every (sequence, head) pair is its own program in fla's grid, so a row's arithmetic is
    the one-row call's (tests/test_fast_gpu.py compares the two on the device)."""
    _configure()
    from fla.ops.kda import chunk_kda
    o, final = chunk_kda(**_rows_in(q, k, v, g, beta), scale=1.0, initial_state=states.float().contiguous(),
                         output_final_state=True)
    return o[:, 0].float(), final.float()


def fla_recurrent_rows(q, k, v, g, beta, states):
    """fla_recurrent for one token of each of B requests in one fused_recurrent_kda call (the
    arguments and results of fla_chunk_rows)."""
    _configure()
    from fla.ops.kda import fused_recurrent_kda
    o, final = fused_recurrent_kda(**_rows_in(q, k, v, g, beta), scale=1.0,
                                   initial_state=states.float().contiguous(), output_final_state=True)
    return o[:, 0].float(), final.float()


def kda_chunk_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, io_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fla's chunked KDA kernel; same arguments and result as kda_recurrent_batched.

    q is already l2-normed and scaled, so scale=1.0 and no in-kernel norm. q, k, v travel
    in io_dtype (bf16 halves the kernel's traffic); g and beta stay fp32.
    """
    _configure()
    from fla.ops.kda import chunk_kda

    o, _ = chunk_kda(q=q.to(io_dtype), k=k.to(io_dtype), v=v.to(io_dtype), g=g.float(),
                     beta=beta.float(), scale=1.0, initial_state=None, output_final_state=False)
    return o.float()


def fla_chunk_varlen(q, k, v, g, beta, cu_seqlens: torch.Tensor, initial_state=None):
    """chunk_kda over N sequences packed along T: q, k, g [T, H, K], v [T, H, V], beta [T, H],
    cu_seqlens [N+1] int64 (sequence i is rows cu_seqlens[i]:cu_seqlens[i+1]), initial_state
    [N, H, K, V] fp32 or None. Returns (o [T, H, V] fp32, final states [N, H, K, V] fp32)."""
    _configure()
    from fla.ops.kda import chunk_kda
    init = None if initial_state is None else initial_state.float().contiguous()
    o, final = chunk_kda(q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0),
                         g=g.float().unsqueeze(0), beta=beta.float().unsqueeze(0), scale=1.0,
                         initial_state=init, output_final_state=True,
                         cu_seqlens=cu_seqlens.to(device=q.device, dtype=torch.long))
    return o[0].float(), final.float()
