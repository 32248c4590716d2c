"""Non-finite numbers through the other paths that judge captures: golden hashes (stored
captures), localisation, the bench's contract check, the tensor-parallel runner and the
vLLM logprob comparison. Each with its negative control (clean passes; identical poisoned
bits hash alike)."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from k3verify import kinds
from k3verify.capture.capture import Capture
from k3verify.compare import golden as gh
from k3verify.compare.logprobs import compare_logprobs
from k3verify.kinds.base import CheckSpec, Context
from k3verify.localize import localize_request
from k3verify.perf.bench import bench_toggle
from k3verify.run.runner import Runner
from k3verify.scenarios import workloads
from k3verify.serving.backends import vllm_backend as vb
from k3verify.verdict.gate import check_toggle

from model_fixtures import model  # noqa: F401  (the module-scoped k3-mini fixture)
from nonfinite_fixtures import VALUES, candidate_poison, poisoned, poisoned_weight

SMALL = (("single", 0.25),)


@pytest.fixture(scope="module")
def small():
    return workloads.build("single", scale=0.25)


def _row3(model, kind):
    return poisoned(model, "logits", position=3, value=kind, index=7)     # a prompt row: never sampled


# ---- golden hashes ------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["reference", "candidate", "reference and candidate"])
@pytest.mark.parametrize("kind", list(VALUES))
def test_golden_check_fails_on_nonfinite(model, tmp_path, monkeypatch, kind, side):
    monkeypatch.setattr(gh, "GOLDEN_SCENARIOS", SMALL)
    with _row3(model, kind) if side != "candidate" else contextlib.nullcontext():
        gh.record(model, "test record", tmp_path)
    with _row3(model, kind) if side != "reference" else contextlib.nullcontext():
        gc = gh.check(model, tmp_path)
    assert gc.status == "fail"
    msg = f"non-finite ({kind}) in logits of r0 at position 3, vocab index 7 ({side} side{'s' * (' and ' in side)})"
    assert msg in gc.reason and "failing: logits" in gc.reason, gc.reason
    assert gc.scenarios[0].first_divergence["position"] == 3
    if side == "reference and candidate":       # negative control: the stored hash matches the run's
        stored = Capture.from_json(gh._read(gh.golden_path(model, tmp_path))["models"][gh.model_id(model)]
                                   ["scenarios"]["single"]["capture"])
        with _row3(model, kind):
            now = gh.run_scenario(model, workloads.build("single", scale=0.25, vocab=256), ())
        assert stored.requests["r0"].logits[3].digest == now.requests["r0"].logits[3].digest


def test_golden_check_of_a_clean_model_passes(model, tmp_path, monkeypatch):
    monkeypatch.setattr(gh, "GOLDEN_SCENARIOS", SMALL)
    gh.record(model, "test record", tmp_path)
    assert gh.check(model, tmp_path).status == "pass"


# ---- localisation ---------------------------------------------------------------------
WEIGHTS = [  # (parameter, element, layer, sublayer, component)
    ("model.layers.0.self_attn.o_proj.weight", (0, 0), 0, "mixer", "kda/mixer"),
    ("model.layers.1.block_sparse_moe.shared_experts.down_proj.weight", (0, 0), 1, "ffn", "moe/ffn"),
    ("model.layers.3.self_attn.o_proj.weight", (0, 0), 3, "mixer", "mla/mixer"),
    ("lm_head.weight", (3, 5), -1, "logits", "head/logits"),
]


@pytest.mark.parametrize("kind", list(VALUES))
@pytest.mark.parametrize("param,elem,layer,sublayer,component", WEIGHTS, ids=[w[4] for w in WEIGHTS])
def test_localisation_names_the_first_nonfinite_sublayer(model, small, param, elem, layer, sublayer,
                                                         component, kind):
    ids = list(small.requests[0].prompt_ids)
    with poisoned_weight(model.get_parameter(param), elem, kind):
        loc = localize_request(model, "prefill_step_api", ids, request_id="r0")
    assert (loc["layer"], loc["sublayer"], loc["component"]) == (layer, sublayer, component), loc
    assert loc["side"] == "reference+candidate" and loc["first_position"] == 0
    assert loc["nonfinite"] in (("nan",) if kind == "nan" else VALUES), loc   # w * inf is +-inf (nan at w = 0)
    # negative control: bitwise the two replays agree, so a difference-only search names nothing
    assert loc["first_difference"]["note"] == "no sublayer output differs on a single-request replay"


def test_localisation_names_the_candidate_side(model, small):
    ids = list(small.requests[0].prompt_ids)
    w = model.get_parameter("model.layers.1.block_sparse_moe.shared_experts.down_proj.weight")
    with candidate_poison("tmp_poison_loc", lambda: poisoned_weight(w, (0, 0), "inf")):
        loc = localize_request(model, "tmp_poison_loc", ids, request_id="r0")
    assert (loc["side"], loc["component"], loc["layer"]) == ("candidate", "moe/ffn", 1)
    assert loc["first_difference"]["component"] == "moe/ffn", "here the bits differ too"


def test_engine_toggle_localisation_still_names_the_nonfinite_sublayer(model, small):
    """Engine toggles are replayed by the state check only; the reference replay still runs."""
    w = model.get_parameter("model.layers.3.self_attn.o_proj.weight")
    with poisoned_weight(w, (0, 0), "nan"):
        loc = localize_request(model, "continuous_batching", list(small.requests[0].prompt_ids), request_id="r0")
    assert (loc["component"], loc["side"]) == ("mla/mixer", "reference")
    assert loc["first_difference"]["note"] == "engine toggle: replayed by state check only"


def test_gate_failure_carries_the_nonfinite_localisation(model, small):
    w = model.get_parameter("model.layers.1.block_sparse_moe.shared_experts.down_proj.weight")
    with poisoned_weight(w, (0, 0), "nan"):
        res = check_toggle(model, "prefill_step_api", small, runner=Runner(model))
    logits = next(r for r in res if r.check == "logits")
    assert logits.status == "fail" and logits.localization["component"] == "moe/ffn"
    assert logits.localization["reason"].startswith("first sublayer whose output is non-finite (nan): layer 1 ffn")


# ---- bench: the contract check -------------------------------------------------------------
def test_bench_refuses_to_time_a_nonfinite_contract_failure(model):
    with poisoned_weight(model.lm_head.weight, (3, 5), "nan"):
        row = bench_toggle(model, "prefill_step_api", workload_name="decode", scale=0.25, repeats=2)
    assert not row["counted"] and row["ratio"] is None
    assert row["why"].startswith("contract failed on single: tokens: reference and candidate runs stopped")
    assert row["why"].endswith("not timed (non-finite numbers)")
    clean = bench_toggle(model, "prefill_step_api", workload_name="decode", scale=0.25, repeats=2)
    assert clean["counted"] and clean["ratio"] > 0, "negative control: a clean contract is timed and counted"


# ---- tensor parallel ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_tp_captures_fail_on_nonfinite(model, small, kind):
    with poisoned_weight(model.lm_head.weight, (3, 5), kind):     # the ranks get the poisoned copy
        refs = Runner(model, world_size=2)
        try:
            ref = refs.reference(small)
            cand = refs.run(small, ("tp_dedup_router",))
            res = check_toggle(model, "tp_dedup_router", small, runner=refs)
        finally:
            refs.close()
    assert ref.stopped and cand.stopped, "every rank's sampler refused the same row: no hang"
    assert ref.requests["r0"].logits[0].digest == cand.requests["r0"].logits[0].digest, "old: hashes equal"
    by = {r.check: r for r in res}
    assert by["logits"].status == "fail" and by["tokens"].status == "fail"
    first = by["logits"].first_divergence
    assert (first["position"], first["index"], first["side"]) == (0, 3, "reference+candidate")
    assert by["logits"].reason.endswith("vocab index 3 (reference and candidate sides)")


# ---- vLLM logprobs ------------------------------------------------------------------------
MASKING = "processed_logprobs"        # vLLM's logprobs after the masking logits processors


def _vllm_capture(rows: torch.Tensor, mode: str = "raw_logprobs") -> dict:
    return {"settings": {"logprobs_mode": mode},
            "requests": [{"prompt_ids": [1, 2], "tokens": [0, 0, 0], "logprobs": torch.full((3, 8), -2.0)},
                         {"prompt_ids": [3], "tokens": rows.argmax(-1).tolist(), "logprobs": rows}]}


def _rows(**entries) -> torch.Tensor:
    rows = torch.full((3, 8), -2.0)
    for (step, idx), value in entries.get("at", {}).items():
        rows[step, idx] = value
    return rows


@pytest.mark.parametrize("side", ["reference", "candidate"])
@pytest.mark.parametrize("kind", ["nan", "inf", "-inf"])
def test_vllm_nonfinite_logprobs_fail(kind, side):
    bad, good = _vllm_capture(_rows(at={(2, 5): VALUES[kind]})), _vllm_capture(_rows())
    ref, cand = (bad, good) if side == "reference" else (good, bad)
    summary, _ = compare_logprobs(ref, cand)
    assert not summary.passed
    assert summary.nonfinite["reason"] == (f"non-finite ({kind}) in logprobs of request 1 at step 2, "
                                           f"vocab index 5 ({side} side)")


def test_vllm_identical_nan_is_bitwise_equal_but_fails():
    nan = _rows(at={(1, 4): math.nan})
    summary, _ = compare_logprobs(_vllm_capture(nan), _vllm_capture(nan.clone()))
    assert summary.bitwise_equal, "negative control: the old verdict (bitwise) passes it"
    assert not summary.passed and summary.nonfinite["sides"] == ["reference", "candidate"]


def test_vllm_masked_minus_inf_passes_only_where_vllm_masks():
    masked = _rows(at={(0, 1): -math.inf, (1, 1): -math.inf})
    summary, _ = compare_logprobs(_vllm_capture(masked, MASKING), _vllm_capture(masked, MASKING))
    assert summary.passed and summary.nonfinite is None, "processed logprobs: masked tokens are -inf"
    summary, _ = compare_logprobs(_vllm_capture(masked), _vllm_capture(masked))
    assert not summary.passed, "raw logprobs are log_softmax of finite logits: -inf is the model's own"
    empty = _rows(at={(1, i): -math.inf for i in range(8)})
    summary, _ = compare_logprobs(_vllm_capture(empty, MASKING), _vllm_capture(empty, MASKING))
    assert summary.nonfinite["reason"].startswith("non-finite (-inf) in logprobs of request 1 at step 1, "
                                                  "vocab index 0"), "a row with nothing finite is no distribution"


def test_vllm_diff_reports_the_location(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    bad = _vllm_capture(_rows(at={(0, 2): math.inf}))
    monkeypatch.setattr(vb, "vllm_unavailable_reason", lambda *a: None)
    monkeypatch.setattr(vb, "run_vllm_pair", lambda *a, **k: (bad, bad))
    (unit,) = kinds.plan(CheckSpec("diff", options={"toggles": ["rerun"], "backend": "vllm"}))
    (res,) = kinds.run(unit, Context(None, model_arg=str(tmp_path)))
    assert res.status == "fail"
    assert res.reason == ("non-finite (inf) in logprobs of request 1 at step 0, vocab index 2 "
                          "(reference and candidate sides)")
    assert res.first_divergence == {"request": 1, "step": 0, "tensor": "logprobs", "side": "reference+candidate"}
