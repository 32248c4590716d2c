"""The capture's digests taken inside the fast decode step (optimized_stack/engine/fast/step_digests.py).

The contract: a capture fed the step's own words records exactly the items it records from the calls
after the step (every logits row, every KDA state point), and the in-step form really ran (the event,
the stats, no after-step call for those rows). Its guards: the first words are checked against the
torch form, so a digester that gives wrong words or raises is turned off with the reason and the
capture is the after-step one; observers that do not all offer a digester get the calls after the
step. The control: a fault in what the step digests (another slot's rows) is seen by the comparison.

On the CPU the device digest is taken under K3_DIGEST=m31x4 (the torch form); the Triton kernel's
form runs in tests/test_triton_step_digests.py (interpreter) and on CUDA with graphs in the gpu test.
"""
from __future__ import annotations

import pytest
import torch

from k3verify.capture.capture import Capture
from k3verify.compare import device_digest
from optimized_stack import load_model, toggles
from optimized_stack.engine.engine import Engine
from optimized_stack.engine.fast import step_digests
from optimized_stack.engine.options import EngineOptions, SamplingParams

PROMPTS = [list(range(1, 12)), list(range(5, 9)), list(range(20, 37)), list(range(40, 46))]


class CountingCapture(Capture):
    """A capture that counts the after-step batched calls and the rows they carried."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.kda_rows_after_step = 0
        self.step_words_calls = 0

    def on_kda_states(self, points, layer, stacked):
        self.kda_rows_after_step += len(points)
        super().on_kda_states(points, layer, stacked)

    def on_step_words(self, *a):
        self.step_words_calls += 1
        super().on_step_words(*a)


@pytest.fixture(scope="module")
def model():
    return load_model("k3-mini")


def run(model, observers, names=("batched_decode",), device=None):
    with toggles.applied(list(names)) as ap:
        engine = ap.engine_for(model.device) if device else ap.engine
        opts = EngineOptions.from_dict({**engine, "max_num_seqs": len(PROMPTS), "kda_pool_slots": len(PROMPTS)})
    eng = Engine(model, opts, observers)
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True), request_id=f"r{i}", arrival_step=i % 2)
    with torch.no_grad():
        eng.run()
    return eng


def kda_items(cap: Capture) -> list[str]:
    return [d for r in cap.to_json()["requests"].values() for pt in r["kda"].values() for d in pt.values()]


@pytest.fixture
def m31(monkeypatch):
    monkeypatch.setenv(device_digest.DIGEST_ENV, device_digest.SCHEME)    # the device digest on CPU tensors


def test_in_step_words_record_the_after_step_items(model, m31):
    inside, after = CountingCapture(), CountingCapture(in_step=False)
    eng_in = run(model, [inside])
    eng_after = run(model, [after])
    assert inside.to_json() == after.to_json()
    assert all(":m31x4:" in d for d in kda_items(inside)) and kda_items(inside)
    # evidence the in-step form ran: its event and stats, one call a fast step, and the after-step calls
    # carried only the rows the fast step did not take (prefill chunks)
    fired = eng_in.events.get("fast_step_digests", 0)
    assert fired > 0 and eng_in.fast.stats.digest_steps == inside.step_words_calls > 0
    assert eng_in.fast.stats.digests_off is None
    assert "fast_step_digests" not in eng_after.events and after.step_words_calls == 0
    kda_layers = sum(kind == "kda" for kind in model.config.layer_kinds)
    assert inside.kda_rows_after_step == after.kda_rows_after_step - fired * kda_layers, \
        "the fast step's rows were captured twice, or not at all"


def test_blake2b_captures_take_no_in_step_digests(model):
    cap = CountingCapture()
    eng = run(model, [cap])
    assert cap.step_digester(model.device) is None
    assert "fast_step_digests" not in eng.events and cap.step_words_calls == 0
    assert all(":m31x4:" not in d for d in kda_items(cap))


def test_observers_that_disagree_get_the_calls_after_the_step(model, m31):
    a, b = CountingCapture(), CountingCapture(in_step=False)        # b offers no digester
    eng = run(model, [a, b])
    assert a.step_words_calls == 0 and "fast_step_digests" not in eng.events
    assert a.to_json() == b.to_json()


class WrongWords(device_digest.StepDigester):
    """Words off by one in one lane of one row: the first-words check must catch it."""

    def words(self, ts, index=None):
        out = super().words(ts, index)
        out[1] = out[1].clone()
        out[1][0, 0] += 1
        return out


class Raises(device_digest.StepDigester):
    def words(self, ts, index=None):
        raise RuntimeError("no kernel here")


@pytest.mark.parametrize("digester,why", [(WrongWords, "differ from the torch form"), (Raises, "no kernel here")],
                         ids=["wrong-words", "raises"])
def test_a_bad_digester_is_turned_off_and_the_capture_stays_right(model, m31, monkeypatch, capsys, digester, why):
    """The capture after the turn-off equals the after-step capture of an engine the bad digester never
    touched (taken first): the step was not run twice on the requests' state, and nothing was lost."""
    after = CountingCapture(in_step=False)
    run(model, [after])
    monkeypatch.setattr(Capture, "step_digester", lambda self, device: digester())
    cap = CountingCapture()
    eng = run(model, [cap])
    assert why in (eng.fast.stats.digests_off or ""), eng.fast.stats.digests_off
    assert "in-step digests are off" in capsys.readouterr().err
    assert cap.step_words_calls == 0 and "fast_step_digests" not in eng.events
    assert cap.to_json() == after.to_json()


def shift_rows(monkeypatch, method: str) -> None:
    """StepDigests.<method> reads the rows of the next slot over (the seeded fault of the two tests below)."""
    real = getattr(step_digests.StepDigests, method)
    monkeypatch.setattr(step_digests.StepDigests, method,
                        lambda self, logits, kda_slot, *a: real(self, logits, kda_slot.roll(1), *a))


def test_words_of_the_wrong_rows_are_caught_by_the_first_words_check(model, m31, monkeypatch):
    """The step's words read the pool at the wrong slots; the check gathers the right ones: the
    in-step digests are turned off, and the capture is the after-step one."""
    after = CountingCapture(in_step=False)
    run(model, [after])
    shift_rows(monkeypatch, "words")
    cap = CountingCapture()
    eng = run(model, [cap])
    assert "differ from the torch form" in (eng.fast.stats.digests_off or "")
    assert cap.to_json() == after.to_json()


def test_a_wrong_gather_is_seen_by_the_comparison(model, m31, monkeypatch):
    """The control: the step's words and the check's tensors both read another slot's rows (the check
    agrees with the words), so only the comparison with the after-step capture can see it, and it must."""
    shift_rows(monkeypatch, "words")
    shift_rows(monkeypatch, "tensors")
    inside, after = CountingCapture(), CountingCapture(in_step=False)
    run(model, [inside])
    run(model, [after])
    assert inside.step_words_calls > 0
    assert inside.to_json() != after.to_json()
    a, b = inside.to_json()["requests"], after.to_json()["requests"]
    assert all(a[r]["logits"] == b[r]["logits"] for r in a), "only the KDA items were moved"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("names", [("batched_decode",), ("batched_decode", "cuda_graphs")], ids=["eager", "graphs"])
def test_on_the_gpu_in_step_words_record_the_after_step_items(names):
    gpu = load_model("k3-mini", device="cuda", dtype=torch.bfloat16)
    inside, after = CountingCapture(), CountingCapture(in_step=False)
    eng = run(gpu, [inside], names, device=True)
    run(gpu, [after], names, device=True)
    assert eng.fast.stats.digests_off is None and inside.step_words_calls > 0
    assert inside.to_json() == after.to_json()
    if "cuda_graphs" in names:
        assert eng.fast.stats.graph_replays > 0


class StandInGraphs:
    """FastDecoder's graph runner as far as _forward sees it (a CPU stand-in): `fail` says which runs
    raise; a run that does not raise runs the step eagerly and remembers its key as captured."""

    def __init__(self, fast, fail):
        self.fast, self.fail, self.seen, self.calls = fast, fail, set(), []
        self.replays = self.captures = 0
        self.first_replay = False

    def key(self, size):
        return size, self.fast.step.digests is not None

    def has(self, size):
        return self.key(size) in self.seen

    def run(self, meta):
        key = self.key(meta.shape[1])
        self.calls.append(key)
        if self.fail(key, key in self.seen):
            raise RuntimeError("the stand-in graph failed")
        self.first_replay = key not in self.seen
        self.seen.add(key)
        step = self.fast.step
        return step.forward_words(meta) if key[1] else (*step.forward(meta), None)


def _engine_with(model, cap, fail):
    with toggles.applied(["batched_decode"]) as ap:
        opts = EngineOptions.from_dict({**ap.engine, "max_num_seqs": len(PROMPTS), "kda_pool_slots": len(PROMPTS)})
    eng = Engine(model, opts, [cap])
    eng.fast.graphs = StandInGraphs(eng.fast, fail)
    eng.fast.step.capturable = lambda: None
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True), request_id=f"r{i}", arrival_step=i % 2)
    return eng


def test_a_graph_whose_capture_with_digests_fails_is_captured_again_without(model, m31):
    after = CountingCapture(in_step=False)
    run(model, [after])
    cap = CountingCapture()
    eng = _engine_with(model, cap, fail=lambda key, captured: key[1] and not captured)
    with torch.no_grad():
        eng.run()
    graphs = eng.fast.graphs
    assert graphs.calls[:2] == [(graphs.calls[0][0], True), (graphs.calls[0][0], False)], graphs.calls
    assert "capturing the step with its digests failed" in eng.fast.stats.digests_off
    assert cap.to_json() == after.to_json()


def test_a_replayed_graph_that_fails_is_not_run_again(model, m31):
    """A failure of a graph already captured may have touched the requests' state: it is raised, never
    retried (the control of the test above: only a capture is retried)."""
    eng = _engine_with(model, CountingCapture(), fail=lambda key, captured: captured)
    with torch.no_grad(), pytest.raises(RuntimeError, match="the stand-in graph failed"):
        eng.run()
