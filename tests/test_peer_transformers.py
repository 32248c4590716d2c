"""Peer test: the reference model against transformers' Kimi Linear on the same random weights.

transformers' KimiLinearForCausalLM is an independent public implementation that runs on
the CPU (its plain-PyTorch kernels, forced here). We build tiny models with EVERY tensor
moved off its init (A_log, dt_bias, router bias and norm gains included), let transformers
write the checkpoint (`save_pretrained`, which uses the original Kimi names), load that
directory with `optimized_stack.load_model`, and compare fp32 logits.

Tolerance: max|d|/max|ref| <= 1e-4. The two sides differ in summation order (chunked vs
recurrent KDA, eps 1e-6 vs rms_norm_eps in the MLA LoRA norm: ~1e-5), a structural bug is
orders of magnitude above it. Negative controls corrupt one tensor on disk and require the
gap to open, so the comparison is shown to be able to fail for each kind of tensor.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.peer_fixtures import (
    PEER_LOGITS_TOL,
    KimiLinearSpec,
    build_kimi_linear,
    describe_diff,
    kimi_linear_logits,
    kimi_linear_modeling,
    min_routing_gap,
    rel_err,
    seeded_ids,
)

if kimi_linear_modeling() is None:
    pytest.skip("this transformers has no models/kimi_linear (first in transformers 5.17.0)",
                allow_module_level=True)

TOL = PEER_LOGITS_TOL
T = 40
SPECS = {
    # Kimi Linear's own shape: no q-LoRA, one shared expert, MLA in the middle.
    "kl-noqlora-mla3": KimiLinearSpec(name="kl-noqlora-mla3"),
    # The other branches: q-LoRA MLA, MLA as the last layer, 2 shared experts, 2 dense layers.
    "kl-qlora-mla24": KimiLinearSpec(
        name="kl-qlora-mla24", kda_layers=(1, 3), full_attn_layers=(2, 4), q_lora_rank=24,
        num_shared_experts=2, first_k_dense_replace=2, routed_scaling_factor=1.5,
    ),
}


class Peer:
    """One saved transformers fixture: its directory, input ids and transformers' logits."""

    def __init__(self, spec: KimiLinearSpec, root: Path, seed: int):
        self.spec = spec
        self.dir = root / spec.name
        model = build_kimi_linear(spec, seed)
        model.save_pretrained(self.dir)
        self.ids = seeded_ids(seed + 1, T, spec.vocab_size)
        self.ref = kimi_linear_logits(model, self.ids)
        self.routing_gap = min_routing_gap(model, self.ids)


@pytest.fixture(scope="module")
def peers(tmp_path_factory) -> dict[str, Peer]:
    root = tmp_path_factory.mktemp("kimi_linear_peer")
    return {name: Peer(spec, root, seed=1000 + i) for i, (name, spec) in enumerate(SPECS.items())}


def _project_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from optimized_stack import load_model

    model = load_model(str(path), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        return model.logits(ids).float()


@pytest.mark.parametrize("name", SPECS)
def test_fixture_is_well_conditioned(peers, name):
    peer = peers[name]
    assert peer.routing_gap > 1e-4, (
        f"{name}: smallest top-k router gap {peer.routing_gap:.2e} is within rounding reach; "
        "pick another seed so expert selection cannot flip between implementations")
    assert torch.isfinite(peer.ref).all() and 0.3 < peer.ref.std(-1).mean() < 30, (
        f"{name}: transformers' logits look degenerate (std over vocab {peer.ref.std(-1).mean():.3g})")


@pytest.mark.parametrize("name", SPECS)
def test_checkpoint_uses_original_kimi_names(peers, name):
    """save_pretrained reverts transformers' in-memory fusing; the loader reads this layout."""
    keys = set(load_file(str(peers[name].dir / "model.safetensors")))
    spec = peers[name].spec
    kda0 = spec.kda_layers[0] - 1
    moe = spec.first_k_dense_replace
    expected = {
        f"model.layers.{kda0}.self_attn.q_conv1d.weight",
        f"model.layers.{kda0}.self_attn.A_log",
        f"model.layers.{kda0}.self_attn.f_a_proj.weight",
        f"model.layers.{moe}.block_sparse_moe.experts.0.w1.weight",
        f"model.layers.{moe}.block_sparse_moe.gate.e_score_correction_bias",
    }
    assert expected <= keys, f"missing from the saved checkpoint: {sorted(expected - keys)}"
    assert not any(".forget_gate." in k or "gate_up_proj" in k or ".conv1d." in k for k in keys), (
        "transformers wrote in-memory (fused) names; the peer layout assumption no longer holds")
    cfg = json.loads((peers[name].dir / "config.json").read_text())
    assert cfg["linear_attn_config"]["full_attn_layers"] == list(spec.full_attn_layers)


@pytest.mark.parametrize("name", SPECS)
def test_logits_match_transformers(peers, name):
    peer = peers[name]
    got = _project_logits(peer.dir, peer.ids)
    assert got.shape == peer.ref.shape, f"logits shape {tuple(got.shape)} != {tuple(peer.ref.shape)}"
    err = rel_err(got, peer.ref)
    assert err <= TOL, f"{name}: project vs transformers, {describe_diff(got, peer.ref)} > {TOL:g}"


def _corrupt(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "flip_sign":
        return -t
    if how == "bias_one_expert":
        out = t.clone()
        out[0] += 2.0            # expert 0 now wins every selection
        return out
    if how == "scale":
        return t * 1.5
    raise ValueError(how)


# (tensor name pattern with {kda}/{mla}/{moe}/{dense} layer slots, corruption)
CORRUPTIONS = {
    "A_log": ("model.layers.{kda}.self_attn.A_log", "scale"),
    "dt_bias": ("model.layers.{kda}.self_attn.dt_bias", "flip_sign"),
    "q_conv1d": ("model.layers.{kda}.self_attn.q_conv1d.weight", "flip_sign"),
    "o_norm": ("model.layers.{kda}.self_attn.o_norm.weight", "scale"),
    "kv_a_layernorm": ("model.layers.{mla}.self_attn.kv_a_layernorm.weight", "scale"),
    "router_bias": ("model.layers.{moe}.block_sparse_moe.gate.e_score_correction_bias", "bias_one_expert"),
    "dense_gate_proj": ("model.layers.{dense}.block_sparse_moe.gate_proj.weight", "flip_sign"),
}


@pytest.mark.parametrize("what", CORRUPTIONS)
def test_negative_control_corrupted_tensor_is_caught(peers, tmp_path, what):
    """Corrupt one tensor on disk: the project's logits must leave transformers' by > TOL."""
    peer = peers["kl-noqlora-mla3"]
    spec = peer.spec
    pattern, how = CORRUPTIONS[what]
    key = pattern.format(kda=spec.kda_layers[0] - 1, mla=spec.full_attn_layers[0] - 1,
                         moe=spec.first_k_dense_replace, dense=0)
    bad_dir = tmp_path / f"corrupt-{what}"
    shutil.copytree(peer.dir, bad_dir)
    tensors = load_file(str(bad_dir / "model.safetensors"))
    assert key in tensors, f"negative control: {key} not in the checkpoint"
    tensors[key] = _corrupt(tensors[key], how).contiguous()
    save_file(tensors, str(bad_dir / "model.safetensors"), metadata={"format": "pt"})
    got = _project_logits(bad_dir, peer.ids)
    err = rel_err(got, peer.ref)
    assert err > TOL, (f"corrupting {key} ({how}) moved the logits only {err:.2e} <= {TOL:g}: "
                       "the loader ignores this tensor or the check cannot fail")
