"""Stored weights: NaN/inf, non-float and float16/float64 tensors are refused by name; fp32 and
bf16 load; the flags that allow the first and the last; the stored dtype is recorded.

Each test rewrites one tensor (or all) of a k3-mini checkpoint and loads it again.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3verify.cli import main
from k3verify.report.environment import model_fingerprint
from optimized_stack import DEFAULT_MODEL, load_model
from optimized_stack.checkpoint import WEIGHTS
from optimized_stack.errors import CheckpointError

NAME = "model.layers.0.self_attn.q_proj.weight"      # [64, 128] = H*K x D, 8192 values


@pytest.fixture
def ckpt(tmp_path):
    """rewrite(fn) -> a copy of the embedded k3-mini whose tensors went through fn(dict)."""
    out = tmp_path / "ckpt"
    shutil.copytree(DEFAULT_MODEL, out)

    def rewrite(fn) -> Path:
        tensors = load_file(str(out / WEIGHTS))
        fn(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / WEIGHTS), metadata={"format": "pt"})
        return out
    return rewrite


def _poison(value: float, index: tuple[int, ...], name: str = NAME):
    def fn(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][index] = value
    return fn


@pytest.mark.parametrize("value, index, shown", [
    (float("nan"), (1, 7), "nan"), (float("inf"), (0, 0), "inf"), (float("-inf"), (63, 127), "-inf"),
], ids=["nan", "inf", "neg-inf-last"])
def test_nonfinite_weight_is_named_with_first_index(ckpt, value, index, shown):
    d = ckpt(_poison(value, index))
    with pytest.raises(CheckpointError, match=rf"tensor '{NAME}': expected finite values, got 1 of 8192 "
                                              rf"non-finite, first {shown} at index \({index[0]}, {index[1]}\)"):
        load_model(d)


def test_first_bad_index_is_the_first_in_memory_order(ckpt):
    def two(tensors):
        _poison(float("inf"), (5, 3))(tensors)
        _poison(float("nan"), (2, 9))(tensors)
    with pytest.raises(CheckpointError, match=r"got 2 of 8192 non-finite, first nan at index \(2, 9\)"):
        load_model(ckpt(two))


def test_allow_nonfinite_loads_the_poisoned_model(ckpt):
    model = load_model(ckpt(_poison(float("nan"), (1, 7))), allow_nonfinite=True)
    weight = dict(model.named_parameters())[NAME]
    assert torch.isnan(weight[1, 7]) and torch.isfinite(weight).sum() == weight.numel() - 1


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool], ids=["int64", "int8", "bool"])
def test_non_float_weight_is_refused_by_name_and_dtype(ckpt, dtype):
    def fn(tensors):
        tensors[NAME] = torch.ones_like(tensors[NAME], dtype=dtype)
    d = ckpt(fn)
    expected = rf"tensor '{NAME}': expected a float32 or bfloat16 tensor, got {str(dtype)[6:]}"
    for flags in ({}, {"allow_dtype_cast": True, "allow_nonfinite": True}):   # no flag lets it through
        with pytest.raises(CheckpointError, match=expected):
            load_model(d, **flags)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=["fp16", "fp64"])
def test_fp16_fp64_refused_unless_cast_is_asked_for(ckpt, dtype):
    d = ckpt(lambda t: t.update({k: v.to(dtype) for k, v in t.items()}))
    with pytest.raises(CheckpointError, match=rf"expected float32 or bfloat16, got {str(dtype)[6:]} \(not "
                                              r"converted silently: pass allow_dtype_cast=True"):
        load_model(d)
    model = load_model(d, allow_dtype_cast=True)
    assert model.stored_dtype == str(dtype)[6:] and next(model.parameters()).dtype == torch.float32
    ids = torch.tensor([257, 72, 105])
    err = (model.logits(ids) - load_model(DEFAULT_MODEL).logits(ids)).abs().max().item()
    assert err < 0.05, f"a {dtype} round trip moved the logits by {err}"


def test_bf16_checkpoint_loads_exactly_and_records_its_dtype(ckpt):
    d = ckpt(lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    model = load_model(d)
    stored = load_file(str(d / WEIGHTS))
    params = dict(model.named_parameters())
    assert torch.equal(params[NAME], stored[NAME].float()), "bf16 -> fp32 must be exact"
    assert model.stored_dtype == "bfloat16" and model_fingerprint(model)["stored_dtype"] == "bfloat16"


def test_mixed_dtypes_are_recorded_as_stored(ckpt):
    d = ckpt(lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items() if k.endswith("proj.weight")}))
    assert load_model(d).stored_dtype == "bfloat16+float32"


def test_fp32_and_preset_stored_dtype():
    assert load_model(None).stored_dtype == "float32"
    preset = load_model("k3-mini")
    assert preset.stored_dtype is None and model_fingerprint(preset)["stored_dtype"] is None


# ---- through the CLI ------------------------------------------------------------------------

def test_cli_nonfinite_exit_2_one_line_then_flag_loads(ckpt, capsys):
    d = ckpt(_poison(float("nan"), (1, 7)))
    assert main(["info", "--model", str(d)]) == 2
    err = capsys.readouterr().err
    assert err == (f"k3verify: error: tensor '{NAME}': expected finite values, got 1 of 8192 non-finite, "
                   "first nan at index (1, 7) (pass allow_nonfinite=True, CLI --allow-nonfinite-weights, "
                   "to load it anyway)\n")
    assert main(["info", "--model", str(d), "--allow-nonfinite-weights"]) == 0


def test_cli_fp16_needs_the_cast_flag_and_info_shows_stored_dtype(ckpt, capsys):
    d = ckpt(lambda t: t.update({k: v.half() for k, v in t.items()}))
    assert main(["info", "--model", str(d)]) == 2
    assert "got float16 (not converted silently" in capsys.readouterr().err
    assert main(["info", "--model", str(d), "--allow-weight-cast", "--json"]) == 0
    source = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["source"]
    assert source["stored_dtype"] == "float16"
