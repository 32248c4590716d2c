"""GPU ops for training and GPU runs: fla-core's chunk_kda for KDA, torch SDPA for MLA.

Two shapes of each op:
- batched [B, T, ...] forms for the batched training forward (optimized_stack.train);
- OpTable forms (`kda_prefill`, `mla_attention` signatures in model/ops.py) so the
  reference model itself can run on a GPU: `with ops.override(**reference_overrides()):`.

None of this is on the CPU reference path. fla is imported lazily, so importing this
module works on a machine without fla or a GPU; the recurrent forms here are the CPU
fallback (tests, and the equality check against the chunked kernel).

Shape letters: B batch, T tokens, S keys, H heads, K key dim, V value dim, C qk dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def kda_recurrent_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor) -> torch.Tensor:
    """The KDA recurrence (decay, delta, write, read) with a batch dim, zero initial state.

    q, k, g [B, T, H, K] (q l2-normed and scaled), v [B, T, H, V], beta [B, T, H].
    Returns o [B, T, H, V] fp32. Differentiable; slow (one step per token): CPU / tests only.
    """
    b, t_len, h, kd = q.shape
    q, k, v, g, beta = q.float(), k.float(), v.float(), g.float(), beta.float()
    state = q.new_zeros(b, h, kd, v.shape[-1])
    decay = torch.exp(g)
    outs = []
    for t in range(t_len):
        state = state * decay[:, t].unsqueeze(-1)                          # [B, H, K, V]
        kv = (state * k[:, t].unsqueeze(-1)).sum(2)                        # S^T k  [B, H, V]
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - kv)
        state = state + k[:, t].unsqueeze(-1) * u.unsqueeze(2)
        outs.append((state * q[:, t].unsqueeze(-1)).sum(2))
    return torch.stack(outs, 1)


def kda_chunk_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """The KDA recurrence in chunked form, plain torch (no kernel compile), fp32.

    Same arguments and result as kda_recurrent_batched. Inside a chunk of C tokens, with
    G = cumsum(g) and the state S0 at the chunk start:
        A[t, j] = sum_c k_t k_j exp(G_t - G_j)  (j < t),  L = I + diag(beta) A
        U = L^-1 diag(beta) (V - (k * exp(G)) S0)             # the u_t of every token
        O = (q * exp(G)) S0 + tril(Qk) U,  Qk[t, j] = sum_c q_t k_j exp(G_t - G_j)
        S_end = diag(exp(G_C)) S0 + (k * exp(G_C - G))^T U
    S_end is affine in S0 (S_end = P S0 + R), so the chunk-start states come from a
    log-depth scan over chunks. exp(G_t - G_j) is split around the chunk's middle token;
    with g >= -5 and C = 16 no factor leaves fp32 range.
    """
    with torch.autocast(q.device.type, enabled=False):   # the chunk algebra needs fp32
        return _kda_chunk_fp32(q, k, v, g, beta, chunk)


def _kda_chunk_fp32(q, k, v, g, beta, chunk: int) -> torch.Tensor:
    b, t_len, h, kd = q.shape
    vd = v.shape[-1]
    pad = -t_len % chunk
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if pad:   # padded tokens are identity steps (g = 0, beta = 0) after the real ones
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = q.shape[1] // chunk

    def chunks(x):   # [B, T, H, D] -> [B, H, N, C, D]
        return x.view(b, n, chunk, h, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    beta = beta.view(b, n, chunk, h).permute(0, 3, 1, 2).unsqueeze(-1)           # [B,H,N,C,1]
    gc = g.cumsum(-2)
    ref = gc[..., chunk // 2:chunk // 2 + 1, :]
    k_in, k_out = k * torch.exp(gc - ref), k * torch.exp(ref - gc)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    a = (k_in @ k_out.transpose(-1, -2)).tril(-1)                                # strict lower
    qk = ((q * torch.exp(gc - ref)) @ k_out.transpose(-1, -2)).masked_fill(~causal, 0.0)
    eye = torch.eye(chunk, device=q.device)
    lower = eye + beta * a
    kg = k * torch.exp(gc)
    w = torch.linalg.solve_triangular(lower, beta * kg, upper=False, unitriangular=True)
    u0 = torch.linalg.solve_triangular(lower, beta * v, upper=False, unitriangular=True)
    k_dec = k * torch.exp(gc[..., -1:, :] - gc)
    p_mat = torch.diag_embed(torch.exp(gc[..., -1, :])) - k_dec.transpose(-1, -2) @ w   # [B,H,N,K,K]
    r_mat = k_dec.transpose(-1, -2) @ u0                                                # [B,H,N,K,V]
    step = 1
    while step < n:   # inclusive scan of S -> P S + R over chunks (Hillis-Steele)
        p_new = p_mat[:, :, step:] @ p_mat[:, :, :-step]
        r_new = p_mat[:, :, step:] @ r_mat[:, :, :-step] + r_mat[:, :, step:]
        p_mat = torch.cat([p_mat[:, :, :step], p_new], 2)
        r_mat = torch.cat([r_mat[:, :, :step], r_new], 2)
        step *= 2
    s0 = torch.cat([torch.zeros_like(r_mat[:, :, :1]), r_mat[:, :, :-1]], 2)         # chunk starts
    u = u0 - w @ s0
    o = (q * torch.exp(gc)) @ s0 + qk @ u                                              # [B,H,N,C,V]
    return o.permute(0, 2, 3, 1, 4).reshape(b, n * chunk, h, vd)[:, :t_len]


def kda_chunk_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, io_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fla's chunked KDA kernel; same arguments and result as kda_recurrent_batched.

    q is already l2-normed and scaled, so scale=1.0 and no in-kernel norm. q, k, v travel
    in io_dtype (bf16 halves the kernel's traffic); g and beta stay fp32.
    """
    from fla.ops.kda import chunk_kda

    o, _ = chunk_kda(q=q.to(io_dtype), k=k.to(io_dtype), v=v.to(io_dtype), g=g.float(),
                     beta=beta.float(), scale=1.0, initial_state=None, output_final_state=False)
    return o.float()


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention. q, k [B, T, H, C], v [B, T, H, V] -> [B, T, H, V].

    V is zero-padded up to C so the fused (flash) kernel, which wants one head dim for
    q, k and v, can run; the padded columns of the output are zeros and are dropped.
    """
    vd, c = v.shape[-1], q.shape[-1]
    if vd < c:
        v = F.pad(v, (0, c - vd))
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, scale=scale)
    return o.transpose(1, 2)[..., :vd]


# ---- OpTable forms: the reference model on a GPU --------------------------------------

def fla_kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, state: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """OpTable.kda_prefill: q, k, g [T, H, K], v [T, H, V], beta [T, H], state [H, K, V]."""
    from fla.ops.kda import chunk_kda

    init = None if state is None else state.float().unsqueeze(0).contiguous()
    o, final = chunk_kda(q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0),
                         g=g.float().unsqueeze(0), beta=beta.float().unsqueeze(0), scale=1.0,
                         initial_state=init, output_final_state=True)
    return o[0].float(), final[0].float()


def sdpa_mla_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """OpTable.mla_attention: q [T, H, C] at positions q_pos over keys k [S, H, C], v [S, H, V]."""
    visible = torch.arange(k.shape[0], device=q.device).view(1, -1) <= q_pos.view(-1, 1)  # [T, S]
    o = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                       v.transpose(0, 1).float(), attn_mask=visible, scale=scale)
    return o.transpose(0, 1)


def reference_overrides() -> dict:
    """The op-table entries that move the reference model's sequence ops onto the GPU."""
    return {"kda_prefill": fla_kda_prefill, "mla_attention": sdpa_mla_attention}


def self_check(device: str = "cuda", b: int = 2, t: int = 300, h: int = 4, kd: int = 16,
               with_fla: bool = False) -> dict:
    """Max relative errors of the fast ops against the plain forms, forward and gradients."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    def l2(x):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    q0, k0, v0 = l2(rnd(b, t, h, kd)) * kd ** -0.5, l2(rnd(b, t, h, kd)), rnd(b, t, h, kd)
    g0, beta0 = -5 * torch.sigmoid(rnd(b, t, h, kd)), torch.sigmoid(rnd(b, t, h))
    out = {}

    def rel(a, r):
        return float((a - r).abs().max() / r.abs().max().clamp(min=1e-12))

    def run(fn):
        ins = [x.clone().requires_grad_(True) for x in (q0, k0, v0, g0, beta0)]
        o = fn(*ins)
        (o * torch.linspace(-1, 1, o.numel(), device=device).view_as(o)).sum().backward()
        return o.detach(), [x.grad for x in ins]

    ref_o, ref_g = run(kda_recurrent_batched)
    o, gr = run(kda_chunk_torch)
    out["kda_torch_fwd"] = rel(o, ref_o)
    out["kda_torch_grad"] = max(rel(a, r) for a, r in zip(gr, ref_g))
    print("kda torch", out, flush=True)
    if not with_fla:
        return out
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        o, gr = run(lambda *a: kda_chunk_batched(*a, io_dtype=dt))
        out[f"kda_{name}_fwd"] = rel(o, ref_o)
        out[f"kda_{name}_grad"] = max(rel(a, r) for a, r in zip(gr, ref_g))
    c, vd = 24, 16
    q, k, v = rnd(b, t, h, c), rnd(b, t, h, c), rnd(b, t, h, vd)
    s = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) * c ** -0.5
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=device).triu(1), float("-inf"))
    ref = (s.softmax(-1) @ v.transpose(1, 2)).transpose(1, 2)
    out["sdpa_fp32"] = rel(sdpa_causal(q, k, v, c ** -0.5), ref)
    out["sdpa_bf16"] = rel(sdpa_causal(q.bfloat16(), k.bfloat16(), v.bfloat16(), c ** -0.5).float(), ref)
    st0 = torch.zeros(h, kd, kd, device=device)
    o1, s1 = fla_kda_prefill(q0[0], k0[0], v0[0], g0[0], beta0[0], st0)
    out["prefill_op_fwd"] = rel(o1, ref_o[0])
    return out
