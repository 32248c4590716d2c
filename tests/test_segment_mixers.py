"""The KDA and MLA mixers over every segment of a forward_batch at once (engine toggle
prefill_batched_mixers: kernels/kda/segments.py, kernels/mla/segments.py).

The contract is the reference's per-segment call, bit for bit: every logits row, every KDA state
(recurrent and the three conv windows) and the MLA rows and projected K/V, over segments of mixed
lengths (one token, shorter than the conv window, longer than a 64-token chunk), from empty and from
earlier states, with the projected K/V kept or not, at k3-mini's dims and K3's (k3-dims: value tiles
past the first). Evidence it ran: the slot's calls. Controls: a plain (batch-dependent) GEMM breaks the
equality, which is what makes it a test of row-invariance; the seeded fault (windows from the next
segment) is caught by the comparison.
"""
from __future__ import annotations

import pytest
import torch

from optimized_stack import load_model, toggles
from optimized_stack.engine.engine import Engine
from optimized_stack.engine.options import EngineOptions, SamplingParams
from optimized_stack.kernels.kda.segments import conv_segments, kda_segments
from optimized_stack.kernels.mla.segments import mla_segments
from optimized_stack.model import ops
from optimized_stack.model.kda import causal_conv

LENGTHS = [(5, 70), (1, 2), (17, 1), (3, 40)]      # (first call, second call) tokens per segment


@pytest.fixture(scope="module", params=["k3-mini", "k3-dims"])
def model(request):
    return load_model(request.param)


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def run_twice(model, projected: list[bool], counts: dict | None = None):
    """Two forward_batch calls over the segments (the second from the states the first left);
    -> (logits per call and segment, the states)."""
    states = [model.new_state() for _ in LENGTHS]
    for st, keep in zip(states, projected):
        st.mla_kv = {} if keep else None
    outs = []
    for call in range(2):
        segs = [(ids(lens[call], 10 * i + call), st) for i, (lens, st) in enumerate(zip(LENGTHS, states))]
        outs.append([o.clone() for o in model.forward_batch(segs)])
    return outs, states


def counting(form, counts: dict, key: str):
    def wrapped(*a, **kw):
        counts[key] = counts.get(key, 0) + 1
        return form(*a, **kw)
    return wrapped


def same_states(a, b) -> list[str]:
    bad = []
    for i, (x, y) in enumerate(zip(a, b)):
        for layer in x.kda:
            for name, t in x.kda[layer].tensors().items():
                if not torch.equal(t, y.kda[layer].tensors()[name]):
                    bad.append(f"segment {i} KDA layer {layer} {name}")
        for layer in x.mla:
            if not torch.equal(x.mla[layer], y.mla[layer]):
                bad.append(f"segment {i} MLA layer {layer} rows")
            if x.mla_kv is not None and not torch.equal(x.mla_kv[layer], y.mla_kv[layer]):
                bad.append(f"segment {i} MLA layer {layer} projected K/V")
    return bad


@pytest.mark.parametrize("projected", [[True] * 4, [False] * 4, [True, False, True, False]],
                         ids=["projected", "rows-only", "mixed"])
def test_segment_mixers_are_bitwise_the_per_segment_calls(model, projected):
    want, want_states = run_twice(model, projected)
    counts: dict = {}
    with ops.override(kda_segments=counting(kda_segments, counts, "kda"),
                      mla_segments=counting(mla_segments, counts, "mla")):
        got, got_states = run_twice(model, projected)
    kinds = model.config.layer_kinds
    assert counts == {"kda": 2 * kinds.count("kda"), "mla": 2 * kinds.count("mla")}, counts
    for call in range(2):
        for i, (a, b) in enumerate(zip(got[call], want[call])):
            assert torch.equal(a, b), f"call {call} segment {i}: {int((a != b).sum())} logits differ"
    assert not same_states(got_states, want_states)


def test_negative_control_a_batch_dependent_gemm_breaks_the_equality(model):
    """torch's plain GEMM gives a row other bits by its batch: with it, all rows at once are not the
    per-segment calls (and the comparison above says so)."""
    with ops.override(linear=ops.plain_linear):
        want, _ = run_twice(model, [True] * 4)
        with ops.override(kda_segments=kda_segments, mla_segments=mla_segments):
            got, _ = run_twice(model, [True] * 4)
    assert any(not torch.equal(a, b) for call in range(2) for a, b in zip(got[call], want[call])), \
        "control not caught: the plain GEMM's rows matched per segment and all at once"


def test_conv_over_joined_segments_is_each_segments_conv():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(12, 1, 4, generator=g)
    bounds, x = [(0, 1), (1, 3), (3, 10), (10, 12)], torch.randn(12, 12, generator=g)
    windows = [torch.randn(3, 12, generator=g) for _ in bounds]
    y, new = conv_segments(x, bounds, windows, weight)
    for (a, b), win, nw in zip(bounds, windows, new):
        want_y, want_w = causal_conv(x[a:b], win, weight)
        assert torch.equal(y[a:b], want_y) and torch.equal(nw, want_w)
    # the seeded fault: the windows come from the next segment (the outputs are unchanged)
    y2, shifted = conv_segments(x, bounds, windows, weight, _windows_from_next=True)
    assert torch.equal(y2, y) and not torch.equal(shifted[0], new[0]) and torch.equal(shifted[0], new[1])


def test_the_engine_toggle_is_exact_with_its_event_and_its_mutant_is_caught():
    model = load_model("k3-mini")
    prompts = [list(range(1, 40)), list(range(50, 53)), list(range(60, 131))]

    def run(names, extra=()):
        with toggles.applied(list(names)) as ap:
            opts = EngineOptions.from_dict({**ap.engine, "max_num_seqs": 3, "kda_pool_slots": 3, **dict(extra)})
        eng = Engine(model, opts)
        for i, p in enumerate(prompts):
            eng.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True), request_id=f"r{i}")
        with torch.no_grad():
            res = eng.run()
        return {k: v.tokens for k, v in res.items()}, eng
    ref, _ = run(["batched_decode"])
    got, eng = run(["prefill_batched_mixers"])
    assert got == ref and eng.events.get("prefill_batched_mixers", 0) >= 3 * 8
    # with speculation verifying in the same forwards (its recording keeps the KDA calls per segment)
    spec, eng = run(["prefill_batched_mixers", "spec_replay_ssm"])
    assert spec == ref and eng.events.get("prefill_batched_mixers", 0) > 0
    bad, _ = run(["mut_batched_mixers_window_from_next"])
    assert bad != ref, "the seeded fault changed no token on three prompts prefilled together"




def test_localisation_blames_the_segment_mixers_only_for_their_own_kinds_mixer():
    """The segment slots are in the op table of every forward under prefill_batched_mixers; a differing
    row is theirs only where it is the mixer of their layer kind (a fault in an FFN, or in the other
    kind's mixer, is not), and a single-segment forward never called them. The control: the unfiltered
    slot list blames kda_segments for the FFN."""
    from k3verify import localize_engine as le
    model = load_model("k3-mini")
    kinds = model.config.layer_kinds
    kda, mla = kinds.index("kda"), kinds.index("mla")
    ref = {"linear": "reference", "kda_segments": "reference", "mla_segments": "reference"}
    ran = {**ref, "kda_segments": "segments.kda", "mla_segments": "segments.mla"}
    assert le.blamed_slots(model, ran, ref, kda, "mixer") == ["kda_segments"]
    assert le.blamed_slots(model, ran, ref, mla, "mixer") == ["mla_segments"]
    assert le.blamed_slots(model, ran, ref, kda, "ffn") == []
    assert le.blamed_slots(model, {**ran, "linear": "plain"}, ref, kda, "ffn") == ["linear"]
    unfiltered = [s for s in ref if ran.get(s) != ref[s]]
    assert unfiltered[0] == "kda_segments", "control: without the filter the FFN's fault is blamed on the mixers"
    trace = le._Trace(model)
    trace._req_of_state = {}
    st = model.new_state()

    class Req:
        request_id, tokens = "r", list(range(5))
    trace._req_of_state[id(st)] = Req()
    with ops.override(kda_segments=kda_segments, mla_segments=mla_segments):
        trace.on_segments([(torch.arange(5), st)])
    assert trace._pending[0].ops["kda_segments"] == "reference", "a one-segment forward never called the mixers"
