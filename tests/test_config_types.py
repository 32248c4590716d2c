"""config.json fields of the wrong type, unknown architectures, unsupported settings: one line each.

Every key the loader reads has one JSON type in hf_config.FIELD_TYPES; these tests feed a
wrong one to each kind of slot (string, list, bool, null, float, nested) and read the
message: the field, the expected type, the value and its JSON type.
"""
from __future__ import annotations

import json
import re
import shutil

import pytest

from k3verify.cli import main
from optimized_stack import DEFAULT_MODEL, ConfigError, K3Config
from optimized_stack.hf_config import _TYPES, FIELD_TYPES, IGNORED_KEYS
from optimized_stack.presets import preset_config


def hf(**changes):
    cfg = preset_config("k3-mini").to_hf()
    for key, value in changes.items():
        if key.startswith("linear_attn_config."):
            cfg["linear_attn_config"][key.split(".", 1)[1]] = value
        else:
            cfg[key] = value
    return cfg


WRONG_TYPES = {
    "str-for-int": ("hidden_size", "128", r"'hidden_size': expected an integer, got '128' \(str\)"),
    "str-for-float": ("rms_norm_eps", "1e-5", r"'rms_norm_eps': expected a number, got '1e-5' \(str\)"),
    "list-for-int": ("num_hidden_layers", [8], r"'num_hidden_layers': expected an integer, got \[8\] \(list\)"),
    "bool-for-int": ("num_experts", True, r"'num_experts': expected an integer, got True \(bool\)"),
    "null-for-required": ("kv_lora_rank", None, r"'kv_lora_rank': expected an integer, got None \(null\)"),
    "float-for-int": ("linear_attn_config.head_dim", 16.0,
                      r"'linear_attn_config.head_dim': expected an integer, got 16.0 \(float\)"),
    "str-for-list": ("linear_attn_config.kda_layers", "1,2,3",
                     r"'linear_attn_config.kda_layers': expected a list of integers, got '1,2,3' \(str\)"),
    "ints-for-strs": ("layer_types", [0, 1], r"'layer_types': expected a list of strings, got \[0, 1\] \(list\)"),
    "str-for-bool": ("tie_word_embeddings", "false", r"'tie_word_embeddings': expected true or false, got 'false'"),
    "bool-for-float": ("routed_scaling_factor", False, r"'routed_scaling_factor': expected a number, got False"),
    "empty-eos-list": ("eos_token_id", [], r"'eos_token_id': expected an integer or a non-empty list of integers "
                                           r"or null, got \[\] \(list\)"),
    "list-for-nullable": ("q_lora_rank", [32], r"'q_lora_rank': expected an integer or null, got \[32\]"),
    "list-for-dict": ("linear_attn_config", [1, 2], r"'linear_attn_config': expected a JSON object, got \[1, 2\]"),
}


@pytest.mark.parametrize("key, value, match", WRONG_TYPES.values(), ids=list(WRONG_TYPES))
def test_wrong_type_names_field_type_and_value(key, value, match):
    with pytest.raises(ConfigError, match=match) as info:
        K3Config.from_hf(hf(**{key: value}))
    assert "\n" not in str(info.value)


def test_type_table_is_well_formed():
    """One table: each tag is known, and no key is both read (typed) and ignored."""
    bad = {k: t for k, t in FIELD_TYPES.items() if t.rstrip("?") not in _TYPES}
    assert not bad, f"unknown type tags: {bad}"
    assert not set(FIELD_TYPES) & IGNORED_KEYS, sorted(set(FIELD_TYPES) & IGNORED_KEYS)


def test_nulls_where_allowed_and_eos_lists():
    cfg = K3Config.from_hf(hf(bos_token_id=None, eos_token_id=[258, 5], num_expert_group=None,
                              num_key_value_heads=None))
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 258)
    assert cfg == K3Config.from_hf(hf(bos_token_id=1, eos_token_id=258))


ARCHS = ("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration")


@pytest.mark.parametrize("archs", [["KimiLinearForCausalLM"], ["KimiK3ForConditionalGeneration"], None],
                         ids=["kimi-linear", "k3-wrapper", "absent"])
def test_accepted_architectures(archs):
    cfg = hf(architectures=archs)
    if archs is None:
        del cfg["architectures"]
    assert K3Config.from_hf(cfg) == K3Config.from_hf(hf())


@pytest.mark.parametrize("archs", [["LlamaForCausalLM"], ["KimiLinearForCausalLM", "Qwen2ForCausalLM"], []],
                         ids=["llama", "one-of-two", "empty"])
def test_unknown_architecture_is_refused_naming_the_accepted(archs):
    with pytest.raises(ConfigError, match=re.escape(f"'architectures': expected one of {', '.join(ARCHS)}, "
                                                    f"got {archs!r}")):
        K3Config.from_hf(hf(architectures=archs))


@pytest.mark.parametrize("changes, match", [
    ({"num_key_value_heads": 2}, r"'num_key_value_heads': expected 4 \(num_attention_heads\) or null, got 2"),
    ({"attention_bias": True}, r"'attention_bias': expected false \(no MLA projection biases\), got true"),
    ({"mla_use_nope": False}, r"'mla_use_nope': expected true \(no rotary embedding is implemented\)"),
    ({"linear_attn_config.chunk": 64}, r"'linear_attn_config.chunk': expected a known K3/Kimi Linear field"),
    ({"n_shared_experts": 1}, r"'num_shared_experts': expected its spellings to agree, got num_shared_experts=2 "
                              r"and n_shared_experts=1"),
    ({"linear_num_heads": 8}, r"'linear_attn_config.num_heads': expected its spellings to agree"),
    ({"k3_variant": "k4"}, r"'k3_variant': expected 'k3' or 'kimi_linear', got 'k4'"),
], ids=["kv-heads", "attention-bias", "rope", "unknown-nested-key", "shared-spellings", "kda-heads-spellings",
        "variant"])
def test_unsupported_or_contradictory_settings(changes, match):
    with pytest.raises(ConfigError, match=match):
        K3Config.from_hf(hf(**changes))


def test_moe_fields_with_disagreeing_defaults_are_required():
    """Our default and transformers' differ (8 vs 256 experts ...): absent means refused, not guessed."""
    for key in ("num_experts", "num_experts_per_token", "num_shared_experts", "routed_scaling_factor",
                "moe_intermediate_size"):
        cfg = hf()
        del cfg[key]
        with pytest.raises(ConfigError, match=rf"'{key}': expected a value.*got nothing"):
            K3Config.from_hf(cfg)


# ---- through the CLI: one line on stderr, exit 2 -------------------------------------------

@pytest.fixture
def edited_model(tmp_path):
    """The embedded model's directory copied, with config.json edits applied."""
    out = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, out)

    def edit(**changes):
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(changes)
        (out / "config.json").write_text(json.dumps(cfg))
        return out
    return edit


@pytest.mark.parametrize("changes, message", [
    ({"rms_norm_eps": "tiny"}, "config field 'rms_norm_eps': expected a number, got 'tiny' (str)"),
    ({"num_hidden_layers": None}, "config field 'num_hidden_layers': expected an integer, got None (null)"),
    ({"architectures": ["LlamaForCausalLM"]}, "config field 'architectures': expected one of "
                                              "KimiLinearForCausalLM, KimiK3ForConditionalGeneration, "
                                              "got ['LlamaForCausalLM']"),
], ids=["string-eps", "null-layers", "llama"])
def test_cli_info_bad_config_exit_2_one_line(edited_model, capsys, changes, message):
    model_dir = edited_model(**changes)
    code = main(["info", "--model", str(model_dir)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err == f"k3verify: error: {message}\n"
