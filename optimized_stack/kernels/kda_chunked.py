"""Chunked KDA (the UT / WY form): one triangular solve and one state update per chunk.

Same signature as the reference `kda_recurrent`. Equal to the recurrence only to
rounding (about 1e-6 relative in fp32), never bit for bit: it is an `approx` toggle.

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
