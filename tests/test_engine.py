"""Engine API, the reference path, sampling, validation, and the cache building blocks.
(The toggle-vs-reference bit-exactness suite is tests/test_engine_toggles.py.)"""
from __future__ import annotations

import pytest
import torch

from optimized_stack import K3Error, toggles
from optimized_stack.engine import Engine, EngineObserver, EngineOptions, SamplingParams
from optimized_stack.engine.kv_cache import PagedMLACache
from optimized_stack.engine.metrics import PrefixTrie
from optimized_stack.engine.state_pool import KDAStatePool
from model_fixtures import model  # noqa: F401  (the module-scoped k3-mini fixture)

ENGINE_TOGGLES = ["continuous_batching", "chunked_prefill", "prefix_cache", "prefix_cache_subblock",
                  "ckpt_with_mla_tail", "projected_kv_cache", "host_kv_tier", "preemption"]


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Rows(EngineObserver):
    def __init__(self):
        self.rows, self.steps = {}, []

    def on_logits(self, rid, start, rows):
        for i in range(rows.shape[0]):
            self.rows[(rid, start + i)] = rows[i]

    def on_step(self, step, scheduled):
        self.steps.append((step, scheduled))


def manual_greedy(model, ids: list[int], n_new: int) -> tuple[list[int], torch.Tensor]:
    """The reference path written out: whole-prompt prefill, then one token per forward."""
    st = model.new_state()
    rows = [model.forward(torch.tensor(ids), st)]
    out = []
    for _ in range(n_new):
        out.append(int(torch.argmax(rows[-1][-1])))
        if len(out) < n_new:
            rows.append(model.forward(torch.tensor(out[-1:]), st))
    return out, torch.cat(rows)


# ---- the reference path ---------------------------------------------------------------
def test_reference_engine_is_the_plain_model_path(model):
    ids = prompt(1, 30)
    obs = Rows()
    eng = Engine(model, EngineOptions(), [obs])
    rid = eng.add_request(ids, SamplingParams(max_new_tokens=4, ignore_eos=True))
    res = eng.run()[rid]
    want_tokens, want_rows = manual_greedy(model, ids, 4)
    assert res.tokens == want_tokens and res.finish_reason == "length"
    got = torch.stack([obs.rows[(rid, p)] for p in range(len(ids) + 3)])
    assert torch.equal(got, want_rows), "engine logits differ from the model run by hand"
    # negative control: the same comparison sees a one-token change of the prompt
    _, other_rows = manual_greedy(model, ids[:-1] + [(ids[-1] + 1) % 256], 4)
    assert not torch.equal(got, other_rows)


def test_reference_runs_one_request_at_a_time_in_arrival_order(model):
    obs = Rows()
    eng = Engine(model, EngineOptions(), [obs])
    lens = {"late": 12, "early": 20, "mid": 16}
    for rid, arrival in (("late", 3), ("early", 0), ("mid", 1)):
        eng.add_request(prompt(len(rid), lens[rid]), SamplingParams(max_new_tokens=2, ignore_eos=True),
                        request_id=rid, arrival_step=arrival)
    eng.run()
    sched = [s for _, s in obs.steps]
    assert all(len(s) == 1 for s in sched), "the reference ran two requests in one step"
    order = [s[0] for s in sched]
    assert order == [("early", 20), ("early", 1), ("mid", 16), ("mid", 1), ("late", 12), ("late", 1)], order


def test_idle_engine_jumps_to_the_next_arrival(model):
    obs = Rows()
    eng = Engine(model, EngineOptions(), [obs])
    eng.add_request(prompt(2, 8), SamplingParams(max_new_tokens=1), arrival_step=50)
    eng.run(max_steps=3)
    assert obs.steps[0][0] == 50 and eng.metrics.steps == 1


def test_run_stops_at_max_steps(model):
    eng = Engine(model)
    eng.add_request(prompt(3, 8), SamplingParams(max_new_tokens=5, ignore_eos=True))
    with pytest.raises(K3Error, match="unfinished after max_steps=2"):
        eng.run(max_steps=2)


# ---- sampling -------------------------------------------------------------------------
def test_stop_ids_end_a_request(model):
    ids = prompt(4, 10)
    first, _ = manual_greedy(model, ids, 1)
    eng = Engine(model)
    rid = eng.add_request(ids, SamplingParams(max_new_tokens=8, stop_ids=(first[0],)))
    res = eng.run()[rid]
    assert res.tokens == first and res.finish_reason == "stop"


def test_seeded_sampling_repeats_and_depends_on_the_seed(model):
    ids = prompt(5, 12)

    def sample(seed: int) -> list[int]:
        eng = Engine(model)
        rid = eng.add_request(ids, SamplingParams(max_new_tokens=10, temperature=1.5, seed=seed, ignore_eos=True))
        return eng.run()[rid].tokens
    assert sample(11) == sample(11)
    assert sample(11) != sample(12), "negative control: another seed should sample other tokens"


# ---- validation -----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"token_budget": 0}, "token_budget: expected an integer >= 1, got 0"),
    ({"preempt_mode": "drop"}, "preempt_mode: expected one of"),
    ({"checkpoint_interval": 24}, "checkpoint_interval: expected a divisor of block_size 64, got 24"),
    ({"device_cache_tokens": 10}, "device_cache_tokens: expected None or an integer >= 64, got 10"),
    ({"prefix_cache_subblock": True}, "prefix_cache_subblock requires prefix_cache"),
    ({"prefix_cache": True, "prefix_cache_subblock": False, "ckpt_with_mla_tail": True},
     "ckpt_with_mla_tail requires prefix_cache_subblock"),
    ({"preemption": True}, "preemption requires continuous_batching"),
    ({"faults": {"mut_restore_skip_conv"}}, "unknown fault 'mut_restore_skip_conv'; did you mean 'mut_restore_skips_conv'"),
    ({"continuous_batching": 1}, "continuous_batching: expected true/false, got 1"),
], ids=["budget0", "preempt-mode", "interval", "tiny-pool", "subblock-needs-pc", "tail-needs-subblock",
        "preempt-needs-cb", "unknown-fault", "bool-type"])
def test_engine_options_reject_bad_values(kwargs, match):
    with pytest.raises(K3Error, match=match):
        EngineOptions(**kwargs)


def test_engine_options_from_dict_names_unknown_keys():
    with pytest.raises(K3Error, match="unknown engine option 'prefix_cach'; did you mean 'prefix_cache'"):
        EngineOptions.from_dict({"prefix_cach": True})
    assert EngineOptions.from_dict({"prefix_cache": True}).prefix_cache


@pytest.mark.parametrize("kwargs, match", [
    ({"max_new_tokens": 0}, "max_new_tokens: expected an integer >= 1, got 0"),
    ({"temperature": -1.0}, "temperature: expected a number >= 0, got -1.0"),
    ({"seed": "x"}, "seed: expected an integer or None"),
], ids=["max-new-0", "neg-temp", "seed-type"])
def test_sampling_params_reject_bad_values(kwargs, match):
    with pytest.raises(K3Error, match=match):
        SamplingParams(**kwargs)


def test_add_request_rejects_bad_input(model):
    eng = Engine(model, EngineOptions(continuous_batching=True, device_cache_tokens=128))
    with pytest.raises(K3Error, match="expected at least one prompt token, got none"):
        eng.add_request([])
    with pytest.raises(K3Error, match="expected token ids in 0..271, got 300"):
        eng.add_request([1, 300])
    eng.add_request([1, 2], request_id="a")
    with pytest.raises(K3Error, match="request id 'a' is already in use"):
        eng.add_request([1, 2], request_id="a")
    with pytest.raises(K3Error, match="needs 215 tokens of MLA cache, the device pool holds 128"):
        eng.add_request(prompt(6, 200), SamplingParams(max_new_tokens=16))


# ---- registry -------------------------------------------------------------------------
def test_engine_toggles_are_registered_exact_with_their_mutants():
    for name in ENGINE_TOGGLES:
        t = toggles.get(name)
        assert t.contract.kind == "exact" and t.kind == "optimization"
        EngineOptions.from_dict(t.engine)          # every toggle's options stand on their own
    mutants = [t for t in toggles.all_toggles("mutant") if t.mutant_of in ENGINE_TOGGLES]
    assert {t.mutant_of for t in mutants} == set(ENGINE_TOGGLES)
    for t in mutants:
        assert t.caught_by and t.lives_in
        opts = EngineOptions.from_dict(t.engine)
        assert t.ops or opts.faults == {t.name}
    assert [t.name for t in toggles.resolve(["ckpt_with_mla_tail"])] == \
        ["prefix_cache", "prefix_cache_subblock", "ckpt_with_mla_tail"]


# ---- building blocks ------------------------------------------------------------------
def test_prefix_trie_longest_prefix():
    trie = PrefixTrie()
    trie.insert([1, 2, 3, 4])
    trie.insert([1, 2, 9])
    assert trie.longest_prefix([1, 2, 3, 7]) == 3
    assert trie.longest_prefix([1, 2, 9, 9]) == 3
    assert trie.longest_prefix([5]) == 0


def test_paged_cache_lru_eviction_and_row_round_trip():
    evicted = []
    cache = PagedMLACache([3], num_blocks=2, block_size=4, width=2, kv_width=None, dtype=torch.float32,
                          device=torch.device("cpu"), on_evict=lambda h, b: evicted.append(h))
    a, b = cache.allocate(), cache.allocate()
    assert cache.allocate() is None, "a full pool must refuse"
    rows = torch.arange(16, dtype=torch.float32).view(8, 2)
    cache.write([a, b], 0, {3: rows})
    assert torch.equal(cache.gather([a, b], 6)[3], rows[:6])
    assert cache.register(a, b"ha") and cache.register(b, b"hb")
    assert not cache.register(b, b"hc"), "a block has one hash"
    cache.release(b)
    cache.release(a)                    # a released last: b is the least recently used
    assert cache.num_free() == 2 and cache.share(b"ha") == a
    c = cache.allocate()
    assert c == b and evicted == [b"hb"] and not cache.has(b"hb") and cache.has(b"ha")


def test_kda_state_pool_slots_and_conv_restore(model):
    pool = KDAStatePool(model.new_state().kda, slots=2)
    s0, s1 = pool.acquire(), pool.acquire()
    assert pool.acquire() is None
    st = model.new_state()
    model.forward(torch.tensor(prompt(7, 9)), st)
    pool.load(s0, st.kda)
    assert all(torch.equal(pool.view(s0)[i].conv_k, st.kda[i].conv_k) for i in st.kda)
    pool.load(s1, st.kda, skip_conv=True)       # the seeded fault leaves the conv windows
    assert all(torch.equal(pool.view(s1)[i].recurrent, st.kda[i].recurrent) for i in st.kda)
    assert not any(torch.equal(pool.view(s1)[i].conv_k, st.kda[i].conv_k) for i in st.kda)
    pool.release(s1)
    assert pool.acquire() == s1 and not pool.view(s1)[next(iter(st.kda))].recurrent.any()


def test_pool_gather_is_each_slots_state_row_for_row(model):
    """The observers' stacked copies (gather by slot, one index_select per layer and tensor) hold,
    row i, the state of slots[i], in any slot order; copies, not views of the pool. The control:
    two slots with different states swapped in the list swap the rows."""
    pool = KDAStatePool(model.new_state().kda, slots=3)
    slots = [pool.acquire() for _ in range(3)]
    for seed, slot in zip((1, 2, 3), slots):
        st = model.new_state()
        model.forward(torch.tensor(prompt(seed, 5 + seed)), st)
        pool.load(slot, st.kda)
    order = [slots[2], slots[0]]
    got = pool.gather(order)
    assert set(got) == set(pool.layers)
    for layer, tensors in got.items():
        for name, t in tensors.items():
            want = torch.stack([pool.view(s)[layer].tensors()[name] for s in order])
            assert torch.equal(t, want) and t.data_ptr() != pool.pools[layer][name].data_ptr()
    swapped = pool.gather(order[::-1])
    layer = pool.layers[0]
    assert torch.equal(swapped[layer]["recurrent"][0], got[layer]["recurrent"][1])
    assert not torch.equal(swapped[layer]["recurrent"][0], got[layer]["recurrent"][0])
