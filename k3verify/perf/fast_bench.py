"""The engine benchmark of issue 20, one run: the toggle stack, each row counted only after its
contract held in the same run, against transformers' Kimi Linear and the HBM roofline.

    python -m k3verify.perf.fast_bench --out DIR            # CUDA: k3-small bf16
    python -m k3verify.perf.fast_bench --out DIR --smoke    # CPU: k3-mini, B = 1, 2, no transformers

Sections (in this order, each skipped with its reason once --budget-s is spent):
1. contracts: every stack row runs a check workload (real prefills, greedy decode) on the
   benchmark model; its tokens and logits rows are compared with the row above: exact toggles
   bit for bit, approx ones within their declared budget (KL, top-1) over the positions where
   the token streams agree. A row counts only if it held, the fast path's own evidence shows it
   ran (fast steps, graph replays), and every row above it counts.
2. decode: tok/s of each row at B x context (engine steps, host work included; requests hold a
   real context copied, fast_bench_setup.py), the roofline fraction of each cell.
3. prefill: the reference path's whole-prompt prefill of each length (the stack does not change
   prefill).
4. transformers: KimiLinearForCausalLM at the same dims (transformers_kimi.py), bf16 and fp32.
5. agentic: sessions that re-send their history (prefix > 95% reusable) with a fork each, closed
   loop, the full exact stack, at each concurrency: total tok/s (cached input included), the
   per-user tok/s 90% of users get (p90), prefix reuse against the theoretical.
Writes DIR/engine_bench.json (everything) and DIR/summary.json (issue 20 item 6's fields), prints
a table, then one line of JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from optimized_stack import load_model, toggles
from .engine_bench import make_workload, run_sessions
from optimized_stack.engine.engine import Engine, EngineObserver
from optimized_stack.engine.options import EngineOptions, SamplingParams
from .fast_bench_setup import Donor, cache_tokens_for, decode_step_bytes, hbm_copy_bandwidth, seeded_engine, sync

# the stack: each row adds one toggle (with what it needs) on top of the rows above
STACK: list[tuple[str, tuple[str, ...]]] = [
    ("reference", ()),
    ("continuous_batching", ("continuous_batching",)),
    ("batched_decode", ("projected_kv_cache", "batched_decode")),
    ("cuda_graphs", ("cuda_graphs",)),
    # the fused decode kernels (exact; held on the H200 at k3-mini's and k3-small's dims, 2026-12-02
    # session 10). Under moe_grouped_static below, the combine is that toggle's own and the fused
    # combine does not run: the rows above it still time it
    ("fused_kda_conv", ("fused_kda_conv",)),
    ("fused_moe_combine", ("fused_moe_combine",)),
    # the routed experts' SiTU-GLU as one launch (exact; its engine brings the sorted prefill experts,
    # exact too, so the row above is still its bitwise reference)
    ("fused_situ", ("fused_situ",)),
    # the approx rows last, the one whose bf16 contract held first: a row that fails its contract
    # uncounts every row above it (the H200 run of 2026-12-01: mla_absorbed's KL 0.12 in bf16)
    ("moe_grouped_static", ("moe_grouped_static",)),
    ("mla_absorbed", ("mla_absorbed",)),
]
PAGED = ("continuous_batching", "prefix_cache", "preemption")


class _Logits(EngineObserver):
    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], torch.Tensor] = {}

    def on_logits(self, rid, start_pos, rows):
        rows = rows.float().cpu()
        for i in range(rows.shape[0]):
            self.rows[(rid, start_pos + i)] = rows[i]


def _rows_of(names: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
    out, acc = [], ()
    for label, added in STACK:
        acc = acc + tuple(t for t in added if t not in acc)
        out.append((label, acc))
    return [(label, acc) for label, acc in out if not names or label in names]


def _options(applied_engine: dict, extra: dict) -> EngineOptions:
    paged = any(applied_engine.get(k) for k in PAGED)
    return EngineOptions.from_dict({**applied_engine, **(extra if paged else {})})


# ---- 1. contracts ------------------------------------------------------------------------
def check_run(model, names: tuple[str, ...], prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    cap = _Logits()
    with toggles.applied(list(names)) as ap:
        opts = _options(ap.engine_for(model.device), {"max_num_seqs": len(prompts),
                                                      "kda_pool_slots": len(prompts), "token_budget": 4096})
        eng = Engine(model, opts, [cap])
        for i, p in enumerate(prompts):
            eng.add_request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), request_id=f"c{i}",
                            arrival_step=i % 3)
        results = eng.run()
    stats = eng.fast.stats if eng.fast is not None else None
    return {"tokens": {rid: r.tokens for rid, r in results.items()}, "rows": cap.rows,
            "prompt_lens": {f"c{i}": len(p) for i, p in enumerate(prompts)},
            "fast": None if stats is None else vars(stats).copy()}


def judge(added: str, ref: dict[str, Any], cand: dict[str, Any], device: str = "cpu",
          dtype: Any = None) -> dict[str, Any]:
    """The added toggle's contract (its budget on `device` in `dtype`), candidate against the row above."""
    contract = toggles.get(added).contract.for_run(device, dtype)
    same_tokens = ref["tokens"] == cand["tokens"]
    compared, differing, kls, agree = 0, 0, [], []
    for rid, toks in ref["tokens"].items():
        agree_len = next((i for i, (a, b) in enumerate(zip(toks, cand["tokens"][rid])) if a != b), len(toks))
        last = ref["prompt_lens"][rid] + agree_len           # rows up to the first parted token
        for pos in range(last):
            a, b = ref["rows"].get((rid, pos)), cand["rows"].get((rid, pos))
            if a is None or b is None:
                continue
            compared += 1
            differing += not torch.equal(a, b)
            if contract.kind == "approx":
                pa, lb = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
                kls.append(float((pa.exp() * (pa - lb)).sum()))
                agree.append(int(a.argmax()) == int(b.argmax()))
    out: dict[str, Any] = {"toggle": added, "contract": contract.describe(), "rows_compared": compared,
                           "rows_differing": differing, "same_tokens": same_tokens}
    if contract.kind == "exact":
        out["held"] = compared > 0 and differing == 0 and same_tokens
    else:
        kl_max = max(kls) if kls else math.inf
        top1 = sum(agree) / len(agree) if agree else 0.0
        out.update({"kl_max": kl_max, "kl_mean": statistics.fmean(kls) if kls else None, "top1": top1})
        mean = statistics.fmean(kls) if kls else math.inf
        out["held"] = bool(kls) and (contract.max_kl is None or kl_max <= contract.max_kl) and (
            contract.mean_kl is None or mean <= contract.mean_kl) and (
            contract.min_top1 is None or top1 >= contract.min_top1)
    return out


def _evidence(added: str, run: dict[str, Any]) -> str | None:
    """Why the row's own path cannot be shown to have run (None: it ran)."""
    fast = run["fast"]
    if added == "batched_decode" and (fast is None or not fast["steps"]):
        return "no fast decode step ran"
    if added == "cuda_graphs" and (fast is None or not fast["graph_replays"]):
        return f"no graph replay ({fast and fast['eager_reason']})"
    return None


def section_contracts(model, rows, args, log) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(11)
    lengths = args.check_lengths
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    out, prev, counted = [], None, True
    for label, names in rows:
        added = label
        if not all(model.device.type in toggles.get(n).devices for n in names):
            out.append({"row": label, "toggles": list(names), "held": None, "counted": False,
                        "reason": f"not on {model.device.type}"})
            counted = False
            continue
        t0 = time.perf_counter()
        run = check_run(model, names, prompts, args.check_new)
        item: dict[str, Any] = {"row": label, "toggles": list(names), "check_s": time.perf_counter() - t0,
                                "fast": run["fast"]}
        if prev is None:
            item.update({"held": True, "reason": "the baseline"})
        else:
            item.update(judge(added, prev, run, model.device.type, next(model.parameters()).dtype))
            why = _evidence(added, run)
            if why:
                item.update({"held": False, "reason": f"not exercised: {why}"})
        counted = counted and bool(item["held"])
        item["counted"] = counted
        out.append(item)
        log(f"contract {label}: held={item['held']} counted={counted} {item.get('reason', '')}")
        prev = run
    return out


# ---- 2. decode -------------------------------------------------------------------------------
def decode_cell(model, names: tuple[str, ...], donor: Donor, batch: int, args, hbm: float | None) -> dict[str, Any]:
    context = len(donor.ids)
    new = args.warmup + args.steps + 3
    with toggles.applied(list(names)) as ap:
        paged = any(ap.engine.get(k) for k in PAGED)
        if not paged and batch > 1:
            return {"skipped": "the reference engine runs one request at a time: its tok/s is B=1's"}
        opts = _options(ap.engine_for(model.device),
                        {"max_num_seqs": batch, "kda_pool_slots": batch, "token_budget": batch * (context + 1),
                         "device_cache_tokens": cache_tokens_for(batch, context, new)})
        eng = seeded_engine(model, opts, donor, batch, new)
        warm = []
        for _ in range(args.warmup + ("cuda_graphs" in names)):      # a graph's first step captures
            t0 = time.perf_counter()
            eng.step()
            sync()
            warm.append(time.perf_counter() - t0)
        est = max(warm[-1], 1e-6)
        steps = max(2, min(args.steps, int(args.cell_budget_s / est)))
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        secs = time.perf_counter() - t0
        fast = vars(eng.fast.stats).copy() if eng.fast is not None else None
    del eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    step_s = secs / steps
    cell = {"batch": batch, "context": context, "steps": steps, "step_ms": step_s * 1e3,
            "tok_s": batch / step_s, "warmup_ms": [w * 1e3 for w in warm], "fast": fast}
    if hbm:
        need = decode_step_bytes(model, batch, context + steps // 2)
        cell.update({"bytes_per_step": need["total"], "roofline_fraction": need["total"] / hbm / step_s})
    return cell


def section_decode(model, rows, contracts, args, hbm, deadline, log) -> list[dict[str, Any]]:
    out = []
    counted = {c["row"]: c["counted"] for c in contracts}
    ran = {c["row"] for c in contracts if c["held"] is not None}        # not skipped for the device
    cells = [(c, b) for c in args.contexts for b in args.batches]
    # the headline cell first: the largest batch <= 64 at the first context
    cells.sort(key=lambda cb: (cb[0] != args.contexts[0], abs(cb[1] - 64)))
    donors: dict[int, Donor] = {}
    for context, batch in cells:
        if context not in donors:
            donors[context] = Donor.prefill(model, context)
        for label, names in rows:
            if label not in ran:
                continue
            item: dict[str, Any] = {"row": label, "batch": batch, "context": context, "counted": counted[label]}
            if time.monotonic() > deadline:
                item["skipped"] = "budget spent"
            else:
                try:
                    item.update(decode_cell(model, names, donors[context], batch, args, hbm))
                except torch.cuda.OutOfMemoryError as exc:      # pragma: no cover - GPU only
                    item["skipped"] = f"out of memory: {str(exc).splitlines()[0]}"
                    torch.cuda.empty_cache()
            out.append(item)
            log(f"decode {label} B={batch} ctx={context}: {item.get('tok_s', item.get('skipped'))}")
    return out


# ---- 3. prefill ------------------------------------------------------------------------------
def section_prefill(model, args, deadline, log) -> list[dict[str, Any]]:
    out = []
    gen = torch.Generator().manual_seed(5)
    model.logits(torch.randint(0, model.config.vocab_size, (min(args.prefill) // 4 or 1,), generator=gen)
                 .to(model.device))                                              # warm-up
    for n in args.prefill:
        if time.monotonic() > deadline:
            out.append({"tokens": n, "skipped": "budget spent"})
            continue
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen).to(model.device)
        sync()
        t0 = time.perf_counter()
        model.logits(ids)
        sync()
        secs = time.perf_counter() - t0
        out.append({"tokens": n, "s": secs, "tok_s": n / secs})
        log(f"prefill {n}: {n / secs:.0f} tok/s")
    return out


# ---- 5. agentic ------------------------------------------------------------------------------
AGENTIC = ("continuous_batching", "chunked_prefill", "prefix_cache", "projected_kv_cache", "batched_decode")


def agentic_run(model, names: tuple[str, ...], concurrency: int, args) -> dict[str, Any]:
    wl = make_workload(3, concurrency, args.agentic_turns, args.agentic_system, args.agentic_turn, args.agentic_new)
    with toggles.applied(list(names)) as ap:
        opts = EngineOptions.from_dict({**ap.engine, "max_num_seqs": 2 * concurrency, "kda_pool_slots": 2 * concurrency,
                                        "token_budget": args.agentic_budget})
        eng = Engine(model, opts)
        started: dict[str, float] = {}
        user_rates: list[float] = []

        def finished(rid: str) -> None:
            user_rates.append(len(eng.results[rid].tokens) / (time.perf_counter() - started[rid]))
        t0 = time.perf_counter()
        run_sessions(eng, wl, on_submit=lambda rid: started.__setitem__(rid, time.perf_counter()),
                     on_finish=finished)
        sync()
        secs = time.perf_counter() - t0
    m = eng.metrics
    rates = sorted(user_rates)
    return {"concurrency": concurrency, "s": secs, "requests": m.requests_finished,
            "tok_s": (m.prompt_tokens + m.generated_tokens) / secs,
            "p90_tok_s_user": rates[int(0.1 * (len(rates) - 1))] if rates else None,
            "prefix_reuse": m.hit_rate, "reusable_fraction": m.reusable_fraction,
            "prompt_tokens": m.prompt_tokens, "generated_tokens": m.generated_tokens,
            "fast": vars(eng.fast.stats).copy() if eng.fast is not None else None}


def section_agentic(model, args, deadline, log) -> list[dict[str, Any]]:
    names = AGENTIC + (("cuda_graphs",) if model.device.type == "cuda" else ())
    out = []
    for c in args.agentic:
        if time.monotonic() > deadline:
            out.append({"concurrency": c, "skipped": "budget spent"})
            continue
        item = agentic_run(model, names, c, args)
        out.append(item)
        log(f"agentic c={c}: {item['tok_s']:.0f} tok/s, p90 user {item['p90_tok_s_user']}, reuse {item['prefix_reuse']:.3f}")
    return out


# ---- summary ---------------------------------------------------------------------------------
def _best_counted(decode: list[dict[str, Any]], batch: int, context: int) -> dict[str, Any] | None:
    cells = [c for c in decode if c["batch"] == batch and c["context"] == context and c["counted"] and "tok_s" in c]
    return max(cells, key=lambda c: c["tok_s"]) if cells else None


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    ctx = doc["args"]["contexts"][0]
    best = {b: _best_counted(doc["decode"], b, ctx) for b in doc["args"]["batches"]}
    hf = doc.get("transformers", {})

    def hf_decode(dtype: str, b: int):
        return hf.get(dtype, {}).get("decode", {}).get(str(b), {}).get("tok_s")

    def hf_prefill(dtype: str, n: int):
        return hf.get(dtype, {}).get("prefill", {}).get(str(n), {}).get("tok_s")
    return {
        "decode_tok_s": {str(b): c and c["tok_s"] for b, c in best.items()},
        "decode_row": {str(b): c and c["row"] for b, c in best.items()},
        "decode_context": ctx,
        "transformers_bf16_decode_tok_s": {str(b): hf_decode("bf16", b) for b in doc["args"]["batches"]},
        "transformers_fp32_decode_tok_s": {str(b): hf_decode("fp32", b) for b in doc["args"]["batches"]},
        "roofline_fraction": {str(b): c and c.get("roofline_fraction") for b, c in best.items()},
        "prefill_tok_s": {str(p["tokens"]): p.get("tok_s") for p in doc["prefill"]},
        "transformers_bf16_prefill_tok_s": {str(n): hf_prefill("bf16", n) for n in doc["args"]["prefill"]},
        "agentic": [{k: a.get(k) for k in ("concurrency", "tok_s", "p90_tok_s_user", "prefix_reuse")}
                    for a in doc["agentic"]],
        "release_suite_s": None,        # not this benchmark: `k3verify all --suite release` times itself
        "contracts": {c["row"]: c["counted"] for c in doc["contracts"]},
    }


def print_table(doc: dict[str, Any]) -> None:
    print(f"model {doc['model']} {doc['dtype']} on {doc['device']}; HBM copy {doc['hbm_gb_s'] or '-'} GB/s")
    print(f"{'row':22} {'contract':>9} {'counted':>7} " + " ".join(f"{f'B{b}/{c}':>11}" for c in doc["args"]["contexts"]
                                                           for b in doc["args"]["batches"]))
    for con in doc["contracts"]:
        cells = []
        for c in doc["args"]["contexts"]:
            for b in doc["args"]["batches"]:
                cell = next((d for d in doc["decode"] if d["row"] == con["row"] and d["batch"] == b
                             and d["context"] == c), None)
                cells.append(f"{cell['tok_s']:11.1f}" if cell and "tok_s" in cell else f"{'-':>11}")
        held = {True: "held", False: "FAILED", None: "n/a"}[con["held"]]
        print(f"{con['row']:22} {held:>9} {'yes' if con['counted'] else 'no':>7} " + " ".join(cells))


# ---- main ------------------------------------------------------------------------------------
def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU: k3-mini, B = 1, 2, few steps, no transformers")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"))
    p.add_argument("--batches", type=_ints, default=None)
    p.add_argument("--contexts", type=_ints, default=None)
    p.add_argument("--prefill", type=_ints, default=None)
    p.add_argument("--agentic", type=_ints, default=None)
    p.add_argument("--rows", default="", help="stack rows to run (comma list; default all)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--no-transformers", action="store_true")
    a = p.parse_args(argv)
    smoke = a.smoke
    a.model = a.model or ("k3-mini" if smoke else "k3-small")
    a.dtype = a.dtype or ("fp32" if smoke else "bf16")
    a.batches = a.batches or ([1, 2] if smoke else [1, 8, 64, 256])
    a.contexts = a.contexts or ([32] if smoke else [512, 8192])
    a.prefill = a.prefill or ([64] if smoke else [4096, 32768])
    a.agentic = a.agentic if a.agentic is not None else ([2] if smoke else [1, 8, 32, 64])
    a.steps = a.steps or (3 if smoke else 16)
    a.warmup = 1
    a.cell_budget_s = 2.0 if smoke else 2.5
    a.check_lengths = [20, 45, 70] if smoke else [64, 100, 150, 200, 257, 300, 333, 420]
    a.check_new = 3 if smoke else 8
    a.agentic_turns, a.agentic_system, a.agentic_turn, a.agentic_new = (2, 96, 8, 3) if smoke else (3, 1024, 64, 32)
    a.agentic_budget = 256 if smoke else 4096
    a.transformers = not (smoke or a.no_transformers)
    a.rows = [r for r in a.rows.split(",") if r]
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    t_start = time.monotonic()
    deadline = t_start + args.budget_s

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)
    model = load_model(args.model, device=device, dtype=dtype)
    rows = _rows_of(tuple(args.rows))
    hbm = hbm_copy_bandwidth(device) if device == "cuda" else None
    doc: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "device": device,
                           "hbm_gb_s": hbm and round(hbm / 1e9, 1), "args": {k: v for k, v in vars(args).items()},
                           "environment": environment(device)}
    with torch.no_grad():
        doc["contracts"] = section_contracts(model, rows, args, log)
        doc["decode"] = section_decode(model, rows, doc["contracts"], args, hbm, deadline - 0.35 * args.budget_s, log)
        doc["prefill"] = section_prefill(model, args, deadline - 0.25 * args.budget_s, log)
        doc["transformers"] = {}
        if args.transformers:
            from .transformers_kimi import bench_kimi_linear
            for name, dt, batches, prefill in (("bf16", torch.bfloat16, args.batches, args.prefill),
                                               ("fp32", torch.float32, [64], [])):
                if time.monotonic() > deadline - 0.12 * args.budget_s:
                    doc["transformers"][name] = {"skipped": "budget spent"}
                    continue
                doc["transformers"][name] = bench_kimi_linear(model.config, dt, batches=batches,
                                                              context=args.contexts[0], new_tokens=32, prefill=prefill)
                log(f"transformers {name}: {doc['transformers'][name]['decode']}")
        doc["agentic"] = section_agentic(model, args, deadline, log)
    doc["summary"] = summary(doc)
    doc["wall_s"] = time.monotonic() - t_start
    (out_dir / "engine_bench.json").write_text(json.dumps(doc, indent=1, default=str))
    (out_dir / "summary.json").write_text(json.dumps(doc["summary"], indent=1))
    print_table(doc)
    print(json.dumps(doc["summary"]))
    return 0


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "threads": torch.get_num_threads(), "host": platform.node()}
    for mod in ("triton", "fla", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as exc:                  # absent on a CPU box: say so
            env[mod] = f"unavailable ({type(exc).__name__})"
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    env["env"] = {k: os.environ.get(k) for k in ("K3_GPU_PROFILE", "K3_GPU_GEMM", "K3_GPU_KDA", "K3_FAST_KDA")}
    return env


if __name__ == "__main__":
    raise SystemExit(main())
