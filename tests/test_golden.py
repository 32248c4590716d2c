"""Golden reference hashes: record/check pass on the reference; a perturbed reference op
fails with its location (the negative control); an unknown environment is a skip."""
from __future__ import annotations

import json

import pytest

from k3verify import cli
from k3verify import golden_hashes as gh
from optimized_stack import load_model
from optimized_stack.model import model as model_module
from optimized_stack.model import ops

SMALL = (("single", 0.25),)      # 25 prompt + 8 new tokens: the same checks, a fraction of the time


@pytest.fixture(scope="module")
def model():
    return load_model()


@pytest.fixture(scope="module")
def recorded(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("golden")
    mp = pytest.MonkeyPatch()
    mp.setattr(gh, "GOLDEN_SCENARIOS", SMALL)
    gh.record(model, "test record", d)
    yield d
    mp.undo()


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(gh, "GOLDEN_SCENARIOS", SMALL)


def test_record_writes_env_keyed_file_with_reason(model, recorded):
    env = gh.numerics_environment(model)
    path = recorded / f"{gh.env_key(env)}.json"
    data = json.loads(path.read_text())
    entry = data["models"][gh.model_id(model)]
    assert data["environment"] == env and entry["reason"] == "test record"
    assert set(entry["scenarios"]) == {"single"} and entry["scenarios"]["single"]["capture"]["requests"]


def test_check_passes_on_the_reference(model, recorded, small):
    gc = gh.check(model, recorded)
    assert gc.status == "pass", gc.reason
    assert [v.status for v in gc.scenarios] == ["pass"]


@pytest.mark.parametrize("perturb", ["plain_linear", "rms_norm_eps"])
def test_perturbed_reference_fails_with_location(model, recorded, small, monkeypatch, perturb):
    """Negative control: a 'harmless' change to a reference op must be caught and located."""
    if perturb == "plain_linear":
        with ops.override(linear=ops.plain_linear):
            gc = gh.check(model, recorded)
    else:
        real = model_module.rms_norm
        monkeypatch.setattr(model_module, "rms_norm", lambda x, w, eps: real(x, w, eps * 2))
        gc = gh.check(model, recorded)
    assert gc.status == "fail", f"the perturbation {perturb} went unnoticed: {gc.reason}"
    (v,) = gc.scenarios
    first = v.first_divergence
    assert first["scenario"] == "single" and first["request"] == "r0" and first["tensor"] == "logits"
    assert isinstance(first["position"], int)
    assert "scenario single, request r0, position" in gc.reason
    kda = [d for d in v.divergences if d["check"] == "kda_state"]
    assert kda and isinstance(kda[0]["layer"], int), "the KDA state divergence names its layer"
    results = gh.to_results(gc)
    assert results[0]["status"] == "fail" and results[0]["first_divergence"] == first


def test_unknown_environment_is_a_skip_with_reason(model, tmp_path):
    gc = gh.check(model, tmp_path)
    assert gc.status == "skip"
    assert "no golden hashes for numerics environment" in gc.reason and "bits legitimately differ" in gc.reason
    assert gh.to_results(gc)[0]["status"] == "skip"


def test_unknown_model_in_a_known_environment_is_a_skip(model, recorded, monkeypatch):
    monkeypatch.setattr(gh, "model_id", lambda m: "sha256:" + "0" * 64)
    gc = gh.check(model, recorded)
    assert gc.status == "skip" and "after a deliberate model change" in gc.reason


def test_env_key_names_every_numerics_factor():
    key = gh.env_key({"torch": "2.13.0+cpu", "device": "cpu", "cpu_capability": "AVX512", "dtype": "float32",
                      "threads": 2})
    assert key == "torch2.13.0_cpu-cpu-avx512-float32-t2"


def test_cli_record_needs_a_reason(tmp_path, capsys):
    assert cli.main(["golden", "record", "--dir", str(tmp_path)]) == 2
    assert "needs --reason" in capsys.readouterr().err


def test_committed_hashes_match_this_environment(model):
    """What CI runs: the committed golden file for this environment still matches the reference."""
    gc = gh.check(model)
    if gc.status == "skip":
        pytest.skip(gc.reason)
    assert gc.status == "pass", gc.reason
