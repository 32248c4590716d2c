"""Distil a draft head for speculative decoding from a trained target (issue 28).

    nice python scripts/train_drafter.py --target golden/k3-mini --out golden/drafters/k3-mini

The data, in byte tokens, never the held-out splits the benchmark and the evals use:
- gsm8k-synth train split as lm-eval's few-shot text (scripts/train_k3mini.py gsm_row), data
  seeds from --data-seed on (the eval draws its shots from train seed 0 and questions from test);
- the scenario generator's English-like text (k3verify/scenarios/workloads.py), at seeds the
  verifier never builds (it builds seed 0).
The target runs once over all of it (teacher pass: final-norm states and logits), then the
head trains on CPU in a minute or two (optimized_stack/drafter_train.py). Writes the head's
config and safetensors (engine/drafter_model.py), train_log.txt, metrics.json and a manifest
with the sha256 of every file, the target's weights' sha256 and this exact command.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from k3verify.quality.evals import gsm8k_synth  # noqa: E402
from k3verify.scenarios import workloads  # noqa: E402
from optimized_stack import load_model  # noqa: E402
from optimized_stack.drafter_train import DrafterLoop, expected_acceptance, fit_head, teacher_pass  # noqa: E402
from optimized_stack.engine.drafter_model import CONFIG_FILE, WEIGHTS_FILE, file_sha256, save_drafter  # noqa: E402
from optimized_stack.errors import K3Error  # noqa: E402
from optimized_stack.model.ops import override, plain_linear  # noqa: E402
from optimized_stack.presets import PAD_ID  # noqa: E402
from train_k3mini import gsm_row  # noqa: E402

TEXT_SCENARIOS = ("agentic", "multi_turn", "single", "spec_repetitive")


def gsm_rows(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    pool: list[dict] = []
    rows = []
    while len(rows) < n:
        while len(pool) < 32:
            pool += gsm8k_synth.generate("train", 64, seed=rng.randrange(seed, 2**31), difficulty=rng.choice((1, 2, 2, 3)))
            rng.shuffle(pool)
        ids, _ = gsm_row(pool, length)
        del pool[:max(1, bytes(ids).count(b"Question:"))]
        rows.append(ids)
    return rows


def text_rows(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    """Prompts of the verifier's text scenarios at seeds it never uses, cut into rows."""
    rows: list[list[int]] = []
    s = seed
    while len(rows) < n:
        for name in TEXT_SCENARIOS:
            for r in workloads.build(name, seed=s, vocab=vocab).requests:
                ids = list(r.prompt_ids)
                rows += [ids[a:a + length] for a in range(0, len(ids), length) if len(ids) - a >= 64]
        s += 1
    return rows[:n]


def batch(rows: list[list[int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), length), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r[:length])] = torch.tensor(r[:length])
    return ids, ids != PAD_ID


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/train_drafter.py", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(ROOT / "golden" / "k3-mini"), help="the target's checkpoint directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gsm-rows", type=int, default=96)
    ap.add_argument("--text-rows", type=int, default=48)
    ap.add_argument("--row-len", type=int, default=1024)
    ap.add_argument("--held-out-rows", type=int, default=16)
    ap.add_argument("--data-seed", type=int, default=5000)
    ap.add_argument("--threads", type=int, default=1)
    for f in DrafterLoop.__dataclass_fields__.values():
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = ap.parse_args(argv)
    try:
        loop = DrafterLoop(**{f: getattr(args, f) for f in DrafterLoop.__dataclass_fields__})
        target_dir = Path(args.target)
        if not (target_dir / "model.safetensors").is_file():
            raise K3Error(f"--target: expected a checkpoint directory with model.safetensors, got {target_dir}")
        if min(args.gsm_rows, args.text_rows, args.held_out_rows) < 0 or args.row_len < 64:
            raise K3Error("--gsm-rows, --text-rows, --held-out-rows must be >= 0 and --row-len >= 64")
    except K3Error as exc:
        ap.error(str(exc))
    torch.set_num_threads(args.threads)
    log: list[str] = []

    def say(line: str) -> None:
        log.append(line)
        print(line, flush=True)

    target = load_model(target_dir)
    vocab = target.config.vocab_size
    t0 = time.monotonic()
    train_rows = (gsm_rows(args.gsm_rows, args.row_len, args.data_seed)
                  + text_rows(args.text_rows, args.row_len, args.data_seed + 1, vocab))
    held = (gsm_rows(args.held_out_rows, args.row_len, args.data_seed + 777)
            + text_rows(args.held_out_rows // 2, args.row_len, args.data_seed + 778, vocab))
    with override(linear=plain_linear):            # row-stable tiles are for inference
        teacher = teacher_pass(target, *batch(train_rows, args.row_len))
        held_teacher = teacher_pass(target, *batch(held, args.row_len))
    say(f"teacher pass: {len(train_rows)} rows x {args.row_len} (+{len(held)} held out) in "
        f"{time.monotonic() - t0:.0f}s; target {target_dir}")
    head = fit_head(target, teacher, loop, say=say)
    metrics = {"held_out": expected_acceptance(head, target, held_teacher, loop.k),
               "untrained_head": expected_acceptance(type(head)(head.cfg), target, held_teacher, loop.k),
               "train_seconds": round(time.monotonic() - t0, 1)}
    say("held-out " + json.dumps(metrics))

    out = Path(args.out)
    head.cfg = type(head.cfg)(**{**asdict(head.cfg), "target": target_dir.name})
    save_drafter(head, out)
    _write(out / "train_log.txt", "\n".join(log) + "\n")
    _write(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    files = [CONFIG_FILE, WEIGHTS_FILE, "train_log.txt", "metrics.json"]
    manifest = {"name": out.name, "files": {f: file_sha256(out / f) for f in files},
                "target": {"dir": target_dir.name, "model.safetensors": file_sha256(target_dir / "model.safetensors")},
                "provenance": {"kind": "distilled", "command": "nice python scripts/train_drafter.py "
                               + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
                               "loop": asdict(loop), "data_seed": args.data_seed, "gsm_rows": args.gsm_rows,
                               "text_rows": args.text_rows, "row_len": args.row_len, "threads": args.threads,
                               "torch": torch.__version__}}
    _write(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(metrics))
    return 0


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
