"""Write golden/k3-mini: config, weights, tokenizer and a sha256 manifest.

Without --from, the weights are the seeded k3-mini init (a placeholder until a trained
checkpoint replaces it, see optimized_stack/train.py); with --from DIR, a trained
checkpoint directory is copied in and the manifest is remade.

    python scripts/make_default_model.py [--from DIR] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from optimized_stack.checkpoint import file_sha256, save_checkpoint  # noqa: E402
from optimized_stack.loading import DEFAULT_MODEL, load_model  # noqa: E402
from optimized_stack.presets import init_model, preset_config  # noqa: E402
from optimized_stack.tokenizer import ByteTokenizer  # noqa: E402


def write_manifest(directory: Path, provenance: dict) -> dict:
    files = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != "manifest.json")
    manifest = {"name": directory.name, "files": {f: file_sha256(directory / f) for f in files},
                "provenance": provenance}
    tmp = directory / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(directory / "manifest.json")
    return manifest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--from", dest="src", help="a trained checkpoint directory to install")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = DEFAULT_MODEL
    out.mkdir(parents=True, exist_ok=True)
    if args.src:
        src = Path(args.src)
        model = load_model(src)                      # validates before anything is copied
        save_checkpoint(model, out)
        for extra in ("train_config.json", "train_log.txt"):
            if (src / extra).is_file():
                shutil.copyfile(src / extra, out / extra)
        provenance = {"kind": "trained", "source": str(src)}
    else:
        model = init_model(preset_config("k3-mini"), seed=args.seed)
        save_checkpoint(model, out)
        provenance = {"kind": "seeded-random-init", "preset": "k3-mini", "seed": args.seed,
                      "command": f"python scripts/make_default_model.py --seed {args.seed}"}
    ByteTokenizer().save(out)
    manifest = write_manifest(out, provenance)
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
