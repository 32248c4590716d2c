"""Model-level GPU speed: prefill tokens/s, decode tokens/s at batch B, and decode's
fraction of the HBM roofline, reference path against a set of toggles, interleaved A/B.

The roofline is the time a perfect kernel would need to move the bytes a decode step must
touch at least once (model_bytes below) at the HBM bandwidth measured in the same run by a
device-to-device copy (read + write bytes). Achieved fraction = roofline time / step time.
Whether a speedup *counts* is decided by the caller (gpu_suite.py): only when every toggle
in the candidate set passed its contract in the same run.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from k3verify.perf.ab import interleaved
from optimized_stack import toggles as toggle_registry
from optimized_stack.config import KDA


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hbm_copy_bandwidth(device: str = "cuda", gib: int = 4, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    x = torch.empty(gib << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        y.copy_(x)
    sync()
    secs = (time.perf_counter() - t0) / repeats
    del x, y
    torch.cuda.empty_cache()
    return 2 * (gib << 30) / secs


def decode_step_bytes(model, batch: int, context: int) -> dict[str, float]:
    """The bytes one decode step at batch B must read or write at least once.

    weights: every tensor but the routed experts, plus the routed experts a uniform router
    is expected to touch (E * (1 - (1 - k/E)^B) per MoE layer); states: each request's KDA
    state read and written, its conv windows; cache: each request's MLA latent rows read.
    """
    cfg = model.config
    elt = next(model.parameters()).element_size()
    expert_bytes, other = 0, 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            expert_bytes += p.numel() * elt
        else:
            other += p.numel() * elt
    e, k = cfg.num_experts, cfg.num_experts_per_token
    touched = 1.0 - (1.0 - k / e) ** batch if e else 0.0
    n_kda = sum(1 for kind in cfg.layer_kinds if kind == KDA)
    n_mla = cfg.num_layers - n_kda
    kda_state = cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4     # fp32 [H, K, V]
    conv = 3 * cfg.kda_num_heads * cfg.kda_head_dim * (cfg.kda_conv_size - 1) * 4
    mla_row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * elt
    states = batch * n_kda * (2 * kda_state + 2 * conv)
    cache = batch * n_mla * context * mla_row
    weights = other + expert_bytes * touched
    return {"weights": weights, "states": states, "cache": cache, "total": weights + states + cache}


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _timed_fn(names: tuple[str, ...], body: Callable[[], Any]) -> Callable[[], Any]:
    def run():
        with toggle_registry.applied(list(names)):
            out = body()
        sync()
        return out
    return run


def bench_prefill(model, tokens: int, candidate: tuple[str, ...], *, repeats: int,
                  with_reference: bool = True) -> dict[str, Any]:
    """One whole-prompt prefill of `tokens` tokens, reference vs candidate toggles."""
    ids = _ids(tokens, model.config.vocab_size, 7).to(model.device)
    cand = _timed_fn(candidate, lambda: model.logits(ids))
    if not with_reference:
        cand()                                              # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            cand()
            times.append(time.perf_counter() - t0)
        med = sorted(times)[len(times) // 2]
        return {"workload": f"prefill {tokens}", "tokens": tokens, "reference_s": None,
                "candidate_s": med, "tokens_per_s_reference": None, "tokens_per_s_candidate": tokens / med,
                "ratio": None, "ci95": None, "repeats": repeats}
    ref = _timed_fn((), lambda: model.logits(ids))
    if repeats == 1:          # a long reference: one timed run each, no interval (the table says so)
        cand()
        t0 = time.perf_counter()
        cand()
        t_cand = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref()
        t_ref = time.perf_counter() - t0
        return {"workload": f"prefill {tokens}", "tokens": tokens, "reference_s": t_ref, "candidate_s": t_cand,
                "tokens_per_s_reference": tokens / t_ref, "tokens_per_s_candidate": tokens / t_cand,
                "ratio": t_ref / t_cand, "ci95": [t_ref / t_cand, t_ref / t_cand], "repeats": 1}
    ab = interleaved(ref, cand, repeats=repeats, tokens=tokens, labels=("reference", "+".join(candidate)))
    return prefill_row(ab, tokens, repeats)


def prefill_row(ab, tokens: int, repeats: int) -> dict[str, Any]:
    """A prefill A/B (perf/ab.py ABResult, baseline first) as a bench row."""
    d = ab.to_dict()
    return {"workload": f"prefill {tokens}", "tokens": tokens, "reference_s": d["median_s_a"],
            "candidate_s": d["median_s_b"], "tokens_per_s_reference": d["tokens_per_s_a"],
            "tokens_per_s_candidate": d["tokens_per_s_b"], "ratio": d["ratio"], "ci95": d["ci95"],
            "repeats": repeats}


def _prefilled_states(model, batch: int, context: int, fast: tuple[str, ...]):
    """B requests with `context` prompt tokens each (prefilled with the fast toggles: the
    decode timing needs states of the right size, not reference bits)."""
    states = []
    with toggle_registry.applied(list(fast)):
        for b in range(batch):
            st = model.new_state()
            model.forward(_ids(context, model.config.vocab_size, 100 + b).to(model.device), st)
            states.append(st)
    sync()
    return states


def bench_decode(model, batch: int, context: int, candidate: tuple[str, ...], *, steps: int,
                 repeats: int, hbm_bytes_per_s: float, fast_prefill: tuple[str, ...]) -> dict[str, Any]:
    """`steps` decode steps of B requests in one forward_batch each, reference vs candidate;
    every timed run starts from clones of the same prefilled states."""
    base = _prefilled_states(model, batch, context, fast_prefill)
    step_ids = [_ids(steps, model.config.vocab_size, 900 + b).to(model.device) for b in range(batch)]

    def body():
        states = [st.clone() for st in base]
        sync()
        for s in range(steps):
            model.forward_batch([(step_ids[b][s:s + 1], states[b]) for b in range(batch)])
    ref = _timed_fn((), body)
    cand = _timed_fn(candidate, body)
    ab = interleaved(ref, cand, repeats=repeats, tokens=batch * steps, labels=("reference", "+".join(candidate)))
    d = ab.to_dict()
    need = decode_step_bytes(model, batch, context + steps // 2)
    roofline_s = need["total"] / hbm_bytes_per_s
    step_ref, step_cand = d["median_s_a"] / steps, d["median_s_b"] / steps
    return {"workload": f"decode B={batch} ctx={context}", "batch": batch, "context": context,
            "steps": steps, "reference_step_ms": step_ref * 1e3, "candidate_step_ms": step_cand * 1e3,
            "tokens_per_s_reference": d["tokens_per_s_a"], "tokens_per_s_candidate": d["tokens_per_s_b"],
            "ratio": d["ratio"], "ci95": d["ci95"], "repeats": repeats, "bytes_per_step": need,
            "achieved_bytes_per_s_reference": need["total"] / step_ref,
            "achieved_bytes_per_s_candidate": need["total"] / step_cand,
            "roofline_fraction_reference": roofline_s / step_ref,
            "roofline_fraction_candidate": roofline_s / step_cand}


def fmt_ratio(r: dict[str, Any]) -> str:
    if r.get("ratio") is None:
        return "-"
    lo, hi = r["ci95"]
    return f"{r['ratio']:.2f}x [{lo:.2f}, {hi:.2f}]" if not math.isclose(lo, hi) else f"{r['ratio']:.2f}x (1 pair)"
