"""Non-finite numbers, the pieces: the detector, the capture's record (file format v2, v1
still loading), the sampler's refusal, and `k3verify generate` exiting 1 with the location."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import optimized_stack
from k3verify import cli
from k3verify.capture.capture import Capture
from k3verify.capture.nonfinite import NonFinite, first_nonfinite
from k3verify.compare.tensors import hash_tensor
from k3verify.run.sequential import run_scenario
from k3verify.scenarios import workloads
from optimized_stack.engine.options import SamplingParams
from optimized_stack.engine.sampler import NonFiniteLogits, Sampler

from model_fixtures import model  # noqa: F401  (the module-scoped k3-mini fixture)
from nonfinite_fixtures import VALUES, poisoned

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "hashes"
KINDS = list(VALUES)


# ---- the detector ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
def test_first_nonfinite_names_kind_index_and_count(kind, dtype):
    t = torch.zeros(3, 7, dtype=dtype)
    t[1, 4] = VALUES[kind]
    t[2, 0] = math.nan                                   # a later one: the first in flat order wins
    assert first_nonfinite(t) == NonFinite(kind, 11, (1, 4), 2)
    assert first_nonfinite(torch.zeros(3, 7, dtype=dtype)) is None, "negative control: all finite"


def test_first_nonfinite_survives_an_overflowing_sum_and_ignores_integers():
    big = torch.full((4,), 3e38)                         # finite terms whose sum is inf: the exact search decides
    assert math.isinf(float(big.sum())) and first_nonfinite(big) is None
    assert first_nonfinite(torch.arange(5)) is None and first_nonfinite(torch.ones(2, dtype=torch.bool)) is None
    with pytest.raises(TypeError, match="needs a torch.Tensor, got list"):
        first_nonfinite([1.0])


def test_allow_neg_inf_reports_only_nan_and_pos_inf():
    row = torch.tensor([0.0, -math.inf, 1.0, math.inf])
    assert first_nonfinite(row).kind == "-inf"
    assert first_nonfinite(row, allow_neg_inf=True) == NonFinite("inf", 3, (3,), 1)
    assert first_nonfinite(torch.tensor([-math.inf, 0.0]), allow_neg_inf=True) is None


def test_hash_alone_cannot_see_nan():
    """Why the capture records finiteness: two NaN rows hash alike (the old check passed them)."""
    a = torch.zeros(8)
    a[3] = math.nan
    assert hash_tensor(a) == hash_tensor(a.clone())
    assert first_nonfinite(a) is not None


# ---- the sampler ----------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_sampler_refuses_nan_and_pos_inf(kind, temperature):
    row = torch.zeros(16)
    row[5] = VALUES[kind]
    assert int(torch.argmax(row)) == 5, "negative control: argmax alone would pick the poisoned entry"
    sampler = Sampler(SamplingParams(max_new_tokens=4, temperature=temperature, seed=1))
    with pytest.raises(NonFiniteLogits, match=rf"sampler refused a logits row: {kind} at vocab index 5 "
                                              r"\(1 of 16 entries non-finite\)") as info:
        sampler.sample(row)
    assert (info.value.kind, info.value.vocab_index, info.value.count, info.value.vocab) == (kind, 5, 1, 16)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_sampler_takes_masked_tokens_but_not_an_all_masked_row(temperature):
    row = torch.full((16,), -math.inf)
    row[9] = 0.5                                          # the only unmasked token
    sampler = Sampler(SamplingParams(max_new_tokens=4, temperature=temperature, seed=1))
    assert sampler.sample(row) == 9, "-inf is a masked token (probability 0), not an error"
    with pytest.raises(NonFiniteLogits, match=r"-inf at vocab index 0 \(16 of 16 entries non-finite\)"):
        sampler.sample(torch.full((16,), -math.inf))


# ---- the capture ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    return workloads.build("single", scale=0.25)          # 25 prompt tokens, 4 new


def test_capture_records_nonfinite_and_round_trips_v2(model, small, tmp_path):
    with poisoned(model, "logits", position=3, value="-inf", index=7):      # a prompt row: never sampled
        cap = run_scenario(model, small)
    assert cap.stopped is None and cap.finite_checked
    rc = cap.requests["r0"]
    assert rc.logits[3].nonfinite == NonFinite("-inf", 7, (7,), 1)
    assert all(it.nonfinite is None for p, it in rc.logits.items() if p != 3)
    data = cap.to_json()
    assert data["version"] == 2 and data["requests"]["r0"]["nonfinite"] == {
        "logits": {"3": {"kind": "-inf", "index": 7, "index_tuple": [7], "count": 1}}}
    again = Capture.from_json(json.loads(cap.save(tmp_path / "cap.json").read_text()))
    assert again.to_json() == data and again.requests["r0"].logits[3].nonfinite == rc.logits[3].nonfinite
    clean = run_scenario(model, small).to_json()
    assert clean["requests"]["r0"]["nonfinite"] == {}, "a finite run records nothing extra"


def test_stopped_run_keeps_the_refused_row(model, small):
    p = len(small.requests[0].prompt_ids) + 1             # the row that picks the third token
    with poisoned(model, "logits", position=p, value="nan"):
        cap = run_scenario(model, small)
    assert cap.stopped.startswith("sampler refused a logits row: nan at vocab index 5")
    rc = cap.requests["r0"]
    assert rc.logits[p].nonfinite.kind == "nan" and len(rc.tokens) == 0 and rc.finish_reason is None
    assert Capture.from_json(cap.to_json()).stopped == cap.stopped


def test_v1_captures_and_committed_golden_hashes_still_load():
    files = sorted(GOLDEN.glob("*.json"))
    assert files, "the repository ships golden hashes"
    for path in files:
        for model_entry in json.loads(path.read_text())["models"].values():
            for rec in model_entry["scenarios"].values():
                cap = Capture.from_json(rec["capture"])
                assert rec["capture"]["version"] in (1, 2) and cap.requests
                assert cap.finite_checked == (rec["capture"]["version"] == 2)
    v1 = {"format": "k3verify.capture", "version": 1, "label": "", "steps": 0,
          "requests": {"r0": {"prompt_len": 1, "tokens": [], "finish_reason": "length",
                              "logits": {"0": "float32[4]:00"}, "kda": {}, "mla": {}}}}
    cap = Capture.from_json(v1)
    assert not cap.finite_checked and cap.requests["r0"].logits[0].nonfinite is None
    with pytest.raises(ValueError, match=r"expected format k3verify.capture v2 \(or v1\), got 'k3verify.capture' v3"):
        Capture.from_json({**v1, "version": 3})


# ---- k3verify generate ----------------------------------------------------------------
@pytest.mark.parametrize("position,kind", [(2, "nan"), (8, "inf"), (8, "-inf")],
                         ids=["prompt-nan", "decode-inf", "decode-neg-inf"])
def test_generate_exits_1_with_the_first_location(model, monkeypatch, capsys, position, kind):
    monkeypatch.setattr(optimized_stack, "load_model", lambda *a, **k: model)
    with poisoned(model, "logits", position=position, value=kind):
        code = cli.main(["generate", "--prompt", "Hello", "--max-tokens", "8"])   # 6 prompt tokens
    err = capsys.readouterr().err
    assert code == 1
    assert err == f"k3verify: check failed: non-finite ({kind}) in logits at position {position}, vocab index 5\n"


def test_generate_on_a_clean_model_exits_0(model, monkeypatch, capsys):
    monkeypatch.setattr(optimized_stack, "load_model", lambda *a, **k: model)
    assert cli.main(["generate", "--prompt", "Hello", "--max-tokens", "8"]) == 0, capsys.readouterr().err


def test_generate_on_a_degenerate_model_exits_1_instead_of_printing_nul_bytes(model, monkeypatch, capsys):
    """lm_head zeroed: every logit is 0, argmax is token 0 (a NUL byte) every step (issue 29);
    the clean-model test above is its negative control."""
    monkeypatch.setattr(optimized_stack, "load_model", lambda *a, **k: model)
    saved = model.lm_head.weight.detach().clone()
    try:
        with torch.no_grad():
            model.lm_head.weight.zero_()
        code = cli.main(["generate", "--prompt", "Hello", "--max-tokens", "8"])
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(saved)
    out, err = capsys.readouterr()
    assert code == 1 and "\x00" not in out, out
    assert err.startswith("k3verify: check failed: the model is degenerate: logits constant over the vocabulary "
                          "at position 5 (every entry 0)"), err
