"""Regenerate tests/fixtures/transformers/<version>/<spelling>/ with each transformers release.

Every fixture is a tiny perturbed KimiLinearForCausalLM written by THAT release's own
save_pretrained (config.json, model.safetensors, generation_config.json) plus the logits
that release's forward gave for fixed input ids (logits.npy, fp32 [T, V]) and what made
them (fixture.json: versions, seed, ids, spec). tests/test_config_transformers.py loads
each one through optimized_stack.load_model and compares logits.

Two spellings per release: "checkpoint" builds the config as Kimi checkpoints spell it
(linear_attn_config with 1-indexed layer lists, first_k_dense_replace, num_experts ...);
"fields" with KimiLinearConfig's own field names (0-indexed layer_types, mlp_layer_types,
num_local_experts ...), whose saved config.json carries no linear_attn_config and no
first_k_dense_replace.

    .venv/bin/python scripts/make_transformers_fixtures.py                 # default versions
    .venv/bin/python scripts/make_transformers_fixtures.py --versions 5.17.0 5.24.0

Each release gets a venv at <venv-root>/tfvenv-<version> (outside the repository) with
`pip install transformers==<version>` and a .pth line that borrows torch from the
interpreter running this script (the repo's .venv), so no second torch is installed.
transformers' Kimi Linear runs on its plain-PyTorch kernels (peer_fixtures forces them).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "transformers"
# The oldest release with models/kimi_linear (5.16.x has none) and the newest on PyPI when
# this was written. Every release between (5.18.0 ... 5.23.0) was run the same way: same
# config.json keys (5.19 added output_router_logits), same tensors, bit-identical logits
# on torch 2.13 CPU, so they are not committed; pass --versions to add one.
VERSIONS = ("5.17.0", "5.24.0")
T = 24
SEED = 1600
SPELLINGS = ("checkpoint", "fields")


def _specs():
    from tests.peer_fixtures import KimiLinearSpec

    # A few hundred KB each: hidden 32, vocab 64, 4 layers; every branch between the two.
    small = dict(hidden_size=32, vocab_size=64, kda_heads=2, kda_head_dim=16, mla_heads=2,
                 kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                 intermediate_size=48, moe_intermediate_size=16, num_experts=4, top_k=2)
    return {
        # Kimi Linear's own layout: no q-LoRA, MLA inside, one dense layer, one shared expert.
        "checkpoint": KimiLinearSpec(name="checkpoint", kda_layers=(1, 2, 4), full_attn_layers=(3,), **small),
        # The other branches: q-LoRA, MLA last, two dense layers, two shared experts.
        "fields": KimiLinearSpec(name="fields", kda_layers=(1, 3), full_attn_layers=(2, 4), q_lora_rank=8,
                                 first_k_dense_replace=2, num_shared_experts=2, routed_scaling_factor=1.5,
                                 **small),
    }


def worker(version: str, out: Path) -> None:
    """Inside the release's venv: build, save and run each spelling's model."""
    sys.path.insert(0, str(REPO))
    import dataclasses

    import numpy as np
    import torch
    import transformers

    from tests.peer_fixtures import build_kimi_linear, kimi_linear_logits, min_routing_gap, seeded_ids

    if transformers.__version__ != version:
        raise SystemExit(f"expected transformers {version} in this venv, got {transformers.__version__}")
    torch.set_num_threads(1)
    for spelling, spec in _specs().items():
        for seed in range(SEED, SEED + 20):         # first seed whose routing cannot flip on rounding
            model = build_kimi_linear(spec, seed, spelling)
            ids = seeded_ids(seed + 1, T, spec.vocab_size)
            gap = min_routing_gap(model, ids)
            if gap > 1e-3:
                break
        else:
            raise SystemExit(f"{spelling}: no seed in {SEED}..{SEED + 19} keeps the router gap above 1e-3")
        logits = kimi_linear_logits(model, ids)
        target = out / spelling
        if target.exists():
            shutil.rmtree(target)
        model.save_pretrained(target)
        np.save(target / "logits.npy", logits.numpy().astype(np.float32))
        os.chmod(target / "model.safetensors", 0o644)      # save_pretrained writes 0600
        meta = {"transformers": version, "torch": torch.__version__, "spelling": spelling, "seed": seed,
                "input_ids": ids.tolist(), "min_routing_gap": gap, "spec": dataclasses.asdict(spec),
                "made_by": "scripts/make_transformers_fixtures.py"}
        (target / "fixture.json").write_text(json.dumps(meta, indent=1) + "\n")
        print(f"{version}/{spelling}: seed {seed}, router gap {gap:.2e}, "
              f"{sum(f.stat().st_size for f in target.iterdir()) / 1024:.0f} KB")


def ensure_venv(version: str, root: Path) -> Path:
    venv = root / f"tfvenv-{version}"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    ok = subprocess.run([str(python), "-c", f"import transformers, sys; sys.exit(transformers.__version__ != {version!r})"],
                        capture_output=True)
    if ok.returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"transformers=={version}"], check=True)
    import torch

    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # Appended after the venv's own site-packages, so its transformers wins and torch comes from here.
    Path(purelib, "zz_k3verify_torch.pth").write_text(str(Path(torch.__file__).parent.parent) + "\n")
    return python


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--versions", nargs="+", default=list(VERSIONS))
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--venv-root", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    p.add_argument("--worker", metavar="VERSION", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.out)
        return 0
    if args.venv_root.resolve().is_relative_to(REPO):
        raise SystemExit(f"--venv-root must be outside the repository, got {args.venv_root}")
    for version in args.versions:
        python = ensure_venv(version, args.venv_root)
        subprocess.run([str(python), __file__, "--worker", version, "--out", str(args.out / version)],
                       check=True, cwd=REPO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
