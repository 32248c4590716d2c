"""MLA (multi-head latent attention), decompressed, NoPE, K3 output gate.

Shape letters: T new tokens, S cached tokens (incl. new), H heads, R cache row width
(kv_lora + rope), C = nope + rope (qk head dim), Vd = v_head_dim, D hidden.

The cache holds one row per token, [normalised latent | k_rope]; with NoPE a row does
not depend on its position, which is what makes prefix reuse exact-able.

Attention is computed in fixed key blocks of 64 with an online softmax in block order:
every reduction has a fixed length (C for scores, 64 for row sums and P·V), and a key
block is either processed identically or skipped, so one query's bits are the same
whether it sits in a whole-prompt prefill or a one-token decode step.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import K3Config
from . import ops
from .ops import OPS, exp, rms_norm, sigmoid

KEY_BLOCK = 64      # keys per block in the blocked softmax
QUERY_TILE = 64     # queries per tile (memory only; queries are independent)


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal softmax attention, row-stable. q [T, H, C], k [S, H, C], v [S, H, Vd],
    q_pos [T] absolute positions (query t sees keys 0..q_pos[t]). Returns [T, H, Vd] fp32.
    On CUDA: the same blocks in one Triton kernel (kernels/mla/attention.py)."""
    if q.is_cuda and not ops.gpu_reference().needs_autograd(q, k, v):
        return ops.gpu_reference().attention(q, k, v, q_pos, scale)
    t_len, h, _ = q.shape
    s_len, vd = k.shape[0], v.shape[-1]
    n_blocks = -(-s_len // KEY_BLOCK)
    pad = n_blocks * KEY_BLOCK - s_len
    q, k, v = q.float(), k.float(), v.float()
    if pad:
        k = torch.cat([k, k.new_zeros(pad, h, k.shape[-1])])
        v = torch.cat([v, v.new_zeros(pad, h, vd)])
    kb = k.view(n_blocks, KEY_BLOCK, h, -1).permute(0, 2, 1, 3)          # [nb, H, 64, C]
    vb = v.view(n_blocks, KEY_BLOCK, h, vd).permute(0, 2, 3, 1)          # [nb, H, Vd, 64]
    out = torch.empty(t_len, h, vd, dtype=torch.float32, device=q.device)
    key_idx = torch.arange(KEY_BLOCK, device=q.device)
    for q0 in range(0, t_len, QUERY_TILE):
        qt = q[q0:q0 + QUERY_TILE]                                       # [t, H, C]
        pos = q_pos[q0:q0 + QUERY_TILE]
        m = torch.full((qt.shape[0], h, 1), float("-inf"), device=q.device)
        l = torch.zeros(qt.shape[0], h, 1, device=q.device)
        acc = torch.zeros(qt.shape[0], h, vd, device=q.device)
        last_block = int(pos.max()) // KEY_BLOCK
        for j in range(last_block + 1):
            s = (qt.unsqueeze(2) * kb[j].unsqueeze(0)).sum(-1) * scale    # [t, H, 64]
            visible = (j * KEY_BLOCK + key_idx).view(1, 1, -1) <= pos.view(-1, 1, 1)
            s = s.masked_fill(~visible, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            # A block fully masked for a query leaves its m, l, acc bit-identical
            # (x*1 + 0), which is what makes skipping it elsewhere exact.
            alpha = exp(m - m_new)
            p = exp(s - m_new)                                      # [t, H, 64]
            l = l * alpha + p.sum(-1, keepdim=True)
            pv = (p.unsqueeze(2) * vb[j].unsqueeze(0)).sum(-1)            # [t, H, Vd]
            acc = acc * alpha + pv
            m = m_new
        out[q0:q0 + QUERY_TILE] = acc / l
    return out


class MLAttention(nn.Module):
    """One MLA mixer layer; parameter names are the HF checkpoint names."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.cfg = cfg
        d, h = cfg.hidden_size, cfg.num_heads
        c = cfg.qk_head_dim
        if cfg.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.Module()
            self.q_a_layernorm.weight = nn.Parameter(torch.ones(cfg.q_lora_rank))
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * c, bias=False)
        else:
            self.q_proj = nn.Linear(d, h * c, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.mla_cache_width, bias=False)
        self.kv_a_layernorm = nn.Module()
        self.kv_a_layernorm.weight = nn.Parameter(torch.ones(cfg.kv_lora_rank))
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                   bias=False)
        if cfg.mla_output_gate:
            self.g_proj = nn.Linear(d, h * cfg.v_head_dim, bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=False)

    def new_state(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(0, self.cfg.mla_cache_width, device=device)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> q [T, H, C]."""
        cfg, lin = self.cfg, OPS.linear
        if cfg.q_lora_rank is not None:
            qa = rms_norm(lin(x, self.q_a_proj.weight), self.q_a_layernorm.weight, cfg.lora_eps)
            q = lin(qa, self.q_b_proj.weight)
        else:
            q = lin(x, self.q_proj.weight)
        return q.view(x.shape[0], cfg.num_heads, cfg.qk_head_dim)

    def cache_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> cache rows [T, R] = [rmsnorm(latent) | k_rope]."""
        cfg = self.cfg
        c = OPS.linear(x, self.kv_a_proj_with_mqa.weight)
        lat = rms_norm(c[:, :cfg.kv_lora_rank], self.kv_a_layernorm.weight, cfg.lora_eps)
        return torch.cat([lat, c[:, cfg.kv_lora_rank:]], -1)

    def decompress(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows [S, R] -> keys [S, H, C] (k_nope | shared k_rope) and values [S, H, Vd]."""
        cfg = self.cfg
        h, nope = cfg.num_heads, cfg.qk_nope_head_dim
        kv = OPS.linear(rows[:, :cfg.kv_lora_rank], self.kv_b_proj.weight)
        kv = kv.view(rows.shape[0], h, nope + cfg.v_head_dim)
        k_rope = rows[:, cfg.kv_lora_rank:].unsqueeze(1).expand(-1, h, -1)
        return torch.cat([kv[..., :nope], k_rope], -1), kv[..., nope:]

    @staticmethod
    def _over_rows(t_len: int):
        """The op-table slot that owns attention over cache rows for a call of t_len queries."""
        return OPS.mla_decode if t_len == 1 else OPS.mla_prefill

    def attend(self, q: torch.Tensor, rows: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """q [T, H, C] over cache rows [S, R] -> [T, H, Vd] fp32 (the decompressed reference)."""
        fast = self._over_rows(q.shape[0])
        if fast is not None:
            return fast(self, q, rows, q_pos)
        k, v = self.decompress(rows)
        attn = OPS.attention or blocked_attention
        return attn(q, k, v, q_pos, self.cfg.qk_head_dim ** -0.5)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] new tokens, cache [S0, R] rows so far -> (out [T, D], cache [S0+T, R])."""
        cfg, lin = self.cfg, OPS.linear
        start = cache.shape[0]
        rows = torch.cat([cache, self.cache_rows(x).to(cache.dtype)], 0)
        q_pos = torch.arange(start, start + x.shape[0], device=x.device)
        o = self.attend(self.queries(x), rows, q_pos)                     # [T, H, Vd]
        if cfg.mla_output_gate:
            o = o * sigmoid(lin(x, self.g_proj.weight).float()).view_as(o)
        return lin(o.reshape(x.shape[0], -1).to(x.dtype), self.o_proj.weight), rows

    # ---- projected K/V cache (engine option projected_kv_cache) ------------------------
    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """Cache rows [S, R] -> kv_b_proj output [S, H*(nope+Vd)]: the op `decompress` runs,
        so by row-stability a row projected once and kept equals a row re-projected later."""
        return OPS.linear(rows[:, :self.cfg.kv_lora_rank], self.kv_b_proj.weight)

    def forward_projected(self, x: torch.Tensor, cache: torch.Tensor, kv: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward` that keeps the projected K/V: kv [S', H*(nope+Vd)] covers the first
        S' rows of cache (None: none); the other rows are projected here. Returns
        (out [T, D], cache [S0+T, R], kv [S0+T, H*(nope+Vd)]). Same ops as `forward`."""
        cfg, lin = self.cfg, OPS.linear
        h, nope = cfg.num_heads, cfg.qk_nope_head_dim
        start = cache.shape[0]
        rows = torch.cat([cache, self.cache_rows(x).to(cache.dtype)], 0)
        have = 0 if kv is None else kv.shape[0]
        new_kv = self.project(rows[have:])
        kv = new_kv if kv is None else torch.cat([kv.to(new_kv.dtype), new_kv], 0)
        q_pos = torch.arange(start, start + x.shape[0], device=x.device)
        q = self.queries(x)
        fast = self._over_rows(q.shape[0])
        if fast is not None:                    # a kernel toggle owns attention: give it rows
            o = fast(self, q, rows, q_pos)
        else:
            kv3 = kv.view(rows.shape[0], h, nope + cfg.v_head_dim)
            k_rope = rows[:, cfg.kv_lora_rank:].unsqueeze(1).expand(-1, h, -1)
            k, v = torch.cat([kv3[..., :nope], k_rope], -1), kv3[..., nope:]
            attn = OPS.attention or blocked_attention
            o = attn(q, k, v, q_pos, cfg.qk_head_dim ** -0.5)
        if cfg.mla_output_gate:
            o = o * sigmoid(lin(x, self.g_proj.weight).float()).view_as(o)
        return lin(o.reshape(x.shape[0], -1).to(x.dtype), self.o_proj.weight), rows, kv
