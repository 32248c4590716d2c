"""The engine's batched observer calls (on_logits_rows, on_kda_states): one call a step for every
request, so a device capture launches one digest per tensor kind and layer instead of one per request
(the capture's GPU overhead, NOTES.md session 16). The contract: a capture fed the batched calls
records exactly the digests the per-request calls give, under both digest schemes; the batched calls
really ran (call counts); and the comparison can fail (one flipped element changes that request's
item and no other)."""
from __future__ import annotations

import pytest
import torch

from k3verify.capture.capture import Capture
from k3verify.perf.capture_bench import PerRequestCalls
from optimized_stack import load_model, toggles
from optimized_stack.engine.engine import Engine
from optimized_stack.engine.options import EngineOptions, SamplingParams

PROMPTS = [list(range(1, 12)), list(range(5, 9)), list(range(20, 37))]


class CountingCapture(Capture):
    def __init__(self) -> None:
        super().__init__()
        self.batched_kda_calls = 0
        self.batched_logits_calls = 0

    def on_kda_states(self, points, layer, stacked):
        self.batched_kda_calls += 1
        super().on_kda_states(points, layer, stacked)

    def on_logits_rows(self, points, rows):
        self.batched_logits_calls += 1
        super().on_logits_rows(points, rows)


@pytest.fixture(scope="module")
def model():
    return load_model("k3-mini")


def _run(model, observers, names):
    with toggles.applied(list(names)) as ap:
        opts = EngineOptions.from_dict({**ap.engine, "max_num_seqs": len(PROMPTS), "kda_pool_slots": len(PROMPTS)})
    eng = Engine(model, opts, observers)
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, SamplingParams(max_new_tokens=5, ignore_eos=True), request_id=f"r{i}", arrival_step=i % 2)
    with torch.no_grad():
        eng.run()
    return eng


@pytest.mark.parametrize("scheme", ["blake2b", "m31x4"])
@pytest.mark.parametrize("names", [(), ("batched_decode",)], ids=["reference", "batched_decode"])
def test_batched_calls_record_the_per_request_digests(model, monkeypatch, scheme, names):
    if scheme == "m31x4":
        monkeypatch.setenv("K3_DIGEST", "m31x4")         # the device digest's scheme, on CPU tensors
    batched, per_request = CountingCapture(), PerRequestCalls(Capture())
    eng = _run(model, [batched, per_request], names)
    a, b = batched.to_json(), per_request.cap.to_json()
    assert a == b
    kda_layers = sum(kind == "kda" for kind in model.config.layer_kinds)
    items = [d for r in a["requests"].values() for pt in r["kda"].values() for d in pt.values()]
    assert len(items) == per_request.kda_calls * 4 > 0, "no KDA state was captured"
    assert all(f":{scheme}:" in d or (scheme == "blake2b" and ":m31x4:" not in d) for d in items)
    # evidence the batched form ran: one call per KDA layer a step, fewer than one per request
    assert batched.batched_kda_calls == eng.metrics.steps * kda_layers
    if names:              # several requests a step (the reference runs one at a time: equal counts)
        assert per_request.kda_calls > batched.batched_kda_calls
        # the batched decode's logits rows: one call a decode step
        assert 0 < batched.batched_logits_calls < sum(len(r["logits"]) for r in a["requests"].values())


@pytest.mark.parametrize("scheme", ["blake2b", "m31x4"])
def test_a_flipped_element_changes_that_request_only(monkeypatch, scheme):
    if scheme == "m31x4":
        monkeypatch.setenv("K3_DIGEST", "m31x4")
    g = torch.Generator().manual_seed(3)
    stacked = {"recurrent": torch.randn(3, 2, 4, 4, generator=g), "conv_q": torch.randn(3, 3, 8, generator=g),
               "conv_k": torch.randn(3, 3, 8, generator=g), "conv_v": torch.randn(3, 3, 8, generator=g)}
    points = [("r0", 7), ("r1", 9), ("r2", 4)]
    rows = torch.randn(3, 16, generator=g)

    def per_request(st, lg):
        cap = Capture()
        for i, (rid, n) in enumerate(points):
            from optimized_stack.model.kda import KDAState
            cap.on_kda_state(rid, n, 2, KDAState(*(st[k][i].clone() for k in ("recurrent", "conv_q", "conv_k", "conv_v"))))
            cap.on_logits(rid, n, lg[i:i + 1].clone())
        return cap.to_json()

    batched = Capture()
    batched.on_kda_states(points, 2, stacked)
    batched.on_logits_rows(points, rows)
    assert batched.to_json() == per_request(stacked, rows)
    # negative control: one element of r1's recurrent state and of r2's logits row flipped
    bad = {k: v.clone() for k, v in stacked.items()}
    bad["recurrent"][1, 0, 0, 0] = torch.nextafter(bad["recurrent"][1, 0, 0, 0], torch.tensor(1e9))
    bad_rows = rows.clone()
    bad_rows[2, 5] = -bad_rows[2, 5]
    got, want = per_request(bad, bad_rows), batched.to_json()
    differ = sorted((rid, part) for rid in want["requests"] for part in ("kda", "logits")
                    if got["requests"][rid][part] != want["requests"][rid][part])
    assert differ == [("r1", "kda"), ("r2", "logits")]



def test_batched_calls_file_their_items_when_read_in_call_order(monkeypatch):
    """The device capture's batched calls only launch and append (the step files nothing: the items
    of B requests x 37 tensors a step cost ~7 ms of Python at B = 64); `requests` files them when
    read. A per-request call after a batched one for the same key replaces its item, as it did when
    the batched call filed at once (the control: the order reversed keeps the other item)."""
    monkeypatch.setenv("K3_DIGEST", "m31x4")
    g = torch.Generator().manual_seed(5)
    stacked = {k: torch.randn(2, 3, 4, generator=g) for k in ("recurrent", "conv_q", "conv_k", "conv_v")}
    points = [("r0", 3), ("r1", 5)]
    from optimized_stack.model.kda import KDAState
    other = KDAState(*(torch.randn(3, 4, generator=g) for _ in range(4)))

    def batched_then_direct(direct_last: bool) -> str:
        cap = Capture()
        if not direct_last:
            cap.on_kda_state("r0", 3, 1, other)
        cap.on_kda_states(points, 1, stacked)
        assert len(cap._deferred) == 4 and "r1" not in cap._requests      # nothing filed in the step
        if direct_last:
            cap.on_kda_state("r0", 3, 1, other)
            assert not cap._deferred                                        # filed before the direct call
        return cap.requests["r0"].kda[3][(1, "recurrent")].digest

    direct = Capture()
    direct.on_kda_state("r0", 3, 1, other)
    from_stack = Capture()
    from_stack.on_kda_states(points, 1, stacked)
    want_direct = direct.requests["r0"].kda[3][(1, "recurrent")].digest
    want_stack = from_stack.requests["r0"].kda[3][(1, "recurrent")].digest
    assert want_direct != want_stack
    assert batched_then_direct(direct_last=True) == want_direct
    assert batched_then_direct(direct_last=False) == want_stack


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("names", [("batched_decode",), ("batched_decode", "cuda_graphs")], ids=["eager", "graphs"])
def test_on_the_gpu_batched_calls_record_the_per_request_digests(names):
    """The device digest (m31x4, one launch per stacked tensor) against the per-request calls, on the
    counted stack's batched step, with and without graph replay."""
    model = load_model("k3-mini", device="cuda", dtype=torch.bfloat16)
    batched, per_request = CountingCapture(), PerRequestCalls(Capture())
    _run(model, [batched, per_request], names)
    a, b = batched.to_json(), per_request.cap.to_json()
    assert a == b
    digests = [d for r in a["requests"].values() for pt in r["kda"].values() for d in pt.values()]
    assert digests and all(":m31x4:" in d for d in digests), "the device digest did not run"
    assert batched.batched_logits_calls > 0
