"""K3Config: one dataclass for the model shape, read from HF-style config.json.

Accepts the three spellings seen in the wild:
- K3 / Kimi Linear originals: `linear_attn_config` with 1-INDEXED `kda_layers` and
  `full_attn_layers`, `num_experts`, `num_experts_per_token` ...
- transformers' Kimi Linear: `layer_types` (0-indexed list of "linear_attention" /
  "full_attention"), `linear_num_heads`, `linear_head_dim`, `num_experts_per_tok` ...
- K3 multimodal wrapper: the same fields nested under `text_config`.

Everything is validated on construction; a bad field fails with one line naming the
field, what was expected and what arrived.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

KDA, MLA = "kda", "mla"

# HF keys we read but that do not change the forward pass (NoPE model, no rotary;
# generation/runtime flags). Listed so that genuinely unknown keys can be rejected.
_IGNORED_HF_KEYS = {
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype",
    "initializer_range", "max_position_embeddings", "rope_theta", "rope_parameters",
    "rope_scaling", "use_cache", "num_nextn_predict_layers", "topk_method", "use_grouped_topk",
    "moe_layer_freq", "tie_word_embeddings", "_name_or_path", "num_key_value_heads",
    "hidden_act", "attention_dropout", "attention_bias", "output_attentions",
    "output_hidden_states", "return_dict", "pretraining_tp", "quantization_config",
    "use_return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
    "label2id", "problem_type", "tokenizer_class", "bos_token_id", "eos_token_id",
    "pad_token_id", "vision_config", "text_config", "media_placeholder_token_id",
    "model_max_length", "mla_use_nope", "moe_router_activation_func", "moe_renormalize",
    "latent_moe_use_norm", "head_dim", "linear_attn_config", "layer_types",
    # transformers' KimiLinearConfig writes these; they restate other fields
    "mlp_layer_types", "output_router_logits", "qk_head_dim", "router_aux_loss_coef",
}


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
            _check(isinstance(value, int) and value > 0, name, "a positive integer", value)
        _check(isinstance(self.qk_rope_head_dim, int) and self.qk_rope_head_dim >= 0,
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
        _check(self.rms_norm_eps > 0, "rms_norm_eps", "> 0", self.rms_norm_eps)

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
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_hf(data)

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


def _check(ok: bool, name: str, expected: str, got: Any) -> None:
    if not ok:
        raise ConfigError(f"config field '{name}': expected {expected}, got {got!r}")


# HF spellings -> our field names (first present wins).
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_experts", "n_routed_experts"),
    "num_experts_per_token": ("num_experts_per_token", "num_experts_per_tok"),
    "num_shared_experts": ("num_shared_experts", "n_shared_experts"),
}
_KNOWN_EXTRA = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_output_gate",
    "first_k_dense_replace", "intermediate_size", "moe_intermediate_size",
    "routed_expert_hidden_size", "routed_scaling_factor", "activation_situ_beta",
    "activation_situ_linear_beta", "attn_res_block_size", "rms_norm_eps", "lora_norm_eps",
    "k3_variant", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
    "linear_short_conv_kernel_size", "num_expert_group", "topk_group", "n_group",
    "linear_gate_lower_bound", "linear_use_full_rank_gate", "norm_topk_prob",
} | {a for names in _ALIASES.values() for a in names}


def _get(data: dict[str, Any], key: str, default: Any = ...) -> Any:
    for name in _ALIASES.get(key, (key,)):
        if name in data:
            return data[name]
    if default is ...:
        raise ConfigError(f"config field '{key}': expected a value, got nothing (field missing)")
    return default


def _layer_kinds(data: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    lac = data.get("linear_attn_config")
    if isinstance(lac, dict) and ("kda_layers" in lac or "full_attn_layers" in lac):
        full = lac.get("full_attn_layers", [])
        kda = lac.get("kda_layers", [])
        for name, layers in (("full_attn_layers", full), ("kda_layers", kda)):
            bad = [i for i in layers if not isinstance(i, int) or not 1 <= i <= num_layers]
            _check(not bad, f"linear_attn_config.{name}",
                   f"1-indexed layer numbers in 1..{num_layers}", bad[:3])
        overlap = sorted(set(full) & set(kda))
        _check(not overlap, "linear_attn_config", "disjoint kda_layers and full_attn_layers", overlap)
        missing = sorted(set(range(1, num_layers + 1)) - set(full) - set(kda))
        _check(not missing, "linear_attn_config", "every layer in kda_layers or full_attn_layers",
               f"layers {missing[:5]} in neither")
        return tuple(MLA if i + 1 in set(full) else KDA for i in range(num_layers))
    if "layer_types" in data:
        types = data["layer_types"]
        _check(isinstance(types, list) and len(types) == num_layers, "layer_types",
               f"a list of {num_layers} layer types", types if not isinstance(types, list) else len(types))
        mapping = {"linear_attention": KDA, "kda": KDA, "full_attention": MLA, "mla": MLA}
        bad = [t for t in types if t not in mapping]
        _check(not bad, "layer_types", "'linear_attention' or 'full_attention'", bad[:1])
        return tuple(mapping[t] for t in types)
    raise ConfigError("config field 'linear_attn_config': expected kda_layers/full_attn_layers "
                      "or a 'layer_types' list, got neither")


def _from_hf(data: dict[str, Any]) -> K3Config:
    num_layers = _get(data, "num_hidden_layers")
    _check(isinstance(num_layers, int) and num_layers > 0, "num_hidden_layers", "a positive integer", num_layers)
    lac = data.get("linear_attn_config") if isinstance(data.get("linear_attn_config"), dict) else {}
    is_k3 = (data.get("k3_variant") == "k3" or "attn_res_block_size" in data
             or data.get("hidden_act") == "situ" or "routed_expert_hidden_size" in data)
    if data.get("k3_variant") == "kimi_linear":
        is_k3 = False
    variant = "k3" if is_k3 else "kimi_linear"

    unknown = sorted(set(data) - _IGNORED_HF_KEYS - _KNOWN_EXTRA)
    if unknown:
        raise ConfigError(f"config field '{unknown[0]}': expected a known K3/Kimi Linear field, "
                          f"got an unknown key ({len(unknown)} unknown: {', '.join(unknown[:5])})")
    if _get(data, "tie_word_embeddings", False):
        raise ConfigError("config field 'tie_word_embeddings': expected false (K3 has an untied "
                          "lm_head), got true")
    groups = data.get("num_expert_group", data.get("n_group", 1)) or 1
    _check(groups == 1, "num_expert_group", "1 (grouped routing is not implemented)", groups)

    act = data.get("hidden_act", "situ" if is_k3 else "silu")
    act = {"swiglu": "silu"}.get(act, act)
    head_dim = lac.get("head_dim", data.get("linear_head_dim", data.get("head_dim")))
    kw: dict[str, Any] = dict(
        variant=variant,
        vocab_size=_get(data, "vocab_size"),
        hidden_size=_get(data, "hidden_size"),
        num_layers=num_layers,
        layer_kinds=_layer_kinds(data, num_layers),
        kda_num_heads=lac.get("num_heads", data.get("linear_num_heads", _get(data, "num_attention_heads"))),
        kda_head_dim=head_dim,
        kda_conv_size=lac.get("short_conv_kernel_size",
                              data.get("linear_conv_kernel_dim", data.get("linear_short_conv_kernel_size", 4))),
        kda_gate_lower_bound=lac.get("gate_lower_bound", data.get("linear_gate_lower_bound", -5.0)),
        kda_full_rank_gate=lac.get("use_full_rank_gate", data.get("linear_use_full_rank_gate", is_k3)),
        num_heads=_get(data, "num_attention_heads"),
        q_lora_rank=data.get("q_lora_rank"),
        kv_lora_rank=_get(data, "kv_lora_rank"),
        qk_nope_head_dim=_get(data, "qk_nope_head_dim"),
        qk_rope_head_dim=_get(data, "qk_rope_head_dim"),
        v_head_dim=_get(data, "v_head_dim"),
        mla_output_gate=data.get("mla_use_output_gate", is_k3),
        first_k_dense_replace=data.get("first_k_dense_replace", 0),
        intermediate_size=_get(data, "intermediate_size"),
        num_experts=_get(data, "num_experts", 0),
        num_experts_per_token=_get(data, "num_experts_per_token", 1),
        num_shared_experts=_get(data, "num_shared_experts", 0),
        moe_intermediate_size=_get(data, "moe_intermediate_size", _get(data, "intermediate_size")),
        routed_expert_hidden_size=data.get("routed_expert_hidden_size"),
        routed_scaling_factor=float(data.get("routed_scaling_factor", 1.0)),
        moe_renormalize=data.get("moe_renormalize", data.get("norm_topk_prob", True)),
        activation=act,
        situ_beta=float(data.get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(data.get("activation_situ_linear_beta", 25.0)),
        attn_res_block_size=data.get("attn_res_block_size") if is_k3 else None,
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-5)),
        # Kimi Linear's HF code builds the MLA LoRA norms with the hard-coded 1e-6; the K3
        # port uses rms_norm_eps (k3-architecture.md: unconfirmed which K3 expects).
        lora_norm_eps=data.get("lora_norm_eps", None if is_k3 else 1e-6),
        bos_token_id=data.get("bos_token_id", 1) if data.get("bos_token_id") is not None else 1,
        eos_token_id=_first(data.get("eos_token_id", 2)),
        pad_token_id=data.get("pad_token_id", 0) if data.get("pad_token_id") is not None else 0,
    )
    _check(isinstance(kw["kda_head_dim"], int), "linear_attn_config.head_dim", "an integer", kw["kda_head_dim"])
    return K3Config(**kw)


def _first(value: Any) -> Any:
    """eos_token_id may be a list in HF configs; the first id is the one we stop on."""
    return value[0] if isinstance(value, list) and value else value
