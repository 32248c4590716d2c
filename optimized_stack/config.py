"""K3Config: one dataclass for the model shape, read from HF-style config.json.

Accepts the Kimi / K3 checkpoint spellings, transformers' KimiLinearConfig spellings and
the K3 multimodal wrapper (the same fields nested under `text_config`); which keys mean
what, their types and how conflicts are settled live in hf_config.py.

Everything is validated on construction; a bad field fails with one line naming the
field, what was expected and what arrived. Values are range-checked, not only typed: a
config that parses but describes a broken model (rms_norm_eps 1e999 is inf in JSON, a
routed scaling of -1e30, a -inf gate bound) loaded before, and every check downstream
then compared one broken output with another (KL 0, a pass; generate printed NUL bytes).
Size bounds are far above any released Kimi / K3 shape (K3: hidden 7168, vocab 163,840)
and only keep arithmetic sane; what a machine can hold is the memory estimate's job
(check_fits_in_memory, before from_file's caller allocates a parameter).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import hf_config as hf
from . import safe_load
from .errors import ConfigError
from .hf_config import KDA, MLA, is_int

@dataclass(frozen=True)
class K3Config:
    """Shape and numerics of a K3 / Kimi Linear text model. Layer indices are 0-indexed."""

    variant: str                      # "k3" (safe gate, AttnRes, latent MoE) or "kimi_linear"
    vocab_size: int
    hidden_size: int                  # D
    num_layers: int
    layer_kinds: tuple[str, ...]      # per layer, "kda" or "mla"
    # KDA
    kda_num_heads: int                # H
    kda_head_dim: int                 # K = V
    kda_conv_size: int = 4
    kda_gate_lower_bound: float = -5.0   # K3 safe gate: g = lb * sigmoid(...)
    kda_full_rank_gate: bool = True      # K3 g_proj D->H*K; Kimi Linear g_a/g_b low rank
    # MLA
    num_heads: int = 4
    q_lora_rank: int | None = 32      # None: plain q_proj (Kimi Linear)
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8         # never rotated (NoPE); only a width
    v_head_dim: int = 16
    mla_output_gate: bool = True
    # FFN / MoE
    first_k_dense_replace: int = 1
    intermediate_size: int = 64       # dense FFN width
    num_experts: int = 8              # E
    num_experts_per_token: int = 2
    num_shared_experts: int = 2
    moe_intermediate_size: int = 32   # expert width
    routed_expert_hidden_size: int | None = 64   # latent width (K3); None: no latent
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    activation: str = "situ"          # "situ" (K3) or "silu" (SwiGLU, Kimi Linear)
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # residual
    attn_res_block_size: int | None = 4   # None: plain residual stream (Kimi Linear)
    # numerics
    rms_norm_eps: float = 1e-5
    lora_norm_eps: float | None = None    # None: rms_norm_eps (see k3-architecture.md)
    # tokens
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        _check(self.variant in ("k3", "kimi_linear"), "variant", "'k3' or 'kimi_linear'", self.variant)
        for name in ("vocab_size", "hidden_size", "num_layers", "kda_num_heads", "kda_head_dim",
                     "num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                     "intermediate_size", "moe_intermediate_size", "kda_conv_size"):
            value = getattr(self, name)
            _check(is_int(value) and value > 0, name, "a positive integer", value)
        _check(is_int(self.qk_rope_head_dim) and self.qk_rope_head_dim >= 0,
               "qk_rope_head_dim", "an integer >= 0", self.qk_rope_head_dim)
        _check(len(self.layer_kinds) == self.num_layers, "layer_kinds",
               f"{self.num_layers} entries (num_hidden_layers)", len(self.layer_kinds))
        bad = [k for k in self.layer_kinds if k not in (KDA, MLA)]
        _check(not bad, "layer_kinds", "only 'kda' or 'mla'", bad[:1])
        _check(0 <= self.first_k_dense_replace <= self.num_layers, "first_k_dense_replace",
               f"0..{self.num_layers}", self.first_k_dense_replace)
        if self.num_layers > self.first_k_dense_replace:
            _check(self.num_experts > 0, "num_experts", "> 0 when MoE layers exist", self.num_experts)
            _check(0 < self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
                   f"1..{self.num_experts} (num_experts)", self.num_experts_per_token)
        _check(self.activation in ("situ", "silu"), "activation", "'situ' or 'silu'", self.activation)
        _check(self.kda_gate_lower_bound < 0, "gate_lower_bound", "a negative float", self.kda_gate_lower_bound)
        if self.attn_res_block_size is not None:
            _check(self.attn_res_block_size > 0, "attn_res_block_size", "a positive integer or null",
                   self.attn_res_block_size)
        if self.q_lora_rank is not None:
            _check(self.q_lora_rank > 0, "q_lora_rank", "a positive integer or null", self.q_lora_rank)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            _check(0 <= value < self.vocab_size, name, f"0..{self.vocab_size - 1}", value)
        _check_ranges(self)

    # ---- derived shapes -------------------------------------------------------------
    @property
    def kda_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == KDA]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == MLA]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Width of one MLA cache row: [normalised latent | k_rope] (K3: 512 + 64 = 576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def lora_eps(self) -> float:
        return self.rms_norm_eps if self.lora_norm_eps is None else self.lora_norm_eps

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def layer_map(self) -> str:
        """'KKKM KKKM': one letter per layer, a space every 4 layers."""
        letters = "".join("K" if k == KDA else "M" for k in self.layer_kinds)
        return " ".join(letters[i:i + 4] for i in range(0, len(letters), 4))

    # ---- HF config.json ---------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "K3Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"config.json not found: expected a file at {path}")
        try:
            data = safe_load.read_json(path, error=ConfigError)   # bounded: depth, int size, UTF-8
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        cfg = cls.from_hf(data)
        cfg.check_fits_in_memory()          # every caller builds a model from it next
        return cfg

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> "K3Config":
        if not isinstance(data, dict):
            raise ConfigError(f"config: expected a JSON object, got {type(data).__name__}")
        if isinstance(data.get("text_config"), dict):       # KimiK3ForConditionalGeneration
            data = {**data["text_config"], **{k: v for k, v in data.items() if k == "architectures"}}
        return _from_hf(data)

    def to_hf(self) -> dict[str, Any]:
        """The original (K3 release) spelling: 1-indexed layer lists in linear_attn_config."""
        kda = [i + 1 for i in self.kda_layers]
        mla = [i + 1 for i in self.mla_layers]
        out: dict[str, Any] = {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "k3_variant": self.variant,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "linear_attn_config": {
                "kda_layers": kda, "full_attn_layers": mla, "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim, "short_conv_kernel_size": self.kda_conv_size,
                "gate_lower_bound": self.kda_gate_lower_bound,
                "use_full_rank_gate": self.kda_full_rank_gate,
            },
            "num_attention_heads": self.num_heads, "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
            "mla_use_nope": True, "mla_use_output_gate": self.mla_output_gate,
            "first_k_dense_replace": self.first_k_dense_replace,
            "intermediate_size": self.intermediate_size, "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
            "routed_scaling_factor": self.routed_scaling_factor,
            "moe_renormalize": self.moe_renormalize, "hidden_act": self.activation,
            "activation_situ_beta": self.situ_beta,
            "activation_situ_linear_beta": self.situ_linear_beta,
            "attn_res_block_size": self.attn_res_block_size, "rms_norm_eps": self.rms_norm_eps,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id, "tie_word_embeddings": False,
        }
        if self.lora_norm_eps is not None:
            out["lora_norm_eps"] = self.lora_norm_eps
        return out

    def replace(self, **changes: Any) -> "K3Config":
        return dataclasses.replace(self, **changes)

    # ---- memory ----------------------------------------------------------------------------
    def parameter_count(self) -> int:
        """Parameters of K3Model(self), counted from the shapes (model/*.py), without building it."""
        d, v = self.hidden_size, self.vocab_size
        h, kd = self.kda_num_heads, self.kda_head_dim
        hk = h * kd
        kda = (3 * d * hk + 3 * hk * self.kda_conv_size + d * kd + kd * hk + max(h, kd) + hk + d * h
               + (d * hk if self.kda_full_rank_gate else d * kd + kd * hk) + kd + hk * d)
        qh = self.qk_head_dim * self.num_heads
        q = d * qh if self.q_lora_rank is None else d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * qh
        vh = self.num_heads * self.v_head_dim
        mla = (q + d * self.mla_cache_width + self.kv_lora_rank
               + self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
               + (d * vh if self.mla_output_gate else 0) + vh * d)
        dense = 3 * d * self.intermediate_size
        latent = self.routed_expert_hidden_size
        moe = (self.num_experts * (d + 1) + self.num_experts * 3 * (latent or d) * self.moe_intermediate_size
               + (2 * d * latent + latent if latent is not None else 0)
               + 3 * d * self.num_shared_experts * self.moe_intermediate_size)
        res = 4 * d if self.attn_res_block_size is not None else 0    # two read-param pairs per layer
        layers = sum(2 * d + (kda if kind == KDA else mla) + (moe if self.is_moe_layer(i) else dense) + res
                     for i, kind in enumerate(self.layer_kinds))
        return 2 * v * d + layers + d + (2 * d if self.attn_res_block_size is not None else 0)

    def check_fits_in_memory(self, bytes_per_parameter: int = 4, available: int | None = None) -> None:
        """Refuse, before anything is allocated, a model whose parameters alone (float32 as built)
        exceed the memory available now; ConfigError names the estimate."""
        need = self.parameter_count() * bytes_per_parameter
        have, source = available_memory() if available is None else (available, "given")
        if need > have:
            raise ConfigError(f"config: the model's parameters need about {_bytes(need)} ({self.parameter_count():,} "
                              f"parameters x {bytes_per_parameter} bytes), more than the {_bytes(have)} of memory "
                              f"available ({source}); refused before allocating")


def _check(ok: bool, name: str, expected: str, got: Any) -> None:
    if not ok:
        raise ConfigError(f"config field '{name}': expected {expected}, got {got!r}")


# field -> the largest value accepted (the smallest is 1; qk_rope_head_dim and num_experts /
# num_shared_experts may be 0). Each is >= 8x the largest released Kimi / K3 / DeepSeek shape.
SIZE_LIMITS: dict[str, int] = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 16, "num_layers": 1024, "kda_num_heads": 1024,
    "kda_head_dim": 4096, "kda_conv_size": 64, "num_heads": 1024, "q_lora_rank": 1 << 16,
    "kv_lora_rank": 1 << 16, "qk_nope_head_dim": 4096, "qk_rope_head_dim": 4096, "v_head_dim": 4096,
    "intermediate_size": 1 << 20, "num_experts": 4096, "num_shared_experts": 4096,
    "moe_intermediate_size": 1 << 20, "routed_expert_hidden_size": 1 << 16, "attn_res_block_size": 1024,
}
MAX_EPS = 0.1              # an rms-norm eps is 1e-5 / 1e-6; at 0.1 it already rescales the activations
MAX_ROUTED_SCALING = 1e3   # released models use 1 to 2.5; 1e30 overflows float32 outputs


def _check_ranges(cfg: K3Config) -> None:
    for name, limit in SIZE_LIMITS.items():
        value = getattr(cfg, name)
        if value is None and name in ("q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size"):
            continue
        low = 0 if name in ("qk_rope_head_dim", "num_experts", "num_shared_experts") else 1
        _check(is_int(value) and low <= value <= limit, name, f"an integer in {low}..{limit:,}", value)
    for name in ("kda_gate_lower_bound", "routed_scaling_factor", "situ_beta", "situ_linear_beta",
                 "rms_norm_eps", "lora_norm_eps"):
        value = getattr(cfg, name)
        if value is None and name == "lora_norm_eps":
            continue
        shown = "gate_lower_bound" if name == "kda_gate_lower_bound" else name    # its config.json key
        _check(_is_real(value) and math.isfinite(value), shown, "a finite number", value)
    for name in ("rms_norm_eps", "lora_norm_eps"):
        value = getattr(cfg, name)
        if value is not None:
            _check(0 < value <= MAX_EPS, name, f"a small positive epsilon, 0 < eps <= {MAX_EPS}", value)
    _check(0 < cfg.routed_scaling_factor <= MAX_ROUTED_SCALING, "routed_scaling_factor",
           f"a positive number <= {MAX_ROUTED_SCALING:g}", cfg.routed_scaling_factor)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def available_memory() -> tuple[int, str]:
    """(bytes, where the number came from): MemAvailable (free + reclaimable now) where Linux
    reports it, else the machine's physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory"


def _bytes(n: int) -> str:
    for unit, size in (("EiB", 1 << 60), ("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def _from_hf(data: dict[str, Any]) -> K3Config:
    flat = hf.flatten(data)                    # unknown keys and wrong types stop here
    hf.check_architectures(flat)
    num_layers = hf.get(flat, "num_hidden_layers")
    _check(num_layers > 0, "num_hidden_layers", "a positive integer", num_layers)
    is_k3 = (flat.get("k3_variant") == "k3" or "attn_res_block_size" in flat
             or flat.get("hidden_act") == "situ" or "routed_expert_hidden_size" in flat)
    _check(flat.get("k3_variant", "k3") in ("k3", "kimi_linear"), "k3_variant", "'k3' or 'kimi_linear'",
           flat.get("k3_variant"))
    if flat.get("k3_variant") == "kimi_linear":
        is_k3 = False
    variant = "k3" if is_k3 else "kimi_linear"

    if flat.get("tie_word_embeddings", False):
        raise ConfigError("config field 'tie_word_embeddings': expected false (K3 has an untied "
                          "lm_head), got true")
    if flat.get("attention_bias", False):
        raise ConfigError("config field 'attention_bias': expected false (no MLA projection "
                          "biases), got true")
    _check(flat.get("mla_use_nope", True), "mla_use_nope", "true (no rotary embedding is implemented)",
           flat.get("mla_use_nope"))
    groups = hf.get(flat, "num_expert_group", 1) or 1
    _check(groups == 1, "num_expert_group", "1 (grouped routing is not implemented)", groups)
    heads = hf.get(flat, "num_attention_heads")
    kv_heads = flat.get("num_key_value_heads")
    # MLA's K/V come out of kv_b_proj per query head; transformers' repeat_kv would break on any
    # other count, so this is not a GQA knob here.
    _check(kv_heads in (None, heads), "num_key_value_heads", f"{heads} (num_attention_heads) or null", kv_heads)

    kinds = hf.layer_kinds(flat, num_layers)
    first_dense = hf.first_k_dense(flat, num_layers)
    has_moe = num_layers > first_dense

    def moe(field: str, default: Any) -> Any:    # required only where MoE layers exist
        return hf.get(flat, field) if has_moe else hf.get(flat, field, default)

    act = flat.get("hidden_act", "situ" if is_k3 else "silu")
    act = {"swiglu": "silu"}.get(act, act)
    eos = flat.get("eos_token_id")
    kw: dict[str, Any] = dict(
        variant=variant,
        vocab_size=hf.get(flat, "vocab_size"),
        hidden_size=hf.get(flat, "hidden_size"),
        num_layers=num_layers,
        layer_kinds=kinds,
        kda_num_heads=hf.get(flat, "kda_num_heads"),
        kda_head_dim=hf.get(flat, "kda_head_dim"),
        kda_conv_size=hf.get(flat, "kda_conv_size", 4),
        kda_gate_lower_bound=float(hf.get(flat, "kda_gate_lower_bound", -5.0)),
        kda_full_rank_gate=hf.get(flat, "kda_full_rank_gate", is_k3),
        num_heads=heads,
        q_lora_rank=flat.get("q_lora_rank"),
        kv_lora_rank=hf.get(flat, "kv_lora_rank"),
        qk_nope_head_dim=hf.get(flat, "qk_nope_head_dim"),
        qk_rope_head_dim=hf.get(flat, "qk_rope_head_dim"),
        v_head_dim=hf.get(flat, "v_head_dim"),
        mla_output_gate=flat.get("mla_use_output_gate", is_k3),
        first_k_dense_replace=first_dense,
        intermediate_size=hf.get(flat, "intermediate_size"),
        num_experts=moe("num_experts", 0),
        num_experts_per_token=moe("num_experts_per_token", 1),
        num_shared_experts=moe("num_shared_experts", 0),
        moe_intermediate_size=moe("moe_intermediate_size", hf.get(flat, "intermediate_size")),
        routed_expert_hidden_size=flat.get("routed_expert_hidden_size"),
        routed_scaling_factor=float(moe("routed_scaling_factor", 1.0)),
        moe_renormalize=hf.get(flat, "moe_renormalize", True),
        activation=act,
        situ_beta=float(flat.get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(flat.get("activation_situ_linear_beta", 25.0)),
        attn_res_block_size=flat.get("attn_res_block_size") if is_k3 else None,
        rms_norm_eps=float(flat.get("rms_norm_eps", 1e-5)),
        # Kimi Linear's HF code builds the MLA LoRA norms with the hard-coded 1e-6; the K3
        # port uses rms_norm_eps (k3-architecture.md: unconfirmed which K3 expects).
        lora_norm_eps=flat.get("lora_norm_eps", None if is_k3 else 1e-6),
        # null ids mean "none given" in HF configs; a list of eos ids stops on the first
        bos_token_id=_or(flat.get("bos_token_id"), 1),
        eos_token_id=_or(eos[0] if isinstance(eos, list) else eos, 2),
        pad_token_id=_or(flat.get("pad_token_id"), 0),
    )
    return K3Config(**kw)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value
