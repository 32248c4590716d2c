"""Checkpoints written by each accepted transformers release load, and give that release's logits.

tests/fixtures/transformers/<version>/<spelling>/ were written by the release's own
save_pretrained (scripts/make_transformers_fixtures.py, one venv per release), with the
logits its forward gave. No transformers import here: the fixture is the peer's output.
"checkpoint": config spelled as Kimi checkpoints spell it (linear_attn_config, 1-indexed);
"fields": KimiLinearConfig's own field names (layer_types, mlp_layer_types, ...), which
failed with a missing-tensor error before the loader read mlp_layer_types.
Tolerance: PEER_LOGITS_TOL, as in test_peer_transformers.py (and why, in peer_fixtures).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from k3verify.cli import main
from optimized_stack import load_model
from optimized_stack.errors import CheckpointError, ConfigError
from tests.peer_fixtures import PEER_LOGITS_TOL, describe_diff, rel_err

ROOT = Path(__file__).parent / "fixtures" / "transformers"
FIXTURES = sorted(p.parent for p in ROOT.glob("*/*/fixture.json"))
IDS = ["-".join(p.parts[-2:]) for p in FIXTURES]


def _logits(directory: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, transformers') logits for the fixture's ids."""
    meta = json.loads((directory / "fixture.json").read_text())
    model = load_model(directory)
    with torch.no_grad():
        got = model.logits(torch.tensor(meta["input_ids"])).float()
    return got, torch.from_numpy(np.load(directory / "logits.npy"))


def test_oldest_and_newest_release_are_present():
    versions = {p.parts[-2] for p in FIXTURES}
    assert {"5.17.0", "5.24.0"} <= versions, f"fixture releases found: {sorted(versions)}"
    assert {p.parts[-1] for p in FIXTURES} == {"checkpoint", "fields"}


@pytest.mark.parametrize("directory", FIXTURES, ids=IDS)
def test_fixture_was_written_by_its_release(directory):
    cfg = json.loads((directory / "config.json").read_text())
    assert cfg["transformers_version"] == directory.parts[-2], "fixture directory and writer disagree"
    if directory.name == "fields":    # the spelling this file exists for
        assert "linear_attn_config" not in cfg and "first_k_dense_replace" not in cfg, sorted(cfg)
        assert cfg["mlp_layer_types"][:2] == ["dense", "dense"] and "layer_types" in cfg


@pytest.mark.parametrize("directory", FIXTURES, ids=IDS)
def test_logits_match_the_release(directory):
    got, ref = _logits(directory)
    assert got.shape == ref.shape, f"logits shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert rel_err(got, ref) <= PEER_LOGITS_TOL, f"{describe_diff(got, ref)} > {PEER_LOGITS_TOL:g}"


@pytest.mark.parametrize("directory", FIXTURES, ids=IDS)
def test_cli_info_reads_the_fixture(directory, capsys):
    assert main(["info", "--model", str(directory), "--json"]) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = {"checkpoint": "KKMK", "fields": "KMKM"}[directory.name]
    assert out["layer_map"] == expected and out["source"]["stored_dtype"] == "float32", out["source"]


def _copy(tmp_path: Path, version: str, spelling: str) -> Path:
    out = tmp_path / f"{version}-{spelling}"
    shutil.copytree(ROOT / version / spelling, out)
    return out


def _edit_config(directory: Path, edit) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    edit(cfg)
    (directory / "config.json").write_text(json.dumps(cfg))


def test_negative_control_meaning_flip_moves_logits(tmp_path):
    """norm_topk_prob false still loads but is another model: the logit check must fail."""
    d = _copy(tmp_path, "5.24.0", "fields")
    _edit_config(d, lambda c: c.update(moe_renormalize=False))
    got, ref = _logits(d)
    assert rel_err(got, ref) > PEER_LOGITS_TOL, "renormalisation off left the logits within tolerance"


def _zero_indexed_lac(c):      # linear_attn_config written 0-indexed: every layer shifts by one
    c["linear_attn_config"]["full_attn_layers"] = [i - 1 for i in c["linear_attn_config"]["full_attn_layers"]]
    c["linear_attn_config"]["kda_layers"] = [i - 1 for i in c["linear_attn_config"]["kda_layers"]]


def _mla_moved_in_lac(c):      # MLA at 1-indexed 2 instead of 3: a valid layout, another model
    c["linear_attn_config"].update(full_attn_layers=[2], kda_layers=[1, 3, 4])


def _shifted_layer_types(c):
    c["layer_types"] = c["layer_types"][-1:] + c["layer_types"][:-1]


@pytest.mark.parametrize("spelling, edit, match", [
    ("checkpoint", _zero_indexed_lac, r"'linear_attn_config.kda_layers': expected 1-indexed layer numbers "
                                      r"in 1..4, got \[0\]"),
    ("checkpoint", _mla_moved_in_lac, r"'layer_types': expected full_attention at 0-indexed \[1\] \(= 1-indexed "
                                      r"linear_attn_config.full_attn_layers \[2\]\), got full_attention at \[2\]"),
    ("checkpoint", _shifted_layer_types, r"'layer_types': expected full_attention at 0-indexed \[2\] \(= 1-indexed "
                                         r"linear_attn_config.full_attn_layers \[3\]\), got full_attention at \[3\]"),
    ("checkpoint", lambda c: c.update(mlp_layer_types=["dense", "dense", "sparse", "sparse"]),
     r"'first_k_dense_replace': expected 2, the leading 'dense' layers of mlp_layer_types, got 1"),
    ("fields", lambda c: c.update(num_local_experts=8),
     r"'num_experts': expected its spellings to agree, got num_experts=4 and num_local_experts=8"),
    ("fields", lambda c: c.update(mlp_layer_types=["dense", "sparse", "dense", "sparse"]),
     r"'mlp_layer_types': expected 'dense' layers first, then 'sparse'"),
    ("fields", lambda c: (c.pop("mlp_layer_types"), c.pop("layer_types")),
     r"'linear_attn_config': expected kda_layers/full_attn_layers or a 'layer_types' list, got neither"),
    ("fields", lambda c: c.pop("mlp_layer_types"),
     r"'first_k_dense_replace': expected a value, got nothing"),
    ("fields", lambda c: c.pop("linear_head_dim"),
     r"'linear_attn_config.head_dim': expected a value \(spelled linear_attn_config.head_dim or linear_head_dim\)"),
], ids=["lac-0-indexed", "lac-mla-moved", "layer-types-shifted", "mlp-types-vs-first-k", "experts-spellings-disagree",
        "dense-not-prefix", "no-layer-kinds", "no-dense-count", "no-kda-head-dim"])
def test_negative_control_config_edits_fail_in_one_line(tmp_path, spelling, edit, match):
    d = _copy(tmp_path, "5.17.0", spelling)
    _edit_config(d, edit)
    with pytest.raises(ConfigError, match=match) as info:
        load_model(d)
    assert "\n" not in str(info.value)


def test_negative_control_renamed_tensor_is_named(tmp_path):
    d = _copy(tmp_path, "5.17.0", "fields")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.1.self_attn.q_a_proj.weightx"] = tensors.pop("model.layers.1.self_attn.q_a_proj.weight")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.self_attn.q_a_proj.weight' is missing"):
        load_model(d)
