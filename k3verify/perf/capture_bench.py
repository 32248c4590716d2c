"""What the verifier's capture costs the engine it watches (issue 27 item 4: <= 5% on the GPU).

    python -m k3verify.perf.capture_bench --out DIR [--model k3-small] [--device cuda] [--batch 64]
        [--context 512] [--new-tokens 32] [--repeats 6] [--per-request]

The counted stack (serving/stack.py) decodes `batch` requests of a copied `context` (fast_bench_setup:
no prefill timed) for `new_tokens` steps, interleaved with the same run under a Capture observer
(hashes of every logits row, KDA state and MLA rows: what `k3verify diff` records), `repeats`
rounds after a warm pair. With an observer the batched step keeps its rows (FastDecoder.run
keep_rows) and the capture hashes them, so the overhead is the copies, the hashing and any
device-to-host sync they force. Writes DIR/capture_overhead.json: {"overhead": extra time of the
captured run as a fraction, "ci95": its interval, the median seconds of each arm, the setup}; that
file is perf/engine_summary.py's --capture.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from optimized_stack import load_model, toggles

from ..io import atomic_write_text
from .ab import interleaved
from .fast_bench import _options
from .fast_bench_setup import Donor, cache_tokens_for, seeded_engine, sync


class PerRequestCalls:
    """An observer that passes a Capture only the per-request calls (on_logits, on_kda_state): the
    engine, seeing no batched methods, falls back to one call per request and layer."""

    def __init__(self, cap) -> None:
        self.cap = cap
        self.kda_calls = 0

    def on_request(self, *a) -> None:
        self.cap.on_request(*a)

    def on_logits(self, *a) -> None:
        self.cap.on_logits(*a)

    def on_kda_state(self, *a) -> None:
        self.kda_calls += 1
        self.cap.on_kda_state(*a)

    def on_finish(self, *a) -> None:
        self.cap.on_finish(*a)

    def on_step(self, *a) -> None:
        self.cap.on_step(*a)


def _overhead(ab) -> dict:
    return {"overhead": 1.0 / ab.ratio - 1.0, "ci95": [1.0 / ab.ci_high - 1.0, 1.0 / ab.ci_low - 1.0], "ab": ab.to_dict()}


def engine_capture_overhead(model, names: tuple[str, ...], *, batch: int, context: int, new_tokens: int,
                            repeats: int, per_request: bool = False) -> dict:
    from k3verify.capture.capture import Capture
    donor = Donor.prefill(model, context)
    with toggles.applied(list(names)) as ap:
        opts = _options(ap.engine, {"max_num_seqs": batch, "kda_pool_slots": batch, "token_budget": max(256, batch),
                                    "device_cache_tokens": cache_tokens_for(batch, context, new_tokens)})
        captures: list[Capture] = []

        def run(observers: tuple) -> None:
            eng = seeded_engine(model, opts, donor, batch, new_tokens, observers)
            eng.run()
            sync()
            assert len(eng.results) == batch and all(r.finish_reason == "length" for r in eng.results.values()), \
                "a request stopped early: the arms would not time the same work"

        def captured() -> None:
            cap = Capture()
            run((cap,))
            captures.append(cap)

        def captured_per_request() -> None:
            cap = Capture()
            run((PerRequestCalls(cap),))
            captures_per_request.append(cap)
        captures_per_request: list[Capture] = []
        ab = interleaved(lambda: run(()), captured, repeats=repeats, tokens=batch * new_tokens,
                         labels=("no capture", "capture"))
        before = (interleaved(lambda: run(()), captured_per_request, repeats=repeats, tokens=batch * new_tokens,
                              labels=("no capture", "capture, per-request calls")) if per_request else None)
    rows = sum(len(rc.logits) for rc in captures[-1].requests.values()) if captures else 0
    doc = {**_overhead(ab), "stack": list(names), "batch": batch, "context": context, "new_tokens": new_tokens,
           "repeats": repeats, "captured_logits_rows": rows}
    if before is not None:
        # the two forms must have recorded the same digests, or the comparison timed different work
        same = captures[-1].to_json()["requests"] == captures_per_request[-1].to_json()["requests"]
        doc["per_request"] = {**_overhead(before), "same_digests_as_batched": same}
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3verify.perf.capture_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default=None, help="default k3-small on cuda, k3-mini on the cpu")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--per-request", action="store_true",
                    help="also time the capture through the per-request observer calls (the form before batching)")
    args = ap.parse_args(argv)
    for name in ("batch", "context", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        print(f"error: --device {args.device}: expected cpu, or cuda where torch.cuda.is_available()", file=sys.stderr)
        return 2
    from k3verify.serving.stack import counted_toggles
    model_name = args.model or ("k3-small" if args.device == "cuda" else "k3-mini")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = load_model(model_name, device=args.device, dtype=dtype)
    doc = {"model": model_name, "device": args.device, "dtype": str(dtype).replace("torch.", ""),
           **engine_capture_overhead(model, counted_toggles(args.device), batch=args.batch, context=args.context,
                                     new_tokens=args.new_tokens, repeats=args.repeats,
                                     per_request=args.per_request)}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "capture_overhead.json", json.dumps(doc, indent=1))
    print(f"capture overhead on {model_name} {doc['dtype']} {args.device}, B={args.batch}: "
          f"{doc['overhead']:+.1%} [{doc['ci95'][0]:+.1%}, {doc['ci95'][1]:+.1%}] "
          f"({doc['captured_logits_rows']} logits rows hashed a run)")
    if "per_request" in doc:
        pr = doc["per_request"]
        print(f"  the same capture through per-request calls: {pr['overhead']:+.1%} "
              f"[{pr['ci95'][0]:+.1%}, {pr['ci95'][1]:+.1%}]; same digests: {pr['same_digests_as_batched']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
