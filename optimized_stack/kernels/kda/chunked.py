"""Chunked KDA (the UT / WY form): one triangular solve and one state update per chunk.

Two forms of one algorithm:
- `kda_chunked`: the op-table form (the reference `kda_recurrent`'s signature, one sequence,
  any start state): the `kda_chunked` toggle, and the long-context CPU path;
- `kda_chunk_torch`: the batched, differentiable form training uses ([B, T, ...], zero start
  state, chunk 16, chunk-start states from a log-depth scan).
Equal to the recurrence only to rounding (about 1e-6 relative in fp32), never bit for bit:
`approx` everywhere.

Within a chunk of C tokens with start state S0 [H, K, V] and Γ_i = sum_{j<=i} g_j (per key
channel), the recurrence unrolls to
    (I + A) U = diag(beta) (V - (K * e^Γ) S0),     A_ij = beta_i sum_c k_ic k_jc e^(Γ_ic - Γ_jc), j < i
    O = (Q * e^Γ) S0 + tril(M) U,                   M_ij = sum_c q_ic k_jc e^(Γ_ic - Γ_jc),    j <= i
    S_C = e^Γ_C * S0 + sum_j (k_j * e^(Γ_C - Γ_j)) u_j^T
Pairwise exponents are formed as e^(Γ_i - Γ_j) directly (<= 1 for j <= i), never as a
product e^Γ_i * e^-Γ_j, which overflows fp32 once the chunk's decay passes ~88 nats.

Shape letters: T tokens, C chunk, H heads, K key dim, V value dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                chunk_size: int = CHUNK, _gamma_shift: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; state [H, K, V]. -> (o [T, H, V], state).

    `_gamma_shift` exists only for the seeded off-by-one mutant (see toggle_defs)."""
    if chunk_size not in (16, 32, 64, 128):
        raise ValueError(f"chunk_size must be 16, 32, 64 or 128, got {chunk_size}")
    t_len, h, kd = q.shape
    vd = v.shape[-1]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = (torch.zeros(h, kd, vd, dtype=torch.float32, device=q.device) if initial_state is None
             else initial_state.float().clone())
    out = torch.empty(t_len, h, vd, dtype=torch.float32, device=q.device)
    for c0 in range(0, t_len, chunk_size):
        qc, kc, vc = q[c0:c0 + chunk_size], k[c0:c0 + chunk_size], v[c0:c0 + chunk_size]
        gc, bc = g[c0:c0 + chunk_size], beta[c0:c0 + chunk_size]
        n = qc.shape[0]
        gam = gc.cumsum(0)                                              # [C, H, K]
        if _gamma_shift:
            gam = torch.cat([torch.zeros_like(gam[:1]), gam[:-1]])      # exclusive: off by one
        # pairwise decay e^(Γ_i - Γ_j) for j <= i, per channel: [H, C, C, K]
        diff = (gam.permute(1, 0, 2).unsqueeze(2) - gam.permute(1, 0, 2).unsqueeze(1))
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device))
        decay = torch.exp(diff.masked_fill(~causal.view(1, n, n, 1), float("-inf")))
        qh, kh, vh = qc.permute(1, 0, 2), kc.permute(1, 0, 2), vc.permute(1, 0, 2)   # [H, C, *]
        bh = bc.permute(1, 0)                                           # [H, C]
        eg = torch.exp(gam).permute(1, 0, 2)                            # [H, C, K]
        a = torch.einsum("hik,hjk,hijk->hij", kh, kh, decay) * bh.unsqueeze(-1)
        a = a.masked_fill(~torch.tril(causal, -1).view(1, n, n), 0.0)     # strictly lower
        eye = torch.eye(n, device=q.device).expand(h, n, n)
        rhs = bh.unsqueeze(-1) * (vh - torch.einsum("hck,hkv->hcv", kh * eg, state))
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)   # [H, C, V]
        m = torch.einsum("hik,hjk,hijk->hij", qh, kh, decay)            # tril incl. diag via decay
        o = torch.einsum("hck,hkv->hcv", qh * eg, state) + torch.einsum("hij,hjv->hiv", m, u)
        out[c0:c0 + n] = o.permute(1, 0, 2)
        tail = torch.exp(gam[-1].unsqueeze(0) - gam).permute(1, 0, 2)  # e^(Γ_C - Γ_j) [H, C, K]
        state = torch.exp(gam[-1]).unsqueeze(-1) * state + torch.einsum("hck,hcv->hkv", kh * tail, u)
    return out, state


def kda_chunk_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """The KDA recurrence in chunked form, plain torch (no kernel compile), fp32.

    Same arguments and result as kernels.kda.recurrent.kda_recurrent_batched. Inside a chunk of C tokens, with
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
