"""The trained draft model (optimized_stack/engine/drafter_model.py, issue 28 item 2).

- the shipped checkpoint (golden/drafters/k3-mini) loads, its manifest holds, it was distilled
  from the golden k3-mini as it is now, and it stays small;
- a checkpoint that does not fit the target, or is broken, is one clean K3Error;
- speculation with drafter="model" is bit-identical to greedy decoding under both rollbacks,
  judged by the verifier's own gate, with every verification outcome and the model's drafts fired;
- its mutant (a capture that writes to the rows it observes) is caught by the logits check;
- acceptance: the trained drafter beats prompt lookup on gsm8k-synth prompts; a drafter that reads
  the hidden state one position early (exact, only worse) loses measurably, and an untrained head
  accepts ~nothing (the negative controls of the acceptance metric).
"""
from __future__ import annotations

import json

import pytest
import torch

from k3verify.perf.drafter_bench import gsm8k_prompts, run_once
from k3verify.run.runner import Runner
from k3verify.scenarios import workloads
from k3verify.verdict.gate import check_toggle
from optimized_stack import K3Error, load_model, toggles
from optimized_stack.engine import Engine, EngineOptions
from optimized_stack.engine import drafter_model as dm
from optimized_stack.loading import GOLDEN_DIR

SHIPPED = GOLDEN_DIR / "drafters" / "k3-mini"
MODEL_TOGGLES = ["spec_model_copy_states", "spec_model_replay_ssm"]


@pytest.fixture(scope="module")
def model():
    """The golden trained k3-mini: the target the shipped drafter was distilled from."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_model()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def refs(model):
    return Runner(model)


# ---- the checkpoint --------------------------------------------------------------------
def test_k3_mini_ships_a_drafter():
    assert SHIPPED.is_dir(), "golden/drafters/k3-mini (the embedded model's drafter) is missing"


@pytest.mark.parametrize("shipped", sorted(p.name for p in dm.DRAFTERS_DIR.iterdir()))
def test_shipped_drafter_loads_fits_its_target_and_matches_its_manifest(shipped):
    where, target_dir = dm.DRAFTERS_DIR / shipped, GOLDEN_DIR / shipped
    head = dm.load_drafter(where)
    dm.check_fits(head.cfg, load_model(target_dir), where)
    manifest = json.loads((where / "manifest.json").read_text())
    for name, sha in manifest["files"].items():
        assert dm.file_sha256(where / name) == sha, f"{name} does not match its manifest sha256"
    # a retrained golden target makes its drafter stale (still exact, but its acceptance is gone)
    assert manifest["target"]["model.safetensors"] == dm.file_sha256(target_dir / "model.safetensors"), \
        f"golden/{shipped} changed since its drafter was distilled: rerun the manifest's command"
    assert "scripts/train_drafter.py" in manifest["provenance"]["command"]
    size = sum(p.stat().st_size for p in where.iterdir())
    assert size < 2 * 1024 * 1024, f"a drafter checkpoint must stay under 2 MB, {shipped}'s is {size} bytes"


def _write_head(tmp_path, hidden=128, vocab=272, inner=32, seed=0):
    torch.manual_seed(seed)
    head = dm.DraftHead(dm.DrafterConfig(hidden, vocab, inner))
    torch.nn.init.normal_(head.fc_out.weight, std=0.1)          # untrained, not the zero init
    dm.save_drafter(head, tmp_path)
    return tmp_path


def _opts(checkpoint, **kw):
    return EngineOptions(continuous_batching=True, speculative="replay_ssm", drafter="model",
                         drafter_checkpoint=str(checkpoint), **kw)


def test_a_checkpoint_for_another_target_is_one_clean_error(model, tmp_path):
    with pytest.raises(K3Error, match=r"made for hidden 64 / vocab 272, the target has hidden 128 / vocab 272"):
        Engine(model, _opts(_write_head(tmp_path / "h64", hidden=64)))
    with pytest.raises(K3Error, match=r"made for hidden 128 / vocab 300"):
        Engine(model, _opts(_write_head(tmp_path / "v300", vocab=300)))
    with pytest.raises(K3Error, match=r"no drafter checkpoint at .*nowhere.*shipped: .*k3-mini"):
        Engine(model, _opts(tmp_path / "nowhere"))
    # and one that fits loads (the check is not refusing everything)
    assert Engine(model, _opts(_write_head(tmp_path / "ok"))).spec is not None


def test_a_broken_checkpoint_is_one_clean_error(model, tmp_path):
    d = _write_head(tmp_path / "a")
    cfg = json.loads((d / dm.CONFIG_FILE).read_text())
    (d / dm.CONFIG_FILE).write_text(json.dumps({**cfg, "inner_size": 64}))
    with pytest.raises(K3Error, match=r"tensors do not fit its config at 'fc_in.bias'"):
        Engine(model, _opts(d))
    (d / dm.CONFIG_FILE).write_text(json.dumps({**cfg, "hiden_size": 1}))
    with pytest.raises(K3Error, match=r"unknown keys \['hiden_size'\]"):
        Engine(model, _opts(d))
    d = _write_head(tmp_path / "b")
    (d / dm.WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(K3Error, match=r"not a readable safetensors file"):
        Engine(model, _opts(d))


@pytest.mark.parametrize("kw,match", [
    ({"continuous_batching": True, "drafter": "model"}, "drafter='model' requires speculative"),
    ({"continuous_batching": True, "speculative": "replay_ssm", "drafter_checkpoint": "x"},
     "drafter_checkpoint: expected None unless drafter='model'"),
], ids=["model-needs-spec", "checkpoint-needs-model"])
def test_bad_drafter_options_are_refused(kw, match):
    with pytest.raises(K3Error, match=match):
        EngineOptions(**kw)


def test_a_preset_target_finds_its_drafter_by_name():
    preset = load_model("k3-mini")          # seeded random weights, k3-mini's dims: same drafter dir
    assert dm.default_drafter_dir(preset) == SHIPPED


# ---- exactness, judged by the verifier's gate ------------------------------------------
@pytest.mark.parametrize("name", MODEL_TOGGLES)
def test_model_drafter_is_bitwise_greedy(model, refs, name):
    sc = workloads.build("spec_repetitive", scale=0.5)
    results = check_toggle(model, name, sc, runner=refs, localize_failures=False)
    bad = {r.check: (r.status, r.reason) for r in results if r.status != "pass"}
    assert results and not bad, f"{name}: exact contract broken or not exercised: {bad}"
    fired = results[0].evidence["events"]
    assert all(fired.get(e) for e in toggles.get(name).events), f"{name}: events {fired}"


def test_capture_in_place_mutant_is_caught(model, refs):
    name = "mut_spec_model_capture_in_place"
    sc = workloads.build("spec_repetitive", scale=0.5)
    res = {r.check: r for r in check_toggle(model, name, sc, runner=refs, localize_failures=False)}
    for c in toggles.get(name).caught_by:
        assert res[c].status == "fail", f"{name}: {c} should catch it, got {res[c].status}: {res[c].reason}"
    # a positive per-row scale keeps every argmax: the tokens alone would have let it through
    assert res["tokens"].status == "pass", res["tokens"].reason


# ---- acceptance --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def acceptance(model, tmp_path_factory):
    """Acceptance length per drafter on 4 gsm8k-synth test prompts (1 shot) x 40 new tokens."""
    prompts = gsm8k_prompts(4, shots=1)
    random_dir = _write_head(tmp_path_factory.mktemp("random"), inner=512, seed=1)
    out = {"ngram": run_once(model, prompts, 40, 4, "ngram", 3),
           "model": run_once(model, prompts, 40, 4, "model", 3),
           "random": run_once(model, prompts, 40, 4, "model", 3, str(random_dir))}
    real_init = dm.ModelDrafter.__init__

    def one_early(self, *a, **kw):
        real_init(self, *a, **kw)
        self.lag = 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dm.ModelDrafter, "__init__", one_early)
        out["one_early"] = run_once(model, prompts, 40, 4, "model", 3)
    plain = run_once(model, prompts, 40, 4, None, 3)
    for label, r in out.items():
        assert r["tokens"] == plain["tokens"], f"{label}: speculation changed the greedy tokens"
        assert r["verify_steps"] > 10, f"{label}: too few verifications to measure ({r['verify_steps']})"
    return {label: r["acceptance_length"] for label, r in out.items()}


@pytest.mark.slow          # the shared fixture runs 5 engines (~35 s on the busy 2-core box)
def test_trained_drafter_accepts_more_than_prompt_lookup(acceptance):
    assert acceptance["model"] > acceptance["ngram"] + 0.3, acceptance


@pytest.mark.slow          # the shared fixture runs 5 engines (~35 s on the busy 2-core box)
def test_acceptance_drops_for_a_drafter_reading_the_wrong_position(acceptance):
    assert acceptance["one_early"] < acceptance["model"] - 0.3, acceptance


@pytest.mark.slow          # the shared fixture runs 5 engines (~35 s on the busy 2-core box)
def test_an_untrained_drafter_accepts_almost_nothing(acceptance):
    assert acceptance["random"] < 1.15, acceptance
