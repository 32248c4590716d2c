"""The fair transformers baseline (k3verify/perf/fair_baseline.py, CLI fair_bench.py): warm-up
before any timed run, interleaved rounds, the median's interval and the ratio's, the
generate(k+N) - generate(k) cross-check, rejected arms recorded. The schedule and statistics run
on fakes with virtual time (deterministic, instant); the whole pipeline once on the CPU with the
real engine (k3-mini) and transformers' Kimi Linear at its dims.

Negative controls: a cold measurement of a fake with an injected first-call delay reads slow and
the fair path excludes the delay; the intervals' coverage is simulated on samples of known
spread; an injected per-call cost makes the cross-check disagree (and the CLI's exit code 1)."""
from __future__ import annotations

import json
import math
import random
import statistics
import time

import pytest

from k3verify.perf.ab import ABResult, median_ci
from k3verify.perf.fair_baseline import (ENGINE, FairConfig, GenerateRun, Subjects, cross_check, run_fair_baseline,
                                         summary_fields)


class FakePeer:
    """Virtual-time generate(): `step_s` a token step (seeded jitter), `prefill_s` before the first
    token, `first_call_delay_s` inside the decode window of the first call at each (B, tokens)
    (a kernel compiling/tuning on first use), `tail_s_per_token` after the last stamp (a per-call
    cost the stamps cannot see: the injected cross-check fault)."""

    def __init__(self, step_s=0.01, prefill_s=0.05, first_call_delay_s=0.0, tail_s_per_token=0.0,
                 jitter=0.03, seed=0, fail_at_batch=None):
        self.step_s, self.prefill_s = step_s, prefill_s
        self.first_call_delay_s, self.tail_s_per_token = first_call_delay_s, tail_s_per_token
        self.rng = random.Random(seed)
        self.jitter = jitter
        self.seen: set[tuple[int, int]] = set()
        self.calls = 0
        self.fail_at_batch = fail_at_batch

    def __call__(self, batch: int, n: int) -> GenerateRun:
        if batch == self.fail_at_batch:
            raise RuntimeError(f"static cache not supported at batch {batch}")
        self.calls += 1
        t = self.prefill_s
        stamps = []
        cold = (batch, n) not in self.seen
        self.seen.add((batch, n))
        for i in range(n):
            t += self.step_s * math.exp(self.rng.gauss(0.0, self.jitter))
            if cold and i == n // 2:
                t += self.first_call_delay_s
            stamps.append(t)
        return GenerateRun(t + self.tail_s_per_token * n, stamps)


def fake_engine(step_s=0.002, seed=1):
    rng = random.Random(seed)
    return lambda batch, steps: steps * step_s * math.exp(rng.gauss(0.0, 0.03))


def fake_subjects(**peer) -> tuple[Subjects, FakePeer]:
    fp = FakePeer(**peer)
    return Subjects(fake_engine(), {"dynamic": fp, "masked": FakePeer(step_s=0.02, seed=5)}, masked_arm="masked",
                    engine_prefill=lambda t: t / 50_000, peer_prefill=lambda t: t / 100_000), fp


CFG = FairConfig(batches=(1, 4), new_tokens=8, skip_tokens=2, repeats=5, prefill=(64,), headline_batch=4)


# ---- warm-up and interleaving -----------------------------------------------------------------
def test_every_timed_run_follows_a_warm_run_at_its_shape():
    subj, _ = fake_subjects()
    doc = run_fair_baseline(subj, CFG)
    warmed: set[tuple[str, int, int]] = set()
    timed = 0
    for ev in doc["timeline"]:
        key = (ev["subject"], ev["batch"], ev["tokens"])
        if ev["phase"] == "warm":
            warmed.add(key)
        elif ev["phase"] == "timed":
            timed += 1
            assert key in warmed, f"timed run {key} before any warm run at that shape"
    assert timed > 0
    for b in CFG.batches:
        for subject, tokens in ((ENGINE, 8), ("dynamic", 10), ("dynamic", 2), ("masked", 10), ("masked", 2)):
            assert doc["warm_passes"][f"{subject}/B{b}/T{tokens}"] >= 1
    assert doc["warm_passes"]["engine_prefill/B1/T64"] == 1 and doc["warm_passes"]["peer_prefill/B1/T64"] == 1
    assert [e["phase"] for e in doc["timeline"][:3]] == ["prewarm"] * 3, "the prewarm runs before everything"


def test_rounds_are_interleaved_and_alternate_order():
    subj, _ = fake_subjects()
    doc = run_fair_baseline(subj, CFG)
    for b in CFG.batches:
        # one entry a subject a round: the engine's N steps, each arm's generate(k+N) (its
        # generate(k) follows it at once: checked below)
        timed = [e for e in doc["timeline"] if e["phase"] == "timed" and e["batch"] == b
                 and e["subject"] in (ENGINE, "dynamic", "masked")]
        seq = [e["subject"] for e in timed if e["subject"] == ENGINE or e["tokens"] == 10]
        rounds = [seq[i:i + 3] for i in range(0, len(seq), 3)]
        for i, e in enumerate(timed):
            if e["subject"] != ENGINE and e["tokens"] == 10:
                assert (timed[i + 1]["subject"], timed[i + 1]["tokens"]) == (e["subject"], 2)
        assert len(rounds) == CFG.repeats
        for r, got in enumerate(rounds):
            want = [ENGINE, "dynamic", "masked"]
            assert got == (want if r % 2 == 0 else want[::-1]), f"B={b} round {r}: {got}"
    assert doc["decode"]["4"]["order"] == [ENGINE, "dynamic", "masked"]
    assert list(doc["decode"]) == ["4", "1"], "the headline batch goes first"


# ---- negative control 1: the cold measurement --------------------------------------------------
def test_a_cold_measurement_reads_slow_and_the_fair_path_excludes_it():
    truth = 4 / 0.01                          # B=4 tokens per 10 ms step
    delay = 0.2                               # a first-call tuning pause inside the decode window
    cold_cfg = FairConfig(**{**CFG.__dict__, "batches": (4,), "warm": False, "prefill": ()})
    subj, _ = fake_subjects(first_call_delay_s=delay)
    cold = run_fair_baseline(subj, cold_cfg)
    cold_first = cold["decode"]["4"]["arms"]["dynamic"]["runs"][0]
    assert cold_first < 0.5 * truth, f"the control's delay did not reach the cold run ({cold_first:.0f} tok/s)"
    assert cold["warm_passes"] == {} and summary_fields(cold, "bf16")["warm"] is False

    subj, peer = fake_subjects(first_call_delay_s=delay)
    fair = run_fair_baseline(subj, FairConfig(**{**CFG.__dict__, "batches": (4,), "prefill": ()}))
    runs = fair["decode"]["4"]["arms"]["dynamic"]["runs"]
    assert min(runs) > 0.8 * truth, f"a timed run carried the first-call delay: {runs}"
    assert abs(statistics.median(runs) / truth - 1) < 0.1
    assert peer.seen == {(4, 10), (4, 2)}, "the peer ran only at the shapes it was warmed at"


# ---- negative control 2: the intervals on samples of known spread -------------------------------
@pytest.mark.parametrize("n", [5, 6, 9])
def test_the_median_interval_covers_the_truth_at_its_stated_rate(n):
    rng = random.Random(n)
    sims, covered = 3000, 0
    stated = median_ci([float(i) for i in range(n)])["coverage"]
    for _ in range(sims):
        xs = [math.exp(rng.gauss(0.0, 0.3)) for _ in range(n)]          # true median 1.0
        ci = median_ci(xs)
        assert ci["low"] <= ci["median"] <= ci["high"]
        assert ci["low"] < ci["median"], "the lower bound must sit below the median on continuous data"
        covered += ci["low"] <= 1.0 <= ci["high"]
    rate = covered / sims
    # binomial noise of 3000 draws: sd <= 0.005; 4 sd either side
    assert abs(rate - stated) < 0.02, f"n={n}: covered {rate:.3f}, stated {stated:.3f}"
    assert stated >= 0.95 or n == 5, "from n = 6 the interval is a 95% one"


def test_the_ratio_lower_bound_covers_the_truth_at_about_95_percent():
    rng = random.Random(7)
    true_ratio, sims, covered, below = 3.0, 2000, 0, 0
    for _ in range(sims):
        drift = [math.exp(rng.gauss(0, 0.2)) for _ in range(6)]          # shared by a round's pair
        peer = [d * 3.0 * math.exp(rng.gauss(0, 0.05)) for d in drift]
        eng = [d * 1.0 * math.exp(rng.gauss(0, 0.05)) for d in drift]
        ab = ABResult("peer", "engine", peer, eng, 1)
        assert ab.ci_low < ab.ratio
        covered += ab.ci_low <= true_ratio <= ab.ci_high
        below += ab.ci_low <= true_ratio
    assert abs(covered / sims - 0.95) < 0.02, f"two-sided coverage {covered / sims:.3f}"
    assert below / sims > 0.96, f"the headline lower bound sat above the truth in {1 - below / sims:.1%} of runs"


# ---- negative control 3: the cross-check -------------------------------------------------------
def test_the_cross_check_flags_an_injected_per_call_cost():
    ok_subj, _ = fake_subjects()
    ok = run_fair_baseline(ok_subj, CFG)
    assert ok["cross_check_ok"], ok["decode"]["4"]["arms"]["dynamic"]["cross_check"]
    # 5 ms a token after the last stamp: generate(k+N) - generate(k) sees 15 ms a step, stamps 10
    bad_subj, _ = fake_subjects(tail_s_per_token=0.005)
    bad = run_fair_baseline(bad_subj, CFG)
    xc = bad["decode"]["4"]["arms"]["dynamic"]["cross_check"]
    assert not xc["agree"] and xc["rel_diff"] < -CFG.cross_check_tol, xc
    assert not bad["cross_check_ok"] and summary_fields(bad, "bf16")["cross_check_ok"] is False


def test_cross_check_tolerance_edges():
    assert cross_check(100.0, 114.0, 0.15)["agree"]
    assert cross_check(100.0, 86.0, 0.15)["agree"]
    assert not cross_check(100.0, 116.0, 0.15)["agree"]
    assert not cross_check(100.0, 84.0, 0.15)["agree"]


# ---- arms the model rejects, the budget -------------------------------------------------------
def test_a_rejected_arm_is_recorded_and_the_rest_runs():
    subj, _ = fake_subjects()
    subj.arms["static"] = FakePeer(fail_at_batch=1)              # rejected at the prewarm (B = 1)
    subj.arms["static_b4"] = FakePeer(fail_at_batch=4)           # rejected at B = 4's warm pass only
    doc = run_fair_baseline(subj, CFG)
    assert doc["rejected_arms"]["static"].startswith("rejected: RuntimeError: static cache not supported")
    assert doc["decode"]["4"]["dropped"]["static_b4"].startswith("rejected: RuntimeError")
    assert "static_b4" in doc["decode"]["1"]["arms"]
    s = summary_fields(doc, "bf16")
    assert "static" in s["rejected_arms"] and "B4:static_b4" in s["rejected_arms"]


def test_optional_arms_that_do_not_fit_the_budget_are_dropped_with_the_projection():
    def slow(batch, n):
        time.sleep(0.01)
        return GenerateRun(0.01 * n + 0.05, [0.05 + 0.01 * (i + 1) for i in range(n)])
    subj = Subjects(fake_engine(), {"dynamic": slow, "masked": slow, "static": slow}, masked_arm="masked")
    doc = run_fair_baseline(subj, FairConfig(**{**CFG.__dict__, "batches": (4,), "prefill": (), "budget_s": 0.05}))
    cell = doc["decode"]["4"]
    assert cell["order"] == [ENGINE, "dynamic", "masked"], "the first two arms are required whatever the budget"
    assert cell["dropped"]["static"].startswith("budget: 5 rounds projected")
    assert "budget" in summary_fields(doc, "bf16")["rejected_arms"]["B4:static"]


def test_the_summary_fields():
    subj, _ = fake_subjects()
    doc = run_fair_baseline(subj, CFG)
    s = summary_fields(doc, "bf16")
    assert s["transformers_bf16_decode_arm"] == {"4": "dynamic", "1": "dynamic"}, "masked is slower here"
    assert len(s["transformers_bf16_decode_runs"]["4"]) == CFG.repeats
    lo, hi = s["transformers_bf16_decode_ci95"]["4"]
    assert lo <= s["transformers_bf16_decode_tok_s"]["4"] <= hi
    assert s["transformers_bf16_masked_decode_tok_s"]["4"] < s["transformers_bf16_decode_tok_s"]["4"]
    assert 0 < s["ratio_b4_lower95"] < s["ratio"]["4"]
    assert abs(s["ratio"]["4"] - 5.0) < 0.5            # engine 2 ms / step against the peer's 10
    assert abs(s["prefill_tok_s"]["64"] - 50_000) < 1 and abs(s["transformers_bf16_prefill_tok_s"]["64"] - 100_000) < 1


@pytest.mark.parametrize("kw, match", [
    ({"repeats": 4}, "repeats must be >= 5"),
    ({"new_tokens": 1}, r"new_tokens \(N\) must be >= 2"),
    ({"skip_tokens": 0}, r"skip_tokens \(k\) must be >= 1"),
    ({"batches": ()}, "batches must be positive"),
    ({"required_arms": 0}, "required_arms must be >= 1"),
])
def test_bad_config_is_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        FairConfig(**{**CFG.__dict__, **kw})


# ---- the CLI -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, match", [
    (["--repeats", "3"], "repeats must be >= 5"),
    (["--arms", "dynamic,fastest"], "--arms: unknown fastest"),
    (["--out-is-a-file"], "cannot create"),
])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, match):
    from k3verify.perf import fair_bench
    if argv == ["--out-is-a-file"]:
        (tmp_path / "f").write_text("")
        tmp_path, argv = tmp_path / "f", []
    assert fair_bench.main(["--out", str(tmp_path), "--device", "cpu"] + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err


def test_the_whole_pipeline_on_cpu(tmp_path, capsys):
    pytest.importorskip("transformers")
    import torch
    from k3verify.perf import fair_bench
    threads = torch.get_num_threads()
    try:
        rc = fair_bench.main(["--out", str(tmp_path), "--model", "k3-mini", "--device", "cpu", "--batches", "1,2",
                              "--context", "8", "--new-tokens", "3", "--skip-tokens", "1", "--repeats", "5",
                              "--prefill", "16", "--arms", "dynamic,masked,static_compiled", "--headline-batch", "2",
                              "--threads", "1", "--budget-s", "600", "--cross-check-tol", "0.5"])
    finally:
        torch.set_num_threads(threads)
    s = json.loads((tmp_path / "summary.json").read_text())
    doc = json.loads((tmp_path / "fair_baseline.json").read_text())
    assert rc == (0 if s["cross_check_ok"] else 1)
    for field in ("decode_tok_s", "transformers_bf16_decode_tok_s", "transformers_bf16_decode_ci95",
                  "transformers_bf16_decode_runs", "transformers_bf16_masked_decode_tok_s", "ratio_b2_lower95",
                  "prefill_tok_s", "transformers_bf16_prefill_tok_s"):
        assert s.get(field) is not None, f"summary field {field} missing or empty"
    assert set(s["decode_tok_s"]) == {"1", "2"} and all(v > 0 for v in s["decode_tok_s"].values())
    assert all(len(v) == 5 for v in s["transformers_bf16_decode_runs"].values())
    assert s["engine_row"] == "batched_decode", "the top counted row on the CPU"
    assert s["rejected_arms"]["static_compiled"].startswith("rejected: static_compiled: transformers auto-compiles")
    assert doc["peer"]["evidence"]["dynamic"] == {"cache_classes": ["DynamicCache"], "attention_mask": ["none"]}
    assert doc["fair"]["warm_passes"]["dynamic/B2/T4"] >= 1 and doc["fair"]["warm_passes"]["engine/B2/T3"] >= 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == s, "the last line is the summary"


def test_the_peer_runs_the_transformers_fixture_checkpoint():
    """--peer-checkpoint: the tiny Kimi Linear fixture of the installed transformers loads and its
    arms stamp every new token; the forward's evidence says which cache and mask it got."""
    transformers = pytest.importorskip("transformers")
    from pathlib import Path

    import torch
    from k3verify.perf.fair_baseline import stamped_rate
    from k3verify.perf.transformers_kimi import KimiLinearPeer
    ckpt = Path(__file__).parent / "fixtures" / "transformers" / transformers.__version__ / "checkpoint"
    if not ckpt.is_dir():
        pytest.skip(f"no Kimi Linear fixture for transformers {transformers.__version__}")
    peer = KimiLinearPeer(None, torch.float32, "cpu", 8, checkpoint=str(ckpt))
    for name in ("dynamic", "static"):
        run = peer.arm(name)(2, 4)
        assert len(run.token_s) == 4 and all(a < b for a, b in zip(run.token_s, run.token_s[1:]))
        assert run.total_s >= run.token_s[-1] > 0 and stamped_rate(run, 2, 1, 3) > 0
    assert peer.evidence["dynamic"]["cache_classes"] == ["DynamicCache"]
    assert peer.evidence["dynamic"]["attention_mask"] == ["none"], "the unmasked arm must reach the forward unmasked"
    assert peer.evidence["static"]["cache_classes"] == ["StaticCache"]
    with pytest.raises(ValueError, match="static_compiled: transformers auto-compiles generate.. on CUDA only"):
        peer.arm("static_compiled")
    with pytest.raises(ValueError, match="unknown transformers arm 'fast'"):
        peer.arm("fast")


def test_every_finished_cell_is_checkpointed_before_a_later_one_dies():
    """The first H200 call of this bench hit its hard timeout in its third batch and kept nothing:
    each finished cell now reaches `checkpoint` before the next starts."""
    subj, _ = fake_subjects()
    seen: list[dict] = []
    calls = {"n": 0}

    def dies_on_the_second_batch(batch, steps):
        if batch == 1 and steps > 2:              # B=4 (headline) runs first, then B=1 dies
            calls["n"] += 1
            raise TimeoutError("the call's hard limit")
        return subj.engine_decode(batch, steps)
    dying = Subjects(dies_on_the_second_batch, subj.arms, subj.masked_arm, {}, subj.engine_prefill, subj.peer_prefill)
    with pytest.raises(TimeoutError):
        run_fair_baseline(dying, CFG, checkpoint=lambda doc: seen.append(json.loads(json.dumps(doc, default=str))))
    assert calls["n"] == 1 and len(seen) == 1, "one checkpoint: the headline batch, before B=1 died"
    assert set(seen[0]["decode"]) == {"4"} and seen[0]["decode"]["4"]["engine"]["median"] > 0
    # the control: a run that finishes checkpoints once per decode batch and prefill length
    done: list[dict] = []
    run_fair_baseline(fake_subjects()[0], CFG, checkpoint=lambda doc: done.append(dict(doc)))
    assert len(done) == len(CFG.batches) + len(CFG.prefill)
