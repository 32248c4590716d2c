"""Issue 27's engine report in one file: the benches' own outputs merged into summary.json, with
each goal judged `met`, `missed` or `not measured` from its figure (never a pass without one).

    python -m k3verify.perf.engine_summary --out DIR/summary.json \\
        [--fair fair_bench's summary.json or fair_baseline.json] [--step-profile step_profile.json] [--fast fast_bench's summary.json]
        [--capture capture_overhead.json]

Session 10 wrote golden/reports/gpu-2026-12-02-h200-engine/summary.json by hand from two files; this
is that derivation as code, so a device call's files become the report without a person's reading.
Sources, by field:
- fair bench (perf/fair_bench.py): decode tok/s with intervals, transformers' best arm, the ratio's
  lower 95% bound at the headline batch, prefill tok/s of both;
- step profile (perf/step_profile.py): device activities per decode step by stack (kernels_per_step),
  and prefill steps by stack;
- fast bench (perf/fast_bench.py): the roofline fraction per batch and the agentic sessions;
- capture (perf/capture_bench.py): {"overhead": fraction, "device": ...} of the verifier's capture on
  the engine; only a cuda file's figure judges the GPU goal.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..io import ReadError, atomic_write_text, read_json

FORMAT = "k3verify.engine-summary"
# issue 27 item 4: (goal, target, comparison)
GOALS = {
    "decode_b64_lower95_vs_transformers": (10.0, ">="),
    "roofline_b64": (0.10, ">="),
    "roofline_b256": (0.15, ">="),
    "prefill_32k_vs_transformers": (1.0, ">="),
    "agentic_c64_tok_s": (30_000.0, ">="),
    "agentic_c64_prefix_reuse": (0.95, ">="),
    "capture_overhead_gpu": (0.05, "<="),
}


def judge(value: float | None, target: float, op: str) -> str:
    if value is None:
        return "not measured"
    return "met" if (value >= target if op == ">=" else value <= target) else "missed"


def _get(d: dict | None, *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def merge(fair: dict | None, step: dict | None, fast: dict | None, capture: dict | None,
          sources: list[str]) -> dict[str, Any]:
    """The summary: every figure with where it came from, then `goals` {name: {value, target, verdict}}."""
    out: dict[str, Any] = {"format": FORMAT, "derived_from": sources}
    if fair:
        out.update({k: v for k, v in fair.items() if k not in ("format",)})
    if step:
        by_batch: dict[str, dict[str, float]] = {}
        for cell in step.get("cells", []):
            by_batch.setdefault(str(cell.get("batch", cell.get("rows"))), {})[cell["stack"]] = \
                cell.get("device_activities_per_step")
        out["kernels_per_step"] = by_batch
        out["prefill_steps"] = step.get("prefill", [])
    if fast:
        out["roofline_fraction"] = fast.get("roofline_fraction")
        out["agentic"] = fast.get("agentic")
    # a CPU run of the capture bench is a smoke test, not the GPU goal's figure
    out["capture_overhead_gpu"] = _get(capture, "overhead") if _get(capture, "device") == "cuda" else None
    if capture is not None and out["capture_overhead_gpu"] is None:
        out["capture_overhead_note"] = f"the capture file's device is {_get(capture, 'device')!r}, not cuda"

    ratio = out.get("ratio_b64_lower95")
    pre, peer = _get(out, "prefill_tok_s", "32768"), None
    for key in out:
        if key.startswith("transformers_") and key.endswith("_prefill_tok_s"):
            peer = _get(out, key, "32768")
    agentic64 = next((a for a in (out.get("agentic") or []) if a.get("concurrency") == 64 and "tok_s" in a), None)
    values = {
        "decode_b64_lower95_vs_transformers": ratio,
        "roofline_b64": _get(out, "roofline_fraction", "64"),
        "roofline_b256": _get(out, "roofline_fraction", "256"),
        "prefill_32k_vs_transformers": pre / peer if pre and peer else None,
        "agentic_c64_tok_s": agentic64 and agentic64.get("tok_s"),
        "agentic_c64_prefix_reuse": agentic64 and agentic64.get("prefix_reuse"),
        "capture_overhead_gpu": out["capture_overhead_gpu"],
    }
    out["goals"] = {name: {"value": values[name], "target": f"{op} {target:g}", "verdict": judge(values[name], target, op)}
                    for name, (target, op) in GOALS.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3verify.perf.engine_summary", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    for name in ("fair", "step-profile", "fast", "capture"):
        ap.add_argument(f"--{name}", type=Path, default=None)
    args = ap.parse_args(argv)
    docs, sources = {}, []
    for name in ("fair", "step_profile", "fast", "capture"):
        path = getattr(args, name)
        if path is None:
            docs[name] = None
            continue
        try:
            docs[name] = read_json(path)
        except (ReadError, OSError, ValueError) as exc:      # ValueError: JSONDecodeError
            print(f"error: --{name.replace('_', '-')}: cannot read {path}: {exc}".splitlines()[0], file=sys.stderr)
            return 2
        if not isinstance(docs[name], dict):
            print(f"error: --{name.replace('_', '-')}: {path} is not a JSON object", file=sys.stderr)
            return 2
        if name == "fair" and isinstance(docs[name].get("summary"), dict):    # fair_baseline.json holds it
            docs[name] = docs[name]["summary"]
        sources.append(f"{name}: {path.name}")
    if not sources:
        print("error: give at least one of --fair, --step-profile, --fast, --capture", file=sys.stderr)
        return 2
    doc = merge(docs["fair"], docs["step_profile"], docs["fast"], docs["capture"], sources)
    atomic_write_text(args.out, json.dumps(doc, indent=1))
    width = max(len(n) for n in GOALS)
    for name, g in doc["goals"].items():
        value = "-" if g["value"] is None else f"{g['value']:.4g}"
        print(f"{name:{width}}  {value:>10}  {g['target']:>10}  {g['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
