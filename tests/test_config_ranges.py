"""Configs are range-checked before a model is built, and a model too big for memory is refused.

Issue 29: a config.json with rms_norm_eps 1e999 (JSON's inf), routed_scaling_factor -1e30
or a -inf gate bound loaded; `diff --toggle kda_chunked` then read KL 0 between two broken
outputs and passed, and `generate` printed NUL bytes. hidden_size 2**40 reached the
allocator. Each is now one line naming the field; the shipped configs are the negative
control that still loads, and the memory estimate is held to the built model's count.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3verify.cli import main
from optimized_stack.config import K3Config
from optimized_stack.errors import ConfigError
from optimized_stack.model.model import K3Model
from optimized_stack.presets import PRESETS, preset_config

REPO = Path(__file__).resolve().parents[1]
MINI = REPO / "golden" / "k3-mini"


def _write(d: Path, *, raw: str | None = None, lac: bool = False, **changes) -> Path:
    """golden/k3-mini's config.json with changes (lac: inside linear_attn_config); raw is spliced in
    as JSON text for the one change (1e999 is not something json.dumps writes)."""
    data = json.loads((MINI / "config.json").read_text())
    target = data["linear_attn_config"] if lac else data
    for key, value in changes.items():
        target[key] = "@@RAW@@" if raw is not None else value
    text = json.dumps(data)
    if raw is not None:
        text = text.replace('"@@RAW@@"', raw)
    (d / "config.json").write_text(text)
    return d


# id -> (config change, the one-line message)
CASES = {
    "eps-1e999": (dict(rms_norm_eps=None, raw="1e999"), r"config field 'rms_norm_eps': expected a finite number, got inf"),
    "eps-nan": (dict(rms_norm_eps=None, raw="NaN"), r"config field 'rms_norm_eps': expected a finite number, got nan"),
    "eps-zero": (dict(rms_norm_eps=0.0), r"'rms_norm_eps': expected a small positive epsilon, 0 < eps <= 0.1, got 0.0"),
    "eps-large": (dict(rms_norm_eps=0.5), r"'rms_norm_eps': expected a small positive epsilon, 0 < eps <= 0.1, got 0.5"),
    "lora-eps-inf": (dict(lora_norm_eps=None, raw="Infinity"), r"'lora_norm_eps': expected a finite number, got inf"),
    "routed-scaling-neg-1e30": (dict(routed_scaling_factor=-1e30),
                                r"'routed_scaling_factor': expected a positive number <= 1000, got -1e\+30"),
    "routed-scaling-1e30": (dict(routed_scaling_factor=1e30),
                            r"'routed_scaling_factor': expected a positive number <= 1000, got 1e\+30"),
    "gate-bound-neg-inf": (dict(lac=True, gate_lower_bound=None, raw="-Infinity"),
                           r"config field 'gate_lower_bound': expected a finite number, got -inf"),
    "gate-bound-neg-1e999": (dict(lac=True, gate_lower_bound=None, raw="-1e999"),
                             r"config field 'gate_lower_bound': expected a finite number, got -inf"),
    "situ-beta-nan": (dict(activation_situ_beta=None, raw="NaN"), r"'situ_beta': expected a finite number, got nan"),
    "hidden-2e40": (dict(hidden_size=2**40), r"'hidden_size': expected an integer in 1\.\.65,536, got 1099511627776"),
    "vocab-2e31": (dict(vocab_size=2**31), r"'vocab_size': expected an integer in 1\.\.4,194,304, got 2147483648"),
    "experts-negative": (dict(num_shared_experts=-1), r"'num_shared_experts': expected an integer in 0\.\.4,096, got -1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_model_config_is_refused_naming_the_field(tmp_path, case):
    changes, message = CASES[case]
    _write(tmp_path, **changes)
    with pytest.raises(ConfigError, match=message) as info:
        K3Config.from_file(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("case", ["eps-1e999", "routed-scaling-neg-1e30", "gate-bound-neg-inf", "hidden-2e40"])
def test_the_cli_refuses_it_in_one_line_exit_2(tmp_path, capsys, case):
    changes, message = CASES[case]
    shutil_copy = (MINI / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(shutil_copy)
    _write(tmp_path, **changes)
    for argv in (["info", "--model", tmp_path], ["generate", "--model", tmp_path, "--prompt", "hi"]):
        code = main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith("k3verify: error: config field"), (argv[0], err)


def test_negative_control_the_shipped_configs_still_load():
    from shared_data import SHARED

    shipped = [MINI, SHARED / "data" / "k3-peer", *sorted((REPO / "tests" / "fixtures" / "transformers").glob("*/*/"))]
    assert len(shipped) >= 4
    for d in shipped:
        cfg = K3Config.from_file(d)
        assert cfg.hidden_size > 0 and cfg.parameter_count() > 0, d
    for name in PRESETS:
        preset_config(name)                          # presets go through the same __post_init__


# ---- the memory estimate ---------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["k3", "kimi-linear-shape"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_parameter_count_is_the_built_models(preset, variant):
    cfg = preset_config(preset)
    if variant == "kimi-linear-shape":      # every optional block swapped: plain q, no gates, no latent, no AttnRes
        cfg = cfg.replace(q_lora_rank=None, mla_output_gate=False, kda_full_rank_gate=False,
                          routed_expert_hidden_size=None, attn_res_block_size=None)
    built = sum(p.numel() for p in K3Model(cfg).parameters())
    assert cfg.parameter_count() == built, f"estimate {cfg.parameter_count():,} vs built {built:,}"


def test_a_model_bigger_than_memory_is_refused_before_allocating(tmp_path):
    # every size inside its range, the whole ~1.3e15 parameters (4.5 PiB): no machine holds it
    _write(tmp_path, num_hidden_layers=1024, hidden_size=1 << 16, vocab_size=1 << 22, num_experts=4096,
           moe_intermediate_size=1 << 20, first_k_dense_replace=1,
           linear_attn_config={"kda_layers": list(range(1, 1025)), "full_attn_layers": [], "num_heads": 4,
                               "head_dim": 16, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                               "use_full_rank_gate": True})
    with pytest.raises(ConfigError, match=r"config: the model's parameters need about [\d.]+ [PE]iB \([\d,]+ parameters "
                                          r"x 4 bytes\), more than the [\d.]+ [GTPM]iB of memory available "
                                          r"\((MemAvailable in /proc/meminfo|physical memory)\); refused before allocating"):
        K3Config.from_file(tmp_path)


def test_memory_check_can_fail_and_pass_on_the_same_config():
    cfg = K3Config.from_file(MINI)
    need = cfg.parameter_count() * 4
    cfg.check_fits_in_memory(available=need)                     # exactly enough
    with pytest.raises(ConfigError, match=r"need about 4\.1 MiB .* more than the 4\.1 MiB of memory available \(given\)"):
        cfg.check_fits_in_memory(available=need - 1)
    from optimized_stack.config import available_memory

    have, source = available_memory()
    assert have > need and source, (have, source)
