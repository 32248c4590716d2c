"""The fast step's in-step digests through the Triton kernel (compare/digest_kernel.py's grouped form),
the form a GPU runs: a capture fed the step's words records what the calls after the step record, the
kernel really ran (the grouped form's launches were counted), and a wrong gather is seen. Runs on a GPU
or under TRITON_INTERPRET=1 (`make test-triton`); tests/test_step_digests.py has the torch form's."""
from __future__ import annotations

import torch

from k3verify.capture.capture import Capture
from k3verify.compare import device_digest
from optimized_stack import load_model, toggles
from optimized_stack.engine.engine import Engine
from optimized_stack.engine.fast import step_digests
from optimized_stack.engine.options import EngineOptions, SamplingParams

from triton_env import DEVICE, MARKS

pytestmark = MARKS
PROMPTS = [list(range(1, 9)), list(range(30, 35))]


def _run(model, cap):
    with toggles.applied(["batched_decode"]) as ap:
        opts = EngineOptions.from_dict({**ap.engine_for(model.device), "max_num_seqs": 2, "kda_pool_slots": 2})
    eng = Engine(model, opts, [cap])
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, SamplingParams(max_new_tokens=3, ignore_eos=True), request_id=f"r{i}")
    with torch.no_grad():
        eng.run()
    return eng


def test_the_kernels_in_step_words_record_the_after_step_items(monkeypatch):
    from k3verify.compare import digest_kernel        # imports triton: the Triton lane's venv only
    monkeypatch.setenv(device_digest.DIGEST_ENV, device_digest.SCHEME)
    launches = []
    real = digest_kernel.summary_words_many

    def counted(ts, index=None):
        launches.append(len(ts))
        return real(ts, index)
    monkeypatch.setattr(digest_kernel, "summary_words_many", counted)
    model = load_model("k3-mini", device=DEVICE)
    inside, after = Capture(), Capture(in_step=False)
    eng = _run(model, inside)
    kda = sum(kind == "kda" for kind in model.config.layer_kinds)
    # a fast step's call carries the logits and every KDA layer's four tensors; the after-step calls of
    # the prefill steps carry one layer's four
    in_step_calls = launches.count(1 + 4 * kda)
    _run(model, after)
    assert eng.fast.stats.digest_steps > 0 and eng.fast.stats.digests_off is None
    assert in_step_calls == eng.fast.stats.digest_steps, "the step's words did not come from the grouped kernel"
    assert launches.count(1 + 4 * kda) == in_step_calls, "the after-step capture took in-step words"
    assert inside.to_json() == after.to_json()


def test_negative_control_a_wrong_gather_through_the_kernel_is_seen(monkeypatch):
    monkeypatch.setenv(device_digest.DIGEST_ENV, device_digest.SCHEME)
    for method in ("words", "tensors"):          # the words and the check read the same wrong rows
        real = getattr(step_digests.StepDigests, method)
        monkeypatch.setattr(step_digests.StepDigests, method,
                            lambda self, logits, slot, *a, real=real: real(self, logits, slot.roll(1), *a))
    model = load_model("k3-mini", device=DEVICE)
    inside, after = Capture(), Capture(in_step=False)
    eng = _run(model, inside)
    _run(model, after)
    assert eng.fast.stats.digest_steps > 0
    assert inside.to_json() != after.to_json()
