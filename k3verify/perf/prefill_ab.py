"""Whole-prompt prefill speed of named toggle sets against the reference path, in one process
(issue 27 item 3: a fast prefill).

    python -m k3verify.perf.prefill_ab --out DIR [--model k3-small] [--device cuda] [--dtype bfloat16]
        [--tokens 4096,32768] [--repeats 5] [--sets "mla_flash_bf16;mla_sdpa;phase"] [--peer] [--profile N]

Each set is a `+`-joined list of toggles; `phase` is the GPU prefill phase's set (the CUDA toggles
that name "prefill" in their `phases`), `phase/X` is that set with its attention form replaced
by toggle X, so a new attention kernel is timed beside the rest of the fast prefill as it would
ship, and `phase+Y` (or `phase/X+Y`) adds toggle Y to it. Every (length, set) pair is an interleaved A/B against the reference (perf/ab.py) after an
untimed warm pair; the sets share the process, so fla and Triton pick their tiles once for all
of them. --peer adds transformers' KimiLinear at the model's dims (perf/transformers_kimi.py, no
mask, no cache: its fastest whole-prompt forward) as an interleaved A/B against the last set, in
the same process and after the same warm pair (issue 27's fair baseline). Speed only: whether a
set's speedup counts is the gates' verdict (`k3verify all`). --profile N then profiles one warm N-token
forward of every set (and of transformers with --peer) with torch.profiler: device ms by kernel family
(GEMM, attention, KDA, MoE routing, elementwise, copies) and the top kernels, the pointer to the next
lever. Writes DIR/prefill_ab.json (and DIR/prefill_kernels.txt) and prints a table.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import torch

from optimized_stack import load_model, toggles as toggle_registry
from optimized_stack.errors import K3Error

from ..io import atomic_write_json, atomic_write_text
from . import gpu_bench
from .gpu_suite import phase_set

# the prefill phase's attention slot: a set `phase/X` swaps these for X
_ATTENTION_FORMS = ("mla_sdpa", "mla_flash_bf16")


def resolve_set(text: str) -> tuple[str, ...]:
    """'a+b', 'phase', 'phase/X' or 'phase+Y' (either phase form with toggles added) -> the toggle
    names, each a registered toggle."""
    head, *more = [part.strip() for part in text.strip().split("+")]
    if head == "phase" or head.startswith("phase/"):
        names = list(phase_set("prefill"))
        if "/" in head:
            names = [n for n in names if n not in _ATTENTION_FORMS] + [head.split("/", 1)[1]]
    else:
        names = [head] if head else []
    names += [n for n in more if n]
    if not names:
        raise K3Error(f"prefill set {text!r}: names no toggle")
    for n in names:
        toggle_registry.get(n)                       # raises K3Error naming the unknown toggle
    return tuple(dict.fromkeys(names))


def run(model, tokens: list[int], sets: list[str], repeats: int, log=print) -> list[dict[str, Any]]:
    rows = []
    for n in tokens:
        for label in sets:
            names = resolve_set(label)
            r = gpu_bench.bench_prefill(model, n, names, repeats=repeats)
            r.update({"set": label, "toggles": list(names)})
            log(f"prefill {n:>6} {label:<24} {gpu_bench.fmt_ratio(r)}")
            rows.append(r)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def make_peer(model, dtype: torch.dtype, tokens: list[int]):
    from .transformers_kimi import KimiLinearPeer
    return KimiLinearPeer(model.config, dtype, str(model.device), max(tokens))


def peer_rows(model, peer, tokens: list[int], against: str, repeats: int, log=print) -> list[dict[str, Any]]:
    """transformers' whole-prompt forward vs the set `against`, interleaved (ratio > 1: ours faster)."""
    from .ab import interleaved
    names = resolve_set(against)
    rows = []
    for n in tokens:
        ids = gpu_bench._ids(n, model.config.vocab_size, 7).to(model.device)
        ours = gpu_bench._timed_fn(names, lambda: model.logits(ids))
        theirs = lambda: (peer.prefill(n), gpu_bench.sync())
        ab = interleaved(theirs, ours, repeats=repeats, tokens=n, labels=("transformers", against))
        r = {**gpu_bench.prefill_row(ab, n, repeats), "set": f"{against} vs transformers", "toggles": list(names),
             "reference": "transformers", "peer": peer.info}
        log(f"prefill {n:>6} {r['set']:<24} {gpu_bench.fmt_ratio(r)}")
        rows.append(r)
    return rows


# kernel families by name, first match wins (cuBLAS/CUTLASS GEMMs, our Triton kernels, fla's, torch's)
FAMILIES = (("gemm", r"gemm|cutlass|nvjet|sm90_|sm80_|cublas|matmul|_mm_|linear"),
            ("attention", r"attn|attention|flash|fmha|sdpa|softmax"),
            ("kda", r"kda|chunk_|fused_recurrent|delta|gated|conv1d|causal_conv"),
            ("moe", r"moe|expert|topk|sort|scatter|gather|index"),
            ("copies", r"copy|memcpy|memset|cat|fill|clone"),
            ("elementwise", r"elementwise|vectorized|reduce|norm|silu|sigmoid|exp|mul|add|triton"))


def family(name: str) -> str:
    low = name.lower()
    return next((f for f, pat in FAMILIES if re.search(pat, low)), "other")


def profile_forward(fn, label: str, tables: list[str], top: int = 25) -> dict[str, Any]:
    """One profiled call of `fn` (already warm): device ms by kernel family and the top kernels."""
    from torch.profiler import ProfilerActivity, profile
    gpu_bench.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        gpu_bench.sync()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0.0, 0])
            k[0] += e.device_time / 1e3
            k[1] += 1
    families: dict[str, float] = {}
    for name, (ms, _) in kernels.items():
        families[family(name)] = families.get(family(name), 0.0) + ms
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    tables.append(f"==== {label} ====\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=top))
    return {"device_ms": sum(ms for ms, _ in kernels.values()), "launches": sum(n for _, n in kernels.values()),
            "families_ms": dict(sorted(families.items(), key=lambda kv: -kv[1])),
            "top": [{"kernel": n[:160], "ms": ms, "count": c, "family": family(n)} for n, (ms, c) in ranked]}


def profiles(model, n: int, sets: list[str], peer, tables: list[str]) -> dict[str, Any]:
    ids = gpu_bench._ids(n, model.config.vocab_size, 7).to(model.device)
    out = {}
    for label in ["reference", *sets]:
        names = () if label == "reference" else resolve_set(label)
        fn = gpu_bench._timed_fn(names, lambda: model.logits(ids))
        fn()                                                   # warm at this length
        out[label] = profile_forward(fn, f"prefill {n} tokens: {label}", tables)
    if peer is not None:
        peer.prefill(n)
        out["transformers"] = profile_forward(lambda: peer.prefill(n), f"prefill {n} tokens: transformers", tables)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| tokens | set | baseline | baseline tok/s | set tok/s | speedup [95% CI] | repeats |",
           "|---:|---|---|---:|---:|---|---:|"]
    for r in rows:
        lo, hi = r["ci95"]
        out.append(f"| {r['tokens']} | {r['set']} | {r.get('reference', 'reference path')} | "
                   f"{r['tokens_per_s_reference']:.0f} | "
                   f"{r['tokens_per_s_candidate']:.0f} | {r['ratio']:.2f}x [{lo:.2f}, {hi:.2f}] | {r['repeats']} |")
    return "\n".join(out)


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive token counts, got {text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3verify.perf.prefill_ab", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="k3-small")
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--tokens", type=_ints, default=[4096, 32768])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sets", default="mla_flash_bf16;mla_sdpa;phase;phase/mla_flash_bf16")
    ap.add_argument("--peer", action="store_true", help="also transformers' KimiLinear against the last set")
    ap.add_argument("--profile", type=int, default=None, metavar="N",
                    help="then profile one warm N-token forward of each set (and the peer)")
    a = ap.parse_args(argv)
    try:
        if a.repeats < 1:
            raise K3Error(f"--repeats must be >= 1, got {a.repeats}")
        if a.profile is not None and a.profile < 1:
            raise K3Error(f"--profile must be a positive token count, got {a.profile}")
        sets = [s for s in a.sets.split(";") if s.strip()]
        for s in sets:
            resolve_set(s)                           # bad input fails before the model loads
        if a.device == "cuda" and not torch.cuda.is_available():
            raise K3Error("--device cuda: no CUDA device here")
        model = load_model(a.model, device=a.device, dtype=getattr(torch, a.dtype))
    except K3Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log = lambda m: print(m, file=sys.stderr, flush=True)
    rows = run(model, a.tokens, sets, a.repeats, log=log)
    peer = make_peer(model, getattr(torch, a.dtype), a.tokens + ([a.profile] if a.profile else [])) if a.peer else None
    if peer is not None:
        rows += peer_rows(model, peer, a.tokens, sets[-1], a.repeats, log=log)
    doc = {"model": a.model, "device": a.device, "dtype": a.dtype,
           "cuda_device": torch.cuda.get_device_name() if a.device == "cuda" else None,
           "tokens": a.tokens, "sets": sets, "rows": rows}
    atomic_write_json(a.out / "prefill_ab.json", doc)              # the A/B is on file before the profile
    if a.profile:
        tables: list[str] = []
        doc["profile"] = {"tokens": a.profile, "forwards": profiles(model, a.profile, sets, peer, tables)}
        for label, pr in doc["profile"]["forwards"].items():
            fam = ", ".join(f"{f} {ms:.1f}" for f, ms in pr["families_ms"].items())
            log(f"profile {a.profile} {label}: {pr['device_ms']:.1f} device ms, {pr['launches']} launches ({fam})")
        atomic_write_text(a.out / "prefill_kernels.txt", "\n\n".join(tables) + "\n")
        atomic_write_json(a.out / "prefill_ab.json", doc)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
