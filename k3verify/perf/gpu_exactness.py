"""The GPU exactness run (issue 18) in one process: is the GPU reference profile batch-invariant
at every op and shape the models use, how far is it from the CPU fp32 reference, is every exact
toggle bit-identical to it on the GPU, is every mutant caught, and what does exactness cost.

    python -m k3verify.perf.gpu_exactness --out DIR [--sections invariance,drift,fla,exact,approx,price]
                                     [--budget-s S]

Sections (in this order, most wanted first; each item is saved as it finishes, so a run cut by its
time limit keeps what it measured):
- invariance: k3verify/invariance.py on the embedded k3-mini and on k3-small, bf16 (every row op
  at every shape, M = 1..32 ... 4096; negative controls fp32 cuBLAS, fla varlen, BLOCK_K by M);
- drift: the GPU reference (bf16, the profile) against the CPU fp32 reference, teacher-forced on
  the CPU tokens, judged against the CPU bf16 noise floor with a negative control (gpu_drift.py);
- fla: fla chunk_kda against fused_recurrent_kda at T around the 64-token grid and head sizes 16
  and 128 (why kda_fla_chunk drifts where it does);
- exact: every exact world-size-1 toggle judged bitwise against the GPU reference on its default
  scenarios, then every mutant of those toggles: caught? (gpu_verdicts.py);
- approx: the approx kernel toggles that run on CUDA and their mutants, on the bf16 budget their
  contracts declare for cuda:bfloat16 (optimized_stack/toggles.py BF16_NOISE);
- price: the same workloads on the invariant profile and on torch's own forms
  (K3_GPU_PROFILE=torch), interleaved A/B, ratio with a 95% interval (k3-small, bf16; gpu_price.py).
summary.json (issue 18 item 6) is written beside the report at the end of every section.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from optimized_stack import load_model
from optimized_stack import toggles as registry

from k3verify.compare import invariance
from k3verify.io import atomic_write_json, atomic_write_text
from k3verify.run.runner import Runner

from . import gpu_drift, gpu_price, gpu_verdicts
from .gpu_exactness_report import render, slim, summary
from .run_doc import RunDoc

# k3-mini work first (fla's head size 16), then k3-small's (head 128, compiled meanwhile)
SECTIONS = ("invariance_mini", "controls", "exact", "mutants", "drift", "price", "invariance_small", "approx", "fla")


class Run(RunDoc):
    """Sections' items, saved after every item: gpu_exactness[_TAG].json; without a tag also the
    Markdown and summary.json (parallel lanes write tagged JSON, `--merge` joins them)."""

    def __init__(self, out: Path, budget_s: float, tag: str = ""):
        super().__init__(out, budget_s)
        self.tag = tag

    def save(self) -> None:
        if self.tag:
            atomic_write_json(self.out / f"gpu_exactness_{self.tag}.json", self.doc, allow_nan=True)
            return
        write_all(self.out, self.doc)


def write_all(out: Path, doc: dict[str, Any]) -> None:
    atomic_write_json(out / "gpu_exactness.json", doc, allow_nan=True)
    atomic_write_json(out / "summary.json", summary(doc), allow_nan=True)
    atomic_write_text(out / "gpu_exactness.md", render(doc))


ITEM_KEYS = ("toggle", "model", "scenario", "mode", "heads", "head_dim", "tokens", "steps", "dots", "workload",
             "section")


def _item_key(item: dict[str, Any]) -> tuple:
    return tuple(item.get(k) for k in ITEM_KEYS)


def merge(paths: list[Path], supersede: bool = False) -> dict[str, Any]:
    """Lanes' documents into one: sections concatenated in lane order, logs prefixed by lane.
    With `supersede` (documents of successive device calls, oldest first) an item of a later
    document replaces the earlier one with the same key (toggle, model, scenario + mode, ...),
    so a re-run after a fix replaces its first verdict; the log keeps both."""
    import json
    doc: dict[str, Any] = {"sections": {}, "log": [], "lanes": []}
    for p in paths:
        lane = json.loads(p.read_text(encoding="utf-8"))
        tag = p.stem.removeprefix("gpu_exactness_")
        if supersede:
            tag = p.parent.name + "/" + tag
        doc["lanes"].append(tag)
        for key in ("environment", "driver", "fla"):
            doc.setdefault(key, lane.get(key))
        for name, items in lane.get("sections", {}).items():
            have = doc["sections"].setdefault(name, [])
            earlier = len(have)                      # only an earlier document's items are replaced
            for item in items:
                same = [i for i, old in enumerate(have[:earlier]) if supersede and _item_key(old) == _item_key(item)]
                if same:
                    have[same[0]] = {**item, "superseded_by": tag}
                else:
                    have.append(item)
        doc["log"] += [f"[{tag}] {line}" for line in lane.get("log", [])]
    return doc


# ---- sections ---------------------------------------------------------------------------------------
def section_invariance(run: Run, sources: list[tuple[str, str | None]]) -> None:
    for label, src in sources:
        if run.left() < 60:
            run.add("invariance", {"model": label, "status": "skip", "reason": "time budget spent"})
            continue
        t0 = time.perf_counter()
        model = load_model(src, device="cuda", dtype=torch.bfloat16)
        res = invariance.run(model)
        summ = res.summary()
        item = {"model": label, "status": summ["invariance"], "rows": summ["rows"], "cases": summ["cases"],
                "failed_rows": len(res.failures), "failures": [slim(r) for r in res.failures[:12]],
                "negative_controls": [slim(c) for c in res.controls],
                "negative_controls_failed": summ["negative_controls_failed"],
                "rule": "no row differs and every required control fails (informational: "
                        f"{', '.join(invariance.INFORMATIONAL_CONTROLS)})",
                "profile": res.environment.get("profile"), "wall_s": time.perf_counter() - t0}
        run.log(f"invariance {label}: {item['status']}: {item['rows']} rows, {item['failed_rows']} failed; "
                f"controls failed as they must: {item['negative_controls_failed']}")
        run.add("invariance", item)
        del model
        torch.cuda.empty_cache()


def section_controls(run: Run) -> None:
    """invariance's negative controls alone (each must FAIL its comparison), on k3-mini bf16."""
    model = load_model(None, device="cuda", dtype=torch.bfloat16)
    cases = invariance.plan(model)
    ms = invariance.DEFAULT_MS
    for c in invariance.negative_controls(cases, ms, ms[-1], model.lm_head.weight.device):
        item = slim(c)
        run.log(f"control {item['toggle']}: {'failed as it must' if item.get('caught') else 'NOT CAUGHT'}: "
                f"{str(item.get('reason'))[:140]}")
        run.add("controls", item)


def section_exact(run: Run, gpu_model, refs: Runner, only: set[str] | None = None) -> None:
    names = [n for n in gpu_verdicts.exact_toggles() if only is None or n in only]
    for name in names:
        if run.left() < 40:
            run.add("exact", {"toggle": name, "status": "skip", "reason": "time budget spent"})
            continue
        t0 = time.perf_counter()
        try:
            results = gpu_verdicts.judge(gpu_model, name, refs)
            item = gpu_verdicts.verdict(name, results)
        except Exception as exc:                  # a kernel that does not run is a verdict too
            item = {"toggle": name, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:400]}
        item["wall_s"] = time.perf_counter() - t0
        run.log(f"exact {name}: {item['status']} {str(item.get('reason', ''))[:150]}")
        run.add("exact", item)


def section_mutants(run: Run, gpu_model, refs: Runner, only: set[str] | None = None) -> None:
    """Every mutant of the exact toggles (of those in `only`, when given): caught on the GPU?"""
    of = [n for n in gpu_verdicts.exact_toggles() if only is None or n in only]
    _mutants(run, "exact_mutants", gpu_model, refs, of)


def _mutants(run: Run, section: str, model, refs, of: list[str]) -> None:
    for m in registry.all_toggles("mutant"):
        if m.mutant_of not in of or "cuda" not in m.devices:
            continue
        if run.left() < 30:
            run.add(section, {"toggle": m.name, "mutant_of": m.mutant_of, "status": "skip", "caught": None,
                              "reason": "time budget spent"})
            continue
        t0 = time.perf_counter()
        try:
            if m.mutant_of in gpu_verdicts.GRID_SCENARIOS:
                item = gpu_verdicts.judge_on_grid(model, refs, m, gpu_verdicts.GRID_SCENARIOS[m.mutant_of])
            else:
                item = slim(gpu_verdicts.judge_one(model, m, refs))
        except Exception as exc:
            item = {"toggle": m.name, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:400]}
        status = item.get("status")
        item.update(mutant_of=m.mutant_of, caught=True if status == "pass" else None if status == "skip" else False,
                    wall_s=time.perf_counter() - t0)
        word = {True: "caught", None: "skip", False: "MISSED"}[item["caught"]]
        run.log(f"{section} {m.name}: {word} {str(item.get('reason'))[:140]}")
        run.add(section, item)


def section_approx(run: Run, gpu_model, refs: Runner, only: set[str] | None = None) -> None:
    """Every approx toggle that runs on one GPU (those in `only`, when given) within its budget
    for cuda:bfloat16, then their mutants: caught?"""
    names = [t.name for t in registry.all_toggles("optimization")
             if t.contract.kind == "approx" and "cuda" in t.devices and 1 in t.world_sizes
             and (only is None or t.name in only)]
    # a diagnostic lane (K3VERIFY_DRIFT_NOTE, e.g. fla's dots in IEEE) reports beside the verdicts
    note = os.environ.get("K3VERIFY_DRIFT_NOTE", "")
    section, mut_section = ("approx", "approx_mutants") if not note else ("approx_diagnostic", "approx_mutants_diagnostic")
    for name in names:
        if run.left() < 40:
            run.add(section, {"toggle": name, "status": "skip", "reason": "time budget spent"})
            continue
        t0 = time.perf_counter()
        try:
            results = gpu_verdicts.judge(gpu_model, name, refs)
            bad = [r for r in results if r.status in ("fail", "error")]
            worst = max((r.evidence.get("kl_max", 0.0) for r in results if r.evidence), default=None)
            worst_mean = max((r.evidence.get("kl_mean", 0.0) for r in results if r.evidence), default=None)
            budget = registry.get(name).contract.for_run("cuda", gpu_model.lm_head.weight.dtype)
            item = {"toggle": name, "status": "fail" if bad else "pass", "kl_max": worst, "kl_mean": worst_mean,
                    "top1_min": min((r.evidence.get("top1_agreement", 1.0) for r in results if r.evidence),
                                    default=None), "budget": budget.describe(),
                    "reason": (f"{bad[0].scenario}: {bad[0].reason}" if bad else
                               f"within budget on {len({r.scenario for r in results})} scenarios")}
        except Exception as exc:
            item = {"toggle": name, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:400]}
        item["wall_s"] = time.perf_counter() - t0
        run.log(f"approx {name}: {item['status']} {str(item.get('reason'))[:150]}")
        if note:
            item["note"] = note
        run.add(section, item)
    _mutants(run, mut_section, gpu_model, refs, names)


def _wait(run: Run, spec: str, tag: str, limit_s: float = 150.0) -> None:
    """Wait (bounded) for a warm-up process's done-file, e.g. K3VERIFY_WAIT_FOR=16:/tmp/w16,128:/tmp/w128."""
    paths = dict(p.split(":", 1) for p in spec.split(",") if ":" in p)
    path = paths.get(tag)
    if not path:
        return
    t0 = time.monotonic()
    while not Path(path).exists() and time.monotonic() - t0 < min(limit_s, max(0.0, run.left() - 60)):
        time.sleep(2)
    run.log(f"warm-up {tag}: {'ready' if Path(path).exists() else 'not ready, going on'} after "
            f"{time.monotonic() - t0:.0f} s")


def _driver() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except Exception:                         # noqa: BLE001 - a fingerprint field, never fatal
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3verify.gpu_exactness")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--budget-s", type=float, default=500.0)
    ap.add_argument("--only", default="", help="exact / mutants / approx sections: only these toggles (comma list)")
    ap.add_argument("--tag", default="", help="a parallel lane: write gpu_exactness_TAG.json only")
    ap.add_argument("--model", default=None, help="the model the exact / mutants / approx sections judge "
                    "(default: the embedded k3-mini; k3-small has K3's head dims)")
    ap.add_argument("--merge", nargs="+", type=Path, default=None,
                    help="join lanes' gpu_exactness_TAG.json into gpu_exactness.{json,md} + summary.json in --out")
    ap.add_argument("--supersede", action="store_true",
                    help="with --merge: documents of successive calls, oldest first; a later item replaces an earlier one")
    args = ap.parse_args(argv)
    if args.merge:
        args.out.mkdir(parents=True, exist_ok=True)
        missing = [p for p in args.merge if not p.is_file()]
        if missing:
            print(f"error: --merge: no such file {missing[0]}", file=sys.stderr)
            return 2
        write_all(args.out, merge(args.merge, supersede=args.supersede))
        return 0
    sections = [x for x in args.sections.split(",") if x]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        print(f"error: unknown section {unknown[0]!r}; expected some of {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the GPU exactness run needs CUDA; torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, args.budget_s, args.tag)
    only = {t for t in args.only.split(",") if t} or None
    run.doc["driver"] = _driver()
    run.doc["fla"] = invariance._version("fla-core")
    run.doc["fla_dots"] = os.environ.get("K3_FLA_DOTS", "fla")
    gpu_model = cpu_model = None
    if set(sections) & {"drift", "exact", "mutants", "approx"}:
        gpu_model = load_model(args.model, device="cuda", dtype=torch.bfloat16)
        run.doc["model"] = args.model or "k3-mini (embedded)"
        cpu_model = load_model(args.model)
    refs = Runner(gpu_model) if gpu_model is not None else None      # reference captures, shared by sections
    wait_for = os.environ.get("K3VERIFY_WAIT_FOR", "")       # files the warm-up processes write when done
    steps = {"invariance_mini": lambda: section_invariance(run, [("k3-mini (embedded)", None)]),
             "controls": lambda: section_controls(run),
             "invariance_small": lambda: (_wait(run, wait_for, "128"),
                                          section_invariance(run, [("k3-small", "k3-small")])),
             "drift": lambda: gpu_drift.section(run, cpu_model, gpu_model), "fla": lambda: gpu_drift.section_fla(run),
             "exact": lambda: section_exact(run, gpu_model, refs, only),
             "mutants": lambda: section_mutants(run, gpu_model, refs, only),
             "approx": lambda: section_approx(run, gpu_model, refs, only),
             "price": lambda: gpu_price.section_price(run)}
    if sections and sections[0] in ("invariance_mini", "controls", "drift", "exact", "mutants", "approx"):
        _wait(run, wait_for, "16")
    for name in SECTIONS:
        if name not in sections:
            continue
        if name in ("fla", "price", "invariance_small"):
            _wait(run, wait_for, "128")
        try:
            steps[name]()
        except Exception as exc:              # noqa: BLE001 - one section's crash must not lose the others
            run.log(f"section {name} crashed: {type(exc).__name__}: {exc}")
            run.add("errors", {"section": name, "reason": f"{type(exc).__name__}: {exc}"[:600]})
    run.log("done")
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
