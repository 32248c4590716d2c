"""Peer test: the reference model against the JAX port's K3 golden data (k3-peer).

/work/shared/data/k3-peer holds a tiny random K3 (8 layers, AttnRes, latent MoE, gated
MLA, safe-gate KDA) with every tensor perturbed off its init, and the port's fp32 logits
and per-layer residual partial sums for 200 tokens. See that directory's README.

Tolerance: max|d|/max|ref| < 5e-4 (the port's own tolerance against HF; the port's
modes disagree with each other by up to 6e-5). Per-layer partial sums use the same
bound. The negative controls corrupt one tensor in a copy and require the gap to open.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.peer_fixtures import describe_diff, rel_err
from shared_data import SHARED  # noqa: E402

PEER = SHARED / "data" / "k3-peer"
TOL = 5e-4

if not (PEER / "model.safetensors").is_file():
    pytest.skip(f"k3-peer data not found at {PEER}", allow_module_level=True)


def _load(path: Path):
    from optimized_stack import load_model

    return load_model(str(path), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def data():
    return {
        "ids": torch.from_numpy(np.load(PEER / "input_ids.npy")),
        "logits": torch.from_numpy(np.load(PEER / "logits.npy")),
        "hidden": torch.from_numpy(np.load(PEER / "hidden_states.npy")),
    }


@pytest.fixture(scope="module")
def run(data):
    """Logits and every probe emission of one whole-prompt forward."""
    model = _load(PEER)
    seen: dict[tuple[int, str], torch.Tensor] = {}

    def probe(layer: int, name: str, t: torch.Tensor) -> None:
        seen[(layer, name)] = t.detach().float().clone()

    if hasattr(model, "probe"):
        with model.probe(probe):
            logits = model.logits(data["ids"])
    else:
        logits = model.logits(data["ids"])
    return {"model": model, "logits": logits.float(), "probes": seen}


def test_logits_match_jax_port(data, run):
    got, ref = run["logits"], data["logits"]
    assert got.shape == ref.shape, f"logits shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = rel_err(got, ref)
    assert err < TOL, f"k3-peer logits: {describe_diff(got, ref)} >= {TOL:g}"


def test_partial_sums_match_jax_port(data, run):
    """hidden_states[0] is the embedding, [i+1] the partial sum leaving layer i."""
    if not hasattr(run["model"], "probe"):
        pytest.skip("the model has no probe() hook API; per-layer partial sums cannot be read")
    probes, hidden = run["probes"], data["hidden"]
    names = [("embed", -1)] + [("partial", i) for i in range(hidden.shape[0] - 1)]
    missing = [f"{n}@{i}" for n, i in names if (i, n) not in probes]
    assert not missing, f"probe points not emitted: {missing}"
    report = []
    first_bad = None
    for j, (name, layer) in enumerate(names):
        got = probes[(layer, name)]
        err = rel_err(got, hidden[j])
        report.append(f"{name}@{layer}: {err:.2e}")
        if err >= TOL and first_bad is None:
            first_bad = f"{name}@{layer}: {describe_diff(got, hidden[j])}"
    assert first_bad is None, f"first divergent partial sum {first_bad}; all: {', '.join(report)}"


CORRUPTIONS = {
    # (tensor, corruption) — one per kind of tensor the K3 path reads
    "A_log": ("model.layers.0.self_attn.A_log", lambda t: t * 1.5),
    "dt_bias": ("model.layers.1.self_attn.dt_bias", lambda t: -t),
    "mla_g_proj": ("model.layers.3.self_attn.g_proj.weight", lambda t: -t),
    "res_proj": ("model.layers.5.self_attention_res_proj.weight", lambda t: t * 4.0),
    "routed_expert_norm": ("model.layers.2.block_sparse_moe.routed_expert_norm.weight", lambda t: t * 1.5),
}


@pytest.mark.parametrize("what", CORRUPTIONS)
def test_negative_control_corrupted_tensor_is_caught(data, tmp_path, what):
    key, corrupt = CORRUPTIONS[what]
    bad = tmp_path / "k3-peer-corrupt"
    shutil.copytree(PEER, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    if key not in tensors:
        similar = sorted(k for k in tensors if key.rsplit(".", 2)[-2] in k)[:5]
        pytest.fail(f"negative control: {key} not in k3-peer; similar names: {similar}")
    tensors[key] = corrupt(tensors[key]).contiguous()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    got = _load(bad).logits(data["ids"]).float()
    err = rel_err(got, data["logits"])
    assert err >= TOL, (f"corrupting {key} moved the logits only {err:.2e} < {TOL:g}: "
                        "the loader ignores it or the check cannot fail")
