"""Reading an HF-style config.json into K3Config's fields: types, spellings, layer kinds.

Spellings accepted (every transformers release with models/kimi_linear, 5.17.0-5.24.0,
writes the same keys; tests/fixtures/transformers/ holds what each one saved):
- Kimi / K3 checkpoint originals: `linear_attn_config` with 1-INDEXED `kda_layers` /
  `full_attn_layers`, `num_heads`, `head_dim`, `short_conv_kernel_size`;
  `first_k_dense_replace`, `num_experts`, `num_experts_per_token`, `num_shared_experts`,
  `moe_renormalize`, `num_expert_group`.
- transformers' KimiLinearConfig field names: `layer_types` (0-indexed,
  "linear_attention" / "full_attention"), `mlp_layer_types` ("dense" / "sparse"),
  `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`, `num_local_experts`,
  `num_experts_per_tok`, `n_shared_experts`, `norm_topk_prob`, `n_group`. Its
  save_pretrained writes the originals' names for the attribute_map'd ones, but a config
  built from the field names carries only `layer_types` / `mlp_layer_types` (no
  `linear_attn_config`, no `first_k_dense_replace`): the modeling code reads those two.
- Where two spellings of one field are both present they must agree; transformers would
  silently pick one (layer_types over linear_attn_config, mlp_layer_types over
  first_k_dense_replace), and an edited config where they differ is not one model.
- Where a field is absent and our default and transformers' default differ (experts,
  top-k, shared experts, scaling, dense layers, KDA heads/dim), it is required: a guess
  would load a different model without a word.
"""
from __future__ import annotations

from typing import Any, Callable

from .errors import ConfigError

KDA, MLA = "kda", "mla"
LAC = "linear_attn_config"
ARCHITECTURES = ("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)     # JSON true is not a layer count


def _is_num(v: Any) -> bool:
    return is_int(v) or isinstance(v, float)


def _list_of(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(ok(x) for x in v)


# type tag -> (test, what the message says was expected)
_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (is_int, "an integer"),
    "float": (_is_num, "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "a JSON object"),
    "list[int]": (_list_of(is_int), "a list of integers"),
    "list[str]": (_list_of(lambda v: isinstance(v, str)), "a list of strings"),
    "int|list[int]": (lambda v: is_int(v) or (_list_of(is_int)(v) and bool(v)),
                      "an integer or a non-empty list of integers"),
}

# THE table: every key this loader reads -> its JSON type ("?" suffix: null allowed).
# Nested linear_attn_config keys are spelled "linear_attn_config.<key>".
FIELD_TYPES: dict[str, str] = {
    "architectures": "list[str]", "k3_variant": "str", "text_config": "dict", LAC: "dict",
    "vocab_size": "int", "hidden_size": "int", "num_hidden_layers": "int",
    "layer_types": "list[str]", "mlp_layer_types": "list[str]",
    f"{LAC}.kda_layers": "list[int]", f"{LAC}.full_attn_layers": "list[int]",
    f"{LAC}.num_heads": "int", f"{LAC}.head_dim": "int", f"{LAC}.short_conv_kernel_size": "int",
    f"{LAC}.gate_lower_bound": "float", f"{LAC}.use_full_rank_gate": "bool",
    "linear_num_heads": "int", "linear_head_dim": "int", "linear_conv_kernel_dim": "int",
    "linear_short_conv_kernel_size": "int", "linear_gate_lower_bound": "float",
    "linear_use_full_rank_gate": "bool",
    "num_attention_heads": "int", "num_key_value_heads": "int?", "q_lora_rank": "int?",
    "kv_lora_rank": "int", "qk_nope_head_dim": "int", "qk_rope_head_dim": "int",
    "v_head_dim": "int", "mla_use_output_gate": "bool", "mla_use_nope": "bool",
    "attention_bias": "bool",
    "first_k_dense_replace": "int", "intermediate_size": "int", "moe_intermediate_size": "int",
    "num_experts": "int", "num_local_experts": "int", "n_routed_experts": "int",
    "num_experts_per_token": "int", "num_experts_per_tok": "int",
    "num_shared_experts": "int", "n_shared_experts": "int",
    "num_expert_group": "int?", "n_group": "int?", "topk_group": "int?",
    "moe_renormalize": "bool", "norm_topk_prob": "bool",
    "routed_expert_hidden_size": "int?", "routed_scaling_factor": "float",
    "hidden_act": "str", "activation_situ_beta": "float", "activation_situ_linear_beta": "float",
    "attn_res_block_size": "int?", "rms_norm_eps": "float", "lora_norm_eps": "float?",
    "tie_word_embeddings": "bool",
    "bos_token_id": "int?", "eos_token_id": "int|list[int]?", "pad_token_id": "int?",
}

# Keys that do not change the forward pass (NoPE model, no rotary; generation/runtime
# flags, restated derived values). Listed so that genuinely unknown keys are refused.
IGNORED_KEYS = {
    "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype",
    "initializer_range", "max_position_embeddings", "model_max_length", "rope_theta",
    "rope_parameters", "rope_scaling", "use_cache", "num_nextn_predict_layers", "topk_method",
    "use_grouped_topk", "moe_layer_freq", "_name_or_path", "attention_dropout",
    "output_attentions", "output_hidden_states", "return_dict", "pretraining_tp",
    "quantization_config", "use_return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "tokenizer_class", "vision_config",
    "media_placeholder_token_id", "moe_router_activation_func", "latent_moe_use_norm",
    # transformers' KimiLinearConfig writes these; they restate other fields (head_dim is
    # qk_rope_head_dim there, qk_head_dim is nope + rope) or are training-only
    "head_dim", "qk_head_dim", "output_router_logits", "router_aux_loss_coef",
}

# Our field -> the config keys that spell it, the Kimi original first.
SPELLINGS: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_experts_per_token": ("num_experts_per_token", "num_experts_per_tok"),
    "num_shared_experts": ("num_shared_experts", "n_shared_experts"),
    "moe_renormalize": ("moe_renormalize", "norm_topk_prob"),
    "num_expert_group": ("num_expert_group", "n_group"),
    "kda_num_heads": (f"{LAC}.num_heads", "linear_num_heads"),
    "kda_head_dim": (f"{LAC}.head_dim", "linear_head_dim"),
    "kda_conv_size": (f"{LAC}.short_conv_kernel_size", "linear_conv_kernel_dim",
                      "linear_short_conv_kernel_size"),
    "kda_gate_lower_bound": (f"{LAC}.gate_lower_bound", "linear_gate_lower_bound"),
    "kda_full_rank_gate": (f"{LAC}.use_full_rank_gate", "linear_use_full_rank_gate"),
}


def fail(name: str, expected: str, got: Any) -> None:
    raise ConfigError(f"config field '{name}': expected {expected}, got {got!r}")


def flatten(data: dict[str, Any]) -> dict[str, Any]:
    """Top-level keys plus linear_attn_config's as 'linear_attn_config.<key>'; types checked,
    unknown keys refused by name."""
    lac = data.get(LAC)
    flat = dict(data)
    if isinstance(lac, dict):
        flat.update({f"{LAC}.{k}": v for k, v in lac.items()})
    unknown = sorted(k for k in flat if k not in FIELD_TYPES and k not in IGNORED_KEYS)
    if unknown:
        raise ConfigError(f"config field '{unknown[0]}': expected a known K3/Kimi Linear field, "
                          f"got an unknown key ({len(unknown)} unknown: {', '.join(unknown[:5])})")
    for key, value in flat.items():
        tag = FIELD_TYPES.get(key)
        if tag is None:
            continue
        nullable = tag.endswith("?")
        test, what = _TYPES[tag.rstrip("?")]
        if value is None and nullable:
            continue
        if not test(value):
            kind = "null" if value is None else type(value).__name__
            raise ConfigError(f"config field '{key}': expected {what}{' or null' if nullable else ''}, "
                              f"got {value!r} ({kind})")
    return flat


def get(flat: dict[str, Any], field: str, default: Any = ...) -> Any:
    """The value of one field under any of its spellings; spellings present must agree."""
    names = SPELLINGS.get(field, (field,))
    present = [(n, flat[n]) for n in names if n in flat]
    if len({repr(v) for _, v in present}) > 1:
        shown = " and ".join(f"{n}={v!r}" for n, v in present)
        raise ConfigError(f"config field '{present[0][0]}': expected its spellings to agree, got {shown}")
    if present:
        return present[0][1]
    if default is ...:
        spelled = f" (spelled {' or '.join(names)})" if len(names) > 1 else ""
        raise ConfigError(f"config field '{names[0]}': expected a value{spelled}, got nothing (field missing)")
    return default


def check_architectures(flat: dict[str, Any]) -> None:
    archs = flat.get("architectures")
    if archs is None:          # KimiLinearConfig.save_pretrained alone writes none
        return
    bad = [a for a in archs if a not in ARCHITECTURES]
    if bad or not archs:
        fail("architectures", f"one of {', '.join(ARCHITECTURES)}", archs)


def layer_kinds(flat: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Per layer 'kda' or 'mla', from linear_attn_config (1-indexed) and/or layer_types
    (0-indexed); when both are given they must name the same layers."""
    from_lac = _kinds_from_lac(flat, num_layers)
    from_types = _kinds_from_types(flat, num_layers)
    if from_lac is not None and from_types is not None and from_lac != from_types:
        lac_mla = [i for i, k in enumerate(from_lac) if k == MLA]
        types_mla = [i for i, k in enumerate(from_types) if k == MLA]
        raise ConfigError(f"config field 'layer_types': expected full_attention at 0-indexed {lac_mla} "
                          f"(= 1-indexed {LAC}.full_attn_layers {[i + 1 for i in lac_mla]}), "
                          f"got full_attention at {types_mla}")
    kinds = from_types if from_lac is None else from_lac
    if kinds is None:
        raise ConfigError(f"config field '{LAC}': expected kda_layers/full_attn_layers "
                          "or a 'layer_types' list, got neither")
    return kinds


def _kinds_from_lac(flat: dict[str, Any], num_layers: int) -> tuple[str, ...] | None:
    full_key, kda_key = f"{LAC}.full_attn_layers", f"{LAC}.kda_layers"
    if full_key not in flat and kda_key not in flat:
        return None
    full, kda = flat.get(full_key, []), flat.get(kda_key, [])
    for key, layers in ((full_key, full), (kda_key, kda)):
        bad = [i for i in layers if not 1 <= i <= num_layers]
        if bad:
            fail(key, f"1-indexed layer numbers in 1..{num_layers}", bad[:3])
    overlap = sorted(set(full) & set(kda))
    if overlap:
        fail(LAC, "disjoint kda_layers and full_attn_layers", overlap)
    missing = sorted(set(range(1, num_layers + 1)) - set(full) - set(kda))
    if missing:
        fail(LAC, "every layer in kda_layers or full_attn_layers", f"layers {missing[:5]} in neither")
    return tuple(MLA if i + 1 in set(full) else KDA for i in range(num_layers))


def _kinds_from_types(flat: dict[str, Any], num_layers: int) -> tuple[str, ...] | None:
    types = flat.get("layer_types")
    if types is None:
        return None
    if len(types) != num_layers:
        fail("layer_types", f"a list of {num_layers} layer types (num_hidden_layers)", f"{len(types)} entries")
    mapping = {"linear_attention": KDA, "kda": KDA, "full_attention": MLA, "mla": MLA}
    bad = [t for t in types if t not in mapping]
    if bad:
        fail("layer_types", "'linear_attention' or 'full_attention'", bad[0])
    return tuple(mapping[t] for t in types)


def first_k_dense(flat: dict[str, Any], num_layers: int) -> int:
    """Number of leading dense-FFN layers: first_k_dense_replace and/or mlp_layer_types."""
    types = flat.get("mlp_layer_types")
    if types is None:
        return get(flat, "first_k_dense_replace")
    if len(types) != num_layers:
        fail("mlp_layer_types", f"a list of {num_layers} entries (num_hidden_layers)", f"{len(types)} entries")
    bad = [t for t in types if t not in ("dense", "sparse")]
    if bad:
        fail("mlp_layer_types", "'dense' or 'sparse'", bad[0])
    k = next((i for i, t in enumerate(types) if t == "sparse"), num_layers)
    if "dense" in types[k:]:
        fail("mlp_layer_types", "'dense' layers first, then 'sparse' (first_k_dense_replace)", types)
    if "first_k_dense_replace" in flat and flat["first_k_dense_replace"] != k:
        fail("first_k_dense_replace", f"{k}, the leading 'dense' layers of mlp_layer_types",
             flat["first_k_dense_replace"])
    return k
