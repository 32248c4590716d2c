"""FFNs: the dense GLU of the first layers, and the MoE (K3 latent MoE / Kimi Linear MoE).

Shape letters: T tokens, D hidden, E experts, L latent width (K3), M expert width.

Router (fp32): s = sigmoid(x @ Wgate^T); idx = topk(s + correction_bias); the bias
affects the selection only; w = s[idx] / (sum + 1e-20) * routed_scaling_factor.
Experts run one at a time in ascending index and each row accumulates its experts in
that order, so a row's bits do not depend on which other rows share the call.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import K3Config
from . import ops
from .ops import OPS, rms_norm, sigmoid, situ, swiglu


class GLU(nn.Module):
    """gate_proj / up_proj / down_proj, with SiTU (K3) or SiLU (Kimi Linear)."""

    def __init__(self, cfg: K3Config, d_in: int, width: int, names: tuple[str, str, str] =
                 ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.cfg = cfg
        self._names = names
        setattr(self, names[0], nn.Linear(d_in, width, bias=False))
        setattr(self, names[1], nn.Linear(d_in, width, bias=False))
        setattr(self, names[2], nn.Linear(width, d_in, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lin, cfg = OPS.linear, self.cfg
        gate = lin(x, getattr(self, self._names[0]).weight)
        up = lin(x, getattr(self, self._names[1]).weight)
        if cfg.activation == "situ":
            act = situ(gate, up, cfg.situ_beta, cfg.situ_linear_beta)
        else:
            act = swiglu(gate, up)
        return lin(act, getattr(self, self._names[2]).weight)


class Router(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (expert ids [T, k] int64, weights [T, k] fp32)."""
        cfg = self.cfg
        scores = sigmoid(OPS.linear(x.float(), self.weight.float()))            # [T, E]
        biased = scores + self.e_score_correction_bias.float()
        _, idx = torch.topk(biased, cfg.num_experts_per_token, dim=-1)             # selection only
        w = scores.gather(-1, idx)
        if cfg.moe_renormalize:
            w = w / (ops.row_sum(w) + 1e-20)
        return idx, w * cfg.routed_scaling_factor


class MoE(nn.Module):
    """block_sparse_moe: router, routed experts (in the latent width for K3), shared experts."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        d = cfg.hidden_size
        latent = cfg.routed_expert_hidden_size
        d_expert = latent if latent is not None else d
        self.experts = nn.ModuleList(
            GLU(cfg, d_expert, cfg.moe_intermediate_size, ("w1", "w3", "w2"))
            for _ in range(cfg.num_experts))
        if latent is not None:
            self.routed_expert_down_proj = nn.Linear(d, latent, bias=False)
            self.routed_expert_norm = nn.Module()
            self.routed_expert_norm.weight = nn.Parameter(torch.ones(latent))
            self.routed_expert_up_proj = nn.Linear(latent, d, bias=False)
        if cfg.num_shared_experts:
            self.shared_experts = GLU(cfg, d, cfg.num_shared_experts * cfg.moe_intermediate_size)

    def routed(self, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Weighted sum of the selected experts per row. h [T, De] -> [T, De] fp32."""
        y = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        for e, expert in enumerate(self.experts):            # ascending expert index
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            out = expert(h[rows]).float()                     # [n, De]
            y[rows] = y[rows] + w[rows, slot].unsqueeze(-1) * out
        return y

    def routed_part(self, x: torch.Tensor) -> torch.Tensor:
        """Router, routed experts and (K3) the latent down/up projections. x [T, D] -> [T, D]."""
        cfg, lin = self.cfg, OPS.linear
        idx, w = OPS.moe_route(self.gate, x) if OPS.moe_route is not None else self.gate(x)
        experts = OPS.moe_experts or MoE.routed
        if cfg.routed_expert_hidden_size is not None:
            h = lin(x, self.routed_expert_down_proj.weight)                     # [T, L]
            y = experts(self, h, idx, w).to(x.dtype)
            return lin(rms_norm(y, self.routed_expert_norm.weight, cfg.rms_norm_eps),
                       self.routed_expert_up_proj.weight)
        return experts(self, x, idx, w).to(x.dtype)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        """The reference order: routed part, then the shared experts, then the add."""
        y = self.routed_part(x)
        if self.cfg.num_shared_experts:
            y = y + self.shared_experts(x)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (OPS.moe_block or MoE.block)(self, x)
