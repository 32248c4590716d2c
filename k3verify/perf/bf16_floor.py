"""bf16's noise on one model, beside what each approx toggle and mutant adds to it: the figures a
bf16 drift budget is declared from, before a GPU run judges against it.

    python -m k3verify.perf.bf16_floor [--model M] [--toggles a,b,...] [--scenarios ...] [--out F]

Per scenario (teacher-forced, as the drift checks are):
- `floor`: the model in bf16 against itself in fp32 (the rule behind BF16_NOISE in
  optimized_stack/toggles.py: the budget is twice the worst floor);
- one row per toggle or mutant: the model in bf16 with it against the model in bf16 without it.
  This is what a GPU selftest compares (candidate and reference both bf16), so the rows of the
  legitimate toggles are the noise a reordering adds, and a budget that a mutant must fail has
  to sit between those rows and the mutant's.
Run it on the CPU, where it is reproducible (the numbers of the GPU differ in the last bits, not in
scale: golden/reports/gpu-2026-12-02-h200-release-3/). A bad name exits 2 with one line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from optimized_stack import K3Error, load_model
from optimized_stack import toggles as registry

from ..compare.captures import measure_drift
from ..io import atomic_write_text
from ..run.sequential import run_scenario
from ..scenarios import workloads

SCENARIOS = ("single", "multi_length", "boundaries", "long_prompt")


def _forced(model, sc, ref, names=()):
    return run_scenario(model, sc, tuple(names), keep=True,
                        force={rid: rc.tokens for rid, rc in ref.requests.items()})


def _row(scenario: str, what: str, kind: str, ref, cand) -> dict:
    drift = measure_drift(ref, cand)
    f = drift.logits
    if f is None:
        raise K3Error(f"{what} on {scenario}: no logits rows in common with the reference")
    return {"scenario": scenario, "what": what, "kind": kind, "rows": f.n_rows, "kl_max": f.kl_max,
            "kl_mean": f.kl_mean, "top1": f.top1_agreement, "state_rel": drift.state_rel_max}


def measure(model_name: str | None, names: list[str], scenarios: list[str], scale: float,
            device: str = "cpu") -> list[dict]:
    fp32 = load_model(model_name, device=device)
    bf16 = load_model(model_name, device=device, dtype=torch.bfloat16)
    rows = []
    for name in scenarios:
        sc = workloads.build(name, scale=scale)
        ref32 = run_scenario(fp32, sc, (), keep=True)
        rows.append(_row(name, "floor", "bf16 against fp32", ref32, _forced(bf16, sc, ref32)))
        ref16 = run_scenario(bf16, sc, (), keep=True)
        for t in names:
            rows.append(_row(name, t, registry.get(t).kind, ref16, _forced(bf16, sc, ref16, (t,))))
        print(f"{name}: done", file=sys.stderr, flush=True)
    return rows


def render(rows: list[dict]) -> str:
    lines = [f"{'scenario':14s} {'against its reference':36s} {'kind':18s} {'rows':>5s} {'max KL':>9s} "
             f"{'mean KL':>9s} {'top-1':>6s} {'state':>7s}"]
    for r in rows:
        lines.append(f"{r['scenario']:14s} {r['what']:36s} {r['kind']:18s} {r['rows']:5d} {r['kl_max']:9.3g} "
                     f"{r['kl_mean']:9.3g} {r['top1']:6.3f} {r['state_rel']:7.3g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3verify.perf.bf16_floor", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="preset or checkpoint directory (default: the embedded model)")
    ap.add_argument("--toggles", default="", help="approx toggles and mutants, comma list")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    names = [t for t in args.toggles.split(",") if t]
    scenarios = [s for s in args.scenarios.split(",") if s]
    known = {t.name for t in registry.all_toggles()}
    bad = [t for t in names if t not in known] + [s for s in scenarios if s not in workloads.SCENARIOS]
    if bad:
        print(f"error: unknown toggle or scenario: {', '.join(bad)}", file=sys.stderr)
        return 2
    if not args.scale > 0:
        print(f"error: --scale must be > 0, got {args.scale}", file=sys.stderr)
        return 2
    try:
        rows = measure(args.model, names, scenarios, args.scale, args.device)
    except K3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(rows))
    if args.out is not None:
        atomic_write_text(args.out, json.dumps({"model": args.model or "embedded", "scale": args.scale,
                                                "device": args.device, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
