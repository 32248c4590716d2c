"""A fair baseline: our engine's decode and prefill rates against a peer's (transformers' Kimi
Linear), measured so that the ratio means something (design.md, "A fair baseline").

What makes it fair, each with the evidence it leaves in the result:
- warm: before any timed run at a batch size (or prefill length), every subject runs once untimed
  at exactly the shapes it will be timed at (`warm_passes` counts them per subject/B/tokens; the
  `timeline` lists warm and timed runs in the order they ran). Kernels that compile or tune on
  first use (fla's Triton autotune, torch.compile) do it there, not inside a timed region.
- the peer's fastest configuration: each arm is one documented way to call generate() (no
  attention_mask for equal-length prompts, a static cache, a compiled step); an arm that the
  model class rejects is recorded with the reason, and the peer's figure is the best arm's. The
  masked arm (an all-ones attention_mask) is reported beside it. The first `required_arms` arms
  (dynamic, masked) always run; a later one joins a batch's rounds only when its warm pass,
  times the repeats, fits what is left of the budget (else it is dropped, with that projection).
- repeated and interleaved in one process: rounds of (engine, arm 1, arm 2, ...), the order
  reversed every other round (A B C, C B A, ...), so drift lands on both sides.
- statistics: per subject the median with its order-statistic interval (ab.median_ci); the ratio
  engine/peer from the rounds' pairs (ab.ABResult: geometric mean of per-round ratios, 95%
  t-interval); the ratio's lower bound is the headline.
- a cross-check of the peer's net decode rate: the primary figure is read inside one
  generate(k + N) call from per-token stamps (tokens k+1 .. k+N); the cross-check subtracts a
  separate generate(k) call from the whole generate(k + N) call. The two must agree within
  `cross_check_tol`, else the figure is flagged (and the run fails).

The subjects are plain callables, so the schedule and the statistics are tested with fakes (an
injected first-call delay, an injected per-call cost) and run unchanged on the real engine and
transformers (fair_bench.py builds them).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .ab import ABResult, median_ci

ENGINE = "engine"


@dataclass
class GenerateRun:
    """One generate() call: its wall time and when each new token was ready (seconds from the
    call's start; len == new tokens)."""

    total_s: float
    token_s: list[float]


# (batch, new_tokens) -> GenerateRun: one way of calling the peer's generate()
Arm = Callable[[int, int], GenerateRun]


@dataclass
class Subjects:
    """What is measured. engine_decode(batch, steps) -> seconds of `steps` decode steps of
    `batch` requests; prefill callables: (tokens) -> seconds of one whole-prompt forward."""

    engine_decode: Callable[[int, int], float]
    arms: dict[str, Arm]
    masked_arm: str | None = None                 # the arm that passes an all-ones attention_mask
    rejected: dict[str, str] = field(default_factory=dict)    # arms that could not be built: why
    engine_prefill: Callable[[int], float] | None = None
    peer_prefill: Callable[[int], float] | None = None


@dataclass(frozen=True)
class FairConfig:
    batches: tuple[int, ...]
    new_tokens: int                     # N: decode tokens in the timed window
    skip_tokens: int = 8                # k: tokens before the window (prefill + k - 1 steps)
    repeats: int = 6
    prefill: tuple[int, ...] = ()
    warm: bool = True                   # False only for the cold diagnostic (negative control)
    cross_check_tol: float = 0.15       # |difference rate / stamped rate - 1| allowed
    budget_s: float = math.inf          # optional arms are dropped when their projection does not fit
    required_arms: int = 2              # the first arms run whatever the budget (dynamic, masked)
    headline_batch: int = 64

    def __post_init__(self) -> None:
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"batches must be positive integers, got {list(self.batches)}")
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens (N) must be >= 2, got {self.new_tokens}")
        if self.skip_tokens < 1:
            raise ValueError(f"skip_tokens (k) must be >= 1 (generate(k) includes the prefill), got {self.skip_tokens}")
        if self.repeats < 5:
            raise ValueError(f"repeats must be >= 5 (an interval of the median needs them), got {self.repeats}")
        if self.required_arms < 1:
            raise ValueError(f"required_arms must be >= 1, got {self.required_arms}")
        if not 0 < self.cross_check_tol < 1:
            raise ValueError(f"cross_check_tol must be in (0, 1), got {self.cross_check_tol}")


class Recorder:
    """The timeline of runs (warm or timed) and the warm-pass counter: the evidence that every
    timed run came after a warm run at its shape."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.timeline: list[dict[str, Any]] = []
        self.warm_passes: dict[str, int] = {}

    def run(self, phase: str, subject: str, batch: int, tokens: int, fn: Callable[[], Any]) -> Any:
        out = fn()
        self.timeline.append({"phase": phase, "subject": subject, "batch": batch, "tokens": tokens,
                              "at_s": round(time.monotonic() - self.t0, 4)})
        if phase == "warm":
            key = shape_key(subject, batch, tokens)
            self.warm_passes[key] = self.warm_passes.get(key, 0) + 1
        return out


def shape_key(subject: str, batch: int, tokens: int) -> str:
    return f"{subject}/B{batch}/T{tokens}"


def stamped_rate(run: GenerateRun, batch: int, k: int, n: int) -> float:
    """Tokens k+1 .. k+N of one call over the time between token k and token k+N."""
    span = run.token_s[k + n - 1] - run.token_s[k - 1]
    return batch * n / span if span > 0 else math.inf


def difference_rate(long: GenerateRun, short: GenerateRun, batch: int, n: int) -> float:
    """generate(k + N) - generate(k): the net time of N more tokens, prefill subtracted."""
    span = long.total_s - short.total_s
    return batch * n / span if span > 0 else math.inf


def summarize(samples: list[float]) -> dict[str, Any]:
    ci = median_ci(samples)
    return {"median": ci["median"], "ci95": [ci["low"], ci["high"]], "ci_coverage": ci["coverage"],
            "runs": list(samples), "spread": max(samples) / min(samples)}


def cross_check(stamped: float, difference: float, tol: float) -> dict[str, Any]:
    rel = difference / stamped - 1.0
    return {"stamped_tok_s": stamped, "difference_tok_s": difference, "rel_diff": rel, "tolerance": tol,
            "agree": abs(rel) <= tol}


def _round_order(names: list[str], r: int) -> list[str]:
    return names if r % 2 == 0 else names[::-1]


def measure_decode(subj: Subjects, cfg: FairConfig, batch: int, rec: Recorder, deadline: float,
                   log: Callable[[str], None]) -> dict[str, Any]:
    k, n = cfg.skip_tokens, cfg.new_tokens
    cell: dict[str, Any] = {"batch": batch, "new_tokens": n, "skip_tokens": k, "dropped": {}}
    warm_s: dict[str, float] = {}

    def engine_once(phase: str) -> float:
        return rec.run(phase, ENGINE, batch, n, lambda: subj.engine_decode(batch, n))

    def arm_once(phase: str, name: str) -> tuple[GenerateRun, GenerateRun]:
        arm = subj.arms[name]
        long = rec.run(phase, name, batch, k + n, lambda: arm(batch, k + n))
        short = rec.run(phase, name, batch, k, lambda: arm(batch, k))
        return long, short

    arms = list(subj.arms)
    if cfg.warm:
        t0 = time.monotonic()
        engine_once("warm")
        warm_s[ENGINE] = time.monotonic() - t0
        for name in list(arms):
            t0 = time.monotonic()
            try:
                arm_once("warm", name)
                warm_s[name] = time.monotonic() - t0
                # an arm far slower than the first one most likely compiled at this shape (a
                # compiled step recompiles per batch): warm it again, and project from that pass
                if name != arms[0] and warm_s[name] > 1.5 * warm_s[arms[0]]:
                    t0 = time.monotonic()
                    arm_once("warm", name)
                    warm_s[name] = time.monotonic() - t0
            except Exception as exc:          # the model class rejected the arm: say why, go on
                cell["dropped"][name] = f"rejected: {_reason(exc)}"
                arms.remove(name)
                log(f"decode B={batch}: arm {name} {cell['dropped'][name]}")
        # the first arms are required; the others join while the projection of all rounds fits
        keep = [ENGINE] + arms[:cfg.required_arms]
        for name in arms[cfg.required_arms:]:
            projected = cfg.repeats * sum(warm_s[s] for s in keep + [name])
            left = deadline - time.monotonic()
            if projected <= left:
                keep.append(name)
            else:
                cell["dropped"][name] = f"budget: {cfg.repeats} rounds projected {projected:.0f} s > {left:.0f} s left"
                log(f"decode B={batch}: arm {name} {cell['dropped'][name]}")
        order = keep
    else:
        order = [ENGINE] + arms
    cell["warm_s"] = warm_s
    cell["order"] = order
    eng_rates: list[float] = []
    stamped: dict[str, list[float]] = {a: [] for a in order[1:]}
    diffed: dict[str, list[float]] = {a: [] for a in order[1:]}
    for r in range(cfg.repeats):
        for name in _round_order(order, r):
            if name == ENGINE:
                eng_rates.append(batch * n / engine_once("timed"))
            else:
                long, short = arm_once("timed", name)
                stamped[name].append(stamped_rate(long, batch, k, n))
                diffed[name].append(difference_rate(long, short, batch, n))
    cell["engine"] = summarize(eng_rates)
    cell["arms"] = {}
    for name in order[1:]:
        arm_doc = summarize(stamped[name])
        arm_doc["difference"] = summarize(diffed[name])
        arm_doc["cross_check"] = cross_check(arm_doc["median"], arm_doc["difference"]["median"],
                                             cfg.cross_check_tol)
        ab = ABResult(name, ENGINE, [batch / x for x in stamped[name]], [batch / x for x in eng_rates], batch)
        arm_doc["ratio"] = {"engine_over_arm": ab.ratio, "ci95": [ab.ci_low, ab.ci_high]}
        cell["arms"][name] = arm_doc
    unmasked = {a: d for a, d in cell["arms"].items() if a != subj.masked_arm}
    pool = unmasked or cell["arms"]
    best = max(pool, key=lambda a: pool[a]["median"]) if pool else None
    cell["best_arm"] = best
    if best:
        cell["ratio"] = cell["arms"][best]["ratio"]
    # the intervals and ratios in the log too: a call that dies later still leaves the figures
    arms_line = ", ".join(f"{a} {d['median']:.1f} {_ci(d['ci95'])} (x-check {d['difference']['median']:.1f}; "
                          f"engine/arm {d['ratio']['engine_over_arm']:.2f}x {_ci(d['ratio']['ci95'], 2)})"
                          for a, d in cell["arms"].items())
    log(f"decode B={batch}: engine {cell['engine']['median']:.1f} tok/s {_ci(cell['engine']['ci95'])}; {arms_line}")
    return cell


def _ci(pair, digits: int = 1) -> str:
    return f"[{pair[0]:.{digits}f}, {pair[1]:.{digits}f}]" if pair and None not in pair else "[-]"


def measure_prefill(subj: Subjects, cfg: FairConfig, tokens: int, rec: Recorder) -> dict[str, Any]:
    sides = [(ENGINE, subj.engine_prefill), ("peer", subj.peer_prefill)]
    sides = [(s, fn) for s, fn in sides if fn is not None]
    if cfg.warm:
        for s, fn in sides:
            rec.run("warm", f"{s}_prefill", 1, tokens, lambda fn=fn: fn(tokens))
    rates: dict[str, list[float]] = {s: [] for s, _ in sides}
    for r in range(cfg.repeats):
        for s, fn in _round_order(sides, r):
            rates[s].append(tokens / rec.run("timed", f"{s}_prefill", 1, tokens, lambda fn=fn: fn(tokens)))
    return {"tokens": tokens, **{s: summarize(v) for s, v in rates.items()}}


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {lines[0][:300]}"


def prewarm(subj: Subjects, cfg: FairConfig, rec: Recorder, log: Callable[[str], None]) -> Subjects:
    """One short untimed run of every subject before the first batch: kernels that compile once
    per head size (fla's, ~90 s on the H200) compile here, so the per-batch warm passes that the
    budget projects from are near steady state. An arm that raises is rejected here, with why."""
    b, k = min(cfg.batches), cfg.skip_tokens
    rec.run("prewarm", ENGINE, b, 2, lambda: subj.engine_decode(b, 2))
    arms, rejected = {}, dict(subj.rejected)
    for name, arm in subj.arms.items():
        try:
            rec.run("prewarm", name, b, k, lambda arm=arm: arm(b, k))
            arms[name] = arm
        except Exception as exc:              # the model class rejected the arm: say why, go on
            rejected[name] = f"rejected: {_reason(exc)}"
            log(f"prewarm: arm {name} {rejected[name]}")
    if not arms:
        raise RuntimeError(f"every peer arm was rejected: {rejected}")
    return Subjects(subj.engine_decode, arms, subj.masked_arm, rejected, subj.engine_prefill, subj.peer_prefill)


def run_fair_baseline(subj: Subjects, cfg: FairConfig, log: Callable[[str], None] = lambda m: None,
                      checkpoint: Callable[[dict[str, Any]], None] = lambda doc: None) -> dict[str, Any]:
    """Decode at every batch (the headline batch first, so a spent budget costs the others), then
    prefill at every length. Returns the whole record; `summary_fields` reads it. `checkpoint`
    gets the record so far after every cell: a device call's hard timeout then keeps the cells
    measured before it (the first H200 run of this bench lost all of them, 2026-12-02)."""
    if not subj.arms:
        raise ValueError(f"no peer arm to measure (rejected: {subj.rejected or 'none given'})")
    rec = Recorder()
    deadline = time.monotonic() + cfg.budget_s
    subj = prewarm(subj, cfg, rec, log) if cfg.warm else subj
    batches = sorted(cfg.batches, key=lambda b: (b != cfg.headline_batch, b))
    doc: dict[str, Any] = {"config": asdict(cfg), "rejected_arms": dict(subj.rejected), "masked_arm": subj.masked_arm,
                           "arms": list(subj.arms),
                           "decode": {}, "prefill": {}}
    for i, b in enumerate(batches):
        # each batch may spend its share of what is left, so the last ones still get measured
        share = (deadline - time.monotonic()) / (len(batches) - i)
        doc["decode"][str(b)] = measure_decode(subj, cfg, b, rec, time.monotonic() + share, log)
        checkpoint(doc)
    for t in cfg.prefill:
        doc["prefill"][str(t)] = measure_prefill(subj, cfg, t, rec)
        log(f"prefill {t}: " + ", ".join(f"{s} {d['median']:.0f} tok/s {_ci(d['ci95'], 0)}"
                                         for s, d in doc["prefill"][str(t)].items() if isinstance(d, dict)))
        checkpoint(doc)
    doc["warm_passes"] = rec.warm_passes
    doc["timeline"] = rec.timeline
    doc["cross_check_ok"] = all(a["cross_check"]["agree"] for c in doc["decode"].values() for a in c["arms"].values())
    return doc


def summary_fields(doc: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The flat fields a report quotes (issue 27): medians, intervals, every run, the ratio's
    lower bound at the headline batch."""
    dec, pre = doc["decode"], doc["prefill"]
    head = str(doc["config"]["headline_batch"])
    p = f"transformers_{dtype}"

    def best(c: dict[str, Any]) -> dict[str, Any] | None:
        return c["arms"].get(c["best_arm"]) if c.get("best_arm") else None

    masked = doc.get("masked_arm")
    return {
        "decode_tok_s": {b: c["engine"]["median"] for b, c in dec.items()},
        "decode_ci95": {b: c["engine"]["ci95"] for b, c in dec.items()},
        f"{p}_decode_tok_s": {b: best(c) and best(c)["median"] for b, c in dec.items()},
        f"{p}_decode_ci95": {b: best(c) and best(c)["ci95"] for b, c in dec.items()},
        f"{p}_decode_runs": {b: best(c) and best(c)["runs"] for b, c in dec.items()},
        f"{p}_decode_arm": {b: c.get("best_arm") for b, c in dec.items()},
        f"{p}_decode_difference_tok_s": {b: best(c) and best(c)["difference"]["median"] for b, c in dec.items()},
        f"{p}_masked_decode_tok_s": {b: (c["arms"].get(masked) or {}).get("median") for b, c in dec.items()},
        "ratio": {b: c.get("ratio", {}).get("engine_over_arm") for b, c in dec.items()},
        "ratio_ci95": {b: c.get("ratio", {}).get("ci95") for b, c in dec.items()},
        f"ratio_b{head}_lower95": (dec.get(head, {}).get("ratio") or {}).get("ci95", [None])[0],
        "prefill_tok_s": {t: c[ENGINE]["median"] for t, c in pre.items() if ENGINE in c},
        f"{p}_prefill_tok_s": {t: c["peer"]["median"] for t, c in pre.items() if "peer" in c},
        "ci_coverage": doc["config"]["repeats"] and median_ci(list(range(doc["config"]["repeats"])))["coverage"],
        "rejected_arms": {**doc["rejected_arms"], **{f"B{b}:{a}": why for b, c in dec.items()
                                                     for a, why in c["dropped"].items()}},
        "cross_check_ok": doc["cross_check_ok"],
        "warm": doc["config"]["warm"],
    }
