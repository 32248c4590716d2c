"""The GPU run in one process: CUDA toggle verdicts (with their mutants), fla's split
invariance, counted speedups on k3-small, and tensor parallelism over NCCL.

    python -m k3verify.perf.gpu_suite --out DIR [--sections verdicts,split,bench,tp] [--budget-s S]

Each section appends to DIR/gpu_<sections>.json (rewritten atomically after every item,
so a run cut by its time limit keeps what it measured) and the Markdown beside it. A
speedup is *counted* only when every toggle in the candidate set passed its contract in
the verdicts section of the same run; otherwise the table says "not counted" and why.
scripts/gpu_suite.sh is the device command.
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

from k3verify.io import atomic_write_json, atomic_write_text
from k3verify.kinds import selftest
from k3verify.kinds.base import CheckSpec, Context, Unit
from k3verify.perf import gpu_bench
from k3verify.perf.gpu_render import render
from k3verify.perf.run_doc import RunDoc
from k3verify.verdict.result import Result, Subject
from optimized_stack import load_model
from optimized_stack import toggles as toggle_registry

# scenario scale of the verdicts: half-size cases keep the run inside one device call
SCALE = 0.5
PHASES = ("prefill", "decode")


# ---- what is judged and timed: read from the toggle registry, never listed here -----------------

def kernel_toggles() -> tuple[str, ...]:
    """Optimizations that swap op slots and run on CUDA, judged on the embedded model on one GPU;
    CUDA-only kernels first (most wanted first: the time budget may cut the tail)."""
    kernels = [t for t in toggle_registry.all_toggles("optimization") if t.ops and "cuda" in t.devices]
    return tuple(t.name for t in sorted(kernels, key=lambda t: (t.devices != ("cuda",), t.name)))


def kernel_mutants() -> tuple[str, ...]:
    """The mutants of those kernels (each a plausible bug of that very change)."""
    kernels = set(kernel_toggles())
    return tuple(t.name for t in toggle_registry.all_toggles("mutant") if t.mutant_of in kernels)


def engine_roots() -> tuple[str, ...]:
    """Exact engine toggles that need no other toggle (each scheduling / caching mechanism once):
    are they still bitwise when cuBLAS picks kernels by row count?"""
    return tuple(t.name for t in toggle_registry.all_toggles("optimization")
                 if t.engine and t.contract.kind == "exact" and not t.requires and "cuda" in t.devices)


def phase_set(phase: str) -> tuple[str, ...]:
    """The CUDA toggles that name `phase` in their `phases`: the candidate set the bench times."""
    return tuple(t.name for t in toggle_registry.all_toggles("optimization")
                 if phase in t.phases and "cuda" in t.devices)


class GpuRun(RunDoc):
    """The GPU run's document (sections of items, a log), saved after every item."""

    def __init__(self, out: Path, tag: str, budget_s: float):
        super().__init__(out, budget_s)
        self.tag = tag

    def save(self) -> None:
        atomic_write_json(self.out / f"gpu_{self.tag}.json", self.doc, allow_nan=True)
        atomic_write_text(self.out / f"gpu_{self.tag}.md", render(self.doc))


def _tp_names(world_size: int = 2) -> list[str]:
    """Every toggle and mutant that runs at W: optimizations first."""
    tp = [t for t in toggle_registry.all_toggles() if world_size in t.world_sizes]
    return [t.name for t in tp if t.kind == "optimization"] + [t.name for t in tp if t.kind == "mutant"]


def _judge(ctx: Context, name: str) -> dict[str, Any]:
    """One toggle's selftest unit (the same judgement `k3verify selftest` makes), as an item."""
    spec = CheckSpec(selftest.NAME, options={"scale": SCALE})
    t = toggle_registry.get(name)
    unit = Unit(selftest.NAME, spec.name, spec.options, name, selftest.scenario_for(t, SCALE))
    try:
        (res,) = selftest.run(unit, ctx)
    except Exception as exc:          # a kernel that does not run is a verdict too
        res = Result.errored(Subject.of(name), selftest.NAME, f"{type(exc).__name__}: {exc}"[:400])
    return _slim(res.to_dict())


def section_verdicts(s: GpuRun, model, names: tuple[str, ...] | None = None) -> dict[str, bool]:
    passed = {}
    with Context(model) as ctx:
        for name in names or (kernel_toggles() + kernel_mutants() + engine_roots()):   # most wanted first
            if s.left() < 60:
                s.add("verdicts", {"toggle": name, "status": "skip", "reason": "suite time budget spent"})
                continue
            t0 = time.perf_counter()
            item = _judge(ctx, name)
            item["wall_s"] = time.perf_counter() - t0
            passed[name] = item["status"] == "pass"
            s.log(f"verdict {name}: {item['status']} {item.get('reason', '')[:160]}")
            s.add("verdicts", item)
    return passed


def _slim(item: dict[str, Any]) -> dict[str, Any]:
    keep = ("toggle", "kind", "contract", "scenario", "status", "reason", "caught", "wall_s")
    return {k: item.get(k) for k in keep if k in item}


def section_split(s: GpuRun) -> None:
    """fla chunk_kda: prefill split at a multiple of 64 (state carried) == whole prefill, bitwise."""
    from optimized_stack.kernels.kda.fla import fla_chunk
    for heads, dim in ((4, 16), (8, 128)):
        gen = torch.Generator(device="cpu").manual_seed(heads)
        t_len = 512

        def rnd(*shape):
            return torch.randn(*shape, generator=gen).cuda()
        q = torch.nn.functional.normalize(rnd(t_len, heads, dim), dim=-1) * dim ** -0.5
        k = torch.nn.functional.normalize(rnd(t_len, heads, dim), dim=-1)
        v, g = rnd(t_len, heads, dim), -torch.rand(t_len, heads, dim, generator=gen).cuda()
        beta = torch.rand(t_len, heads, generator=gen).cuda()
        whole_o, whole_s = fla_chunk(q, k, v, g, beta, None)
        for split, mutant in ((64, False), (128, False), (256, False), (320, False), (63, False),
                              (100, False), (64, True)):
            o1, s1 = fla_chunk(q[:split], k[:split], v[:split], g[:split], beta[:split], None)
            o2, s2 = fla_chunk(q[split:], k[split:], v[split:], g[split:], beta[split:], s1, _drop_state=mutant)
            o = torch.cat([o1, o2])
            item = {"heads": heads, "head_dim": dim, "tokens": t_len, "split": split,
                    "mutant_drops_state": mutant, "output_bitwise": bool(torch.equal(o, whole_o)),
                    "state_bitwise": bool(torch.equal(s2, whole_s)),
                    "max_abs_output": float((o - whole_o).abs().max()),
                    "expected_bitwise": split % 64 == 0 and not mutant}
            item["status"] = ("pass" if item["output_bitwise"] and item["state_bitwise"] else "fail") \
                if item["expected_bitwise"] else ("caught" if mutant and not item["output_bitwise"] else "info")
            s.log(f"split H={heads} K={dim} at {split}{' (mutant)' if mutant else ''}: "
                  f"out {item['output_bitwise']} state {item['state_bitwise']} -> {item['status']}")
            s.add("split", item)


def section_invariance(s: GpuRun, model) -> None:
    """Is a row's GEMM result independent of how many rows share the call? F.linear (cuBLAS,
    the reference on the GPU) against tiled_row_linear (fixed [8, D] tiles); then the exact
    engine toggles judged with the tiled form as the reference's linear."""
    from optimized_stack.model import ops
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(1536, 768, generator=gen).cuda() * 0.03
    x = torch.randn(256, 768, generator=gen).cuda()
    for label, fn in (("F.linear (cuBLAS)", torch.nn.functional.linear), ("tiled_row_linear", ops.tiled_row_linear)):
        full = fn(x, w)
        same = {m: bool(torch.equal(fn(x[:m], w), full[:m])) for m in (1, 3, 8, 13, 64, 100, 200)}
        item = {"gemm": label, "rows_equal_to_256_row_call": same, "status": "pass" if all(same.values()) else "fail"}
        s.log(f"invariance {label}: {same}")
        s.add("invariance", item)
    with Context(model) as ctx, ops.override(linear=ops.tiled_row_linear):
        for name in engine_roots():
            if s.left() < 45:
                s.add("invariance", {"toggle": name, "status": "skip", "reason": "suite time budget spent"})
                continue
            item = _judge(ctx, name)
            item["reference_linear"] = "tiled_row_linear"
            s.log(f"invariance {name} with tiled GEMMs: {item['status']} {str(item.get('reason'))[:120]}")
            s.add("invariance", item)


DEFAULT_BENCH = "prefill:4096:3:ref,prefill:32768:2,decode:1:3,decode:8:3,decode:64:3,decode:256:3"


def _bench_plan(text: str) -> list[tuple[str, int, int, bool]]:
    """'kind:n:repeats[:ref]' items -> (kind, n, repeats, with_reference); decode always has a reference."""
    plan = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) < 3 or parts[0] not in ("prefill", "decode"):
            raise ValueError(f"bench item: expected prefill|decode:N:REPEATS[:ref], got {item!r}")
        plan.append((parts[0], int(parts[1]), int(parts[2]), parts[0] == "decode" or parts[3:] == ["ref"]))
    return plan


def section_bench(s: GpuRun, passed: dict[str, bool], bench_model: str, plan_text: str = DEFAULT_BENCH) -> None:
    model = load_model(bench_model, device="cuda")
    bw = gpu_bench.hbm_copy_bandwidth()
    s.doc["hbm_copy_bytes_per_s"] = bw
    s.log(f"bench model {bench_model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params; "
          f"HBM copy {bw / 1e12:.2f} TB/s")
    for label, wanted in ((phase, phase_set(phase)) for phase in PHASES):
        ok = tuple(t for t in wanted if passed.get(t))
        s.doc.setdefault("candidate_sets", {})[label] = {
            "toggles": list(ok), "left_out": {t: "contract not passed in this run" for t in wanted if t not in ok}}
    pre = s.doc["candidate_sets"]["prefill"]["toggles"]
    dec = s.doc["candidate_sets"]["decode"]["toggles"]
    for kind, n, repeats, with_ref in _bench_plan(plan_text):
        if s.left() < 90:
            s.add("bench", {"workload": f"{kind} {n}", "status": "skip", "reason": "suite time budget spent"})
            continue
        t0 = time.perf_counter()
        try:
            if kind == "prefill":
                r = gpu_bench.bench_prefill(model, n, tuple(pre), repeats=repeats, with_reference=with_ref)
                r["toggles"] = list(pre)
            else:
                r = gpu_bench.bench_decode(model, n, 512, tuple(dec), steps=4 if n <= 64 else 2, repeats=repeats,
                                           hbm_bytes_per_s=bw, fast_prefill=tuple(pre))
                r["toggles"] = list(dec)
            r["counted"] = bool(r["toggles"]) and r.get("ratio") is not None
            r["why"] = ("every toggle in the set passed its contract in this run" if r["counted"] else
                        "no reference timing" if r.get("ratio") is None else "no toggle passed")
        except Exception as exc:
            r = {"workload": f"{kind} {n}", "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:400]}
        r["wall_s"] = time.perf_counter() - t0
        s.log(f"bench {r['workload']}: {gpu_bench.fmt_ratio(r) if 'ratio' in r else r.get('reason')}")
        s.add("bench", r)
        torch.cuda.empty_cache()


def section_tp(s: GpuRun, model_path: str | None, backend: str = "nccl", world_size: int = 2) -> None:
    from k3verify.perf.ab import interleaved
    from k3verify.run.runner import Runner
    from k3verify.scenarios.chooser import choose
    from k3verify.scenarios.workloads import build
    from k3verify.verdict.gate import check_toggle
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        s.add("tp", {"status": "skip", "reason": f"needs {world_size} GPUs, found {torch.cuda.device_count()}"})
        return
    model = load_model(model_path)          # CPU copy: each rank moves it to its own GPU
    runner = Runner(model, world_size=world_size, backend=backend)
    try:
        for name in _tp_names(world_size):
            if s.left() < 45:
                s.add("tp", {"toggle": name, "status": "skip", "reason": "suite time budget spent"})
                continue
            t = toggle_registry.get(name)
            sc = build(choose(t, one=True, scale=SCALE).names[0], scale=SCALE)
            t0 = time.perf_counter()
            results = check_toggle(model, name, sc, runner=runner, localize_failures=False)
            failed = [r for r in results if r.status == "fail"]
            item = {"toggle": name, "kind": t.kind, "contract": t.contract.describe(), "scenario": sc.name,
                    "checks": {r.check: r.status for r in results},
                    "reason": "; ".join(r.reason for r in results)[:300]}
            if t.kind == "mutant":
                item["status"] = "caught" if failed else "missed"
            else:
                item["status"] = "pass" if not failed else "fail"
                ab = interleaved(lambda: runner.run(sc, ()), lambda: runner.run(sc, (name,)), repeats=3,
                                 tokens=1, labels=(f"tp{world_size} reference", name)).to_dict()
                item["speed"] = {"ratio": ab["ratio"], "ci95": ab["ci95"], "median_s_reference": ab["median_s_a"],
                                 "median_s_candidate": ab["median_s_b"], "counted": not failed}
            item["wall_s"] = time.perf_counter() - t0
            s.log(f"tp {name}: {item['status']} {item.get('speed', '')}")
            s.add("tp", item)
    finally:
        runner.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3verify.perf.gpu_suite")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--sections", default="verdicts,split,bench")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--model", default=None, help="model judged (default: the embedded k3-mini)")
    ap.add_argument("--bench-model", default="k3-small")
    ap.add_argument("--bench-items", default=DEFAULT_BENCH, help="kind:n:repeats[:ref],... (default: %(default)s)")
    ap.add_argument("--toggles", default="", help="judge only these (comma list) in the verdicts section")
    ap.add_argument("--world-size", type=int, default=2, choices=(2, 4, 8), help="ranks of the tp section (NCCL, one GPU each)")
    args = ap.parse_args(argv)
    sections = [x for x in args.sections.split(",") if x]
    unknown = sorted(set(sections) - {"verdicts", "invariance", "split", "bench", "tp"})
    if unknown:
        print(f"error: unknown section {unknown[0]!r}; expected verdicts, invariance, split, bench, tp",
              file=sys.stderr)
        return 2
    try:
        _bench_plan(args.bench_items)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the GPU suite needs CUDA; torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    s = GpuRun(args.out, "_".join(sections), args.budget_s)
    s.doc["driver"] = _driver()
    try:
        import fla
        s.doc["fla"] = fla.__version__
    except ImportError:
        s.doc["fla"] = None
    passed: dict[str, bool] = {}
    if "verdicts" in sections:
        names = tuple(t for t in args.toggles.split(",") if t) or None
        passed = section_verdicts(s, load_model(args.model, device="cuda"), names)
        s.doc["passed"] = passed
    elif os.environ.get("K3VERIFY_GPU_VERDICTS"):     # verdicts of an earlier process, same run
        import json
        prior = json.loads(Path(os.environ["K3VERIFY_GPU_VERDICTS"]).read_text())
        passed = prior.get("passed", {})
        s.doc["passed_from"] = os.environ["K3VERIFY_GPU_VERDICTS"]
    if "invariance" in sections:
        section_invariance(s, load_model(args.model, device="cuda"))
    if "split" in sections:
        section_split(s)
    if "bench" in sections:
        section_bench(s, passed, args.bench_model, args.bench_items)
    if "tp" in sections:
        s.doc["world_size"] = args.world_size
        section_tp(s, args.model, world_size=args.world_size)
    s.log("done")
    s.save()
    return 0


def _driver() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
