"""What only a GPU can prove about the fast decode path (marker `gpu`; skipped with the reason on
a CPU; run by scripts/gpu_engine_bench.sh on the H200):

- fla's fused_recurrent_kda over the state pool in place (ssm_state_indices, inplace_final_state)
  and the gather form both give, per request, the bits of the reference decode (fla_recurrent,
  one request per call), at k3-mini's and k3-small's head sizes and B = 1, 3, 64;
- the rows forms of the fla decode toggles (one call over B rows) give each request the bits of
  the toggle's op called on it alone;
- the batched step on the GPU profile: padding to a ladder size changes no real row's bits;
- a CUDA graph replay of the step == the eager step, bit for bit (logits and the pools), over
  several replays at several sizes, and the engine with cuda_graphs == the engine without;
- the stale-input graph fault is caught; the step under the reference ops is capturable.
The engine-level verdicts (every scenario, every check, the mutants) are the GPU exactness run's:
`python -m k3verify.perf.gpu_exactness --sections exact,mutants --only batched_decode,cuda_graphs`.
"""
from __future__ import annotations

import pytest
import torch

from peer_fixtures import random_kda_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200 run: scripts/gpu_engine_bench.sh)")]

OPTS = dict(continuous_batching=True, projected_kv_cache=True, batched_decode=True, max_num_seqs=8)


def _kda_inputs(b, h, k, seed=0):
    """One decode row per request and a state pool with 5 spare slots, on the GPU."""
    x = random_kda_inputs(seed, b, h, k, k, with_state=False)
    pool = torch.randn(b + 5, h, k, k, generator=torch.Generator().manual_seed(seed + 1))
    return [t.cuda() for t in (x.q, x.k, x.v, x.g, x.beta, pool)]


@pytest.mark.parametrize("form", ["inplace", "gather"])
@pytest.mark.parametrize("b,h,k", [(1, 4, 16), (3, 4, 16), (64, 8, 128), (3, 8, 128)])
def test_batched_fla_decode_equals_the_reference_decode(form, b, h, k):
    from optimized_stack.engine.fast.kda_step import _fla_gather, _fla_inplace
    from optimized_stack.kernels.kda.fla import fla_recurrent
    q, kk, v, gate, beta, pool = _kda_inputs(b, h, k)
    slots = torch.randperm(b + 5, generator=torch.Generator().manual_seed(1))[:b].cuda()
    want = [fla_recurrent(q[i:i + 1], kk[i:i + 1], v[i:i + 1], gate[i:i + 1], beta[i:i + 1], pool[s])
            for i, s in enumerate(slots.tolist())]
    work = pool.clone()
    o = (_fla_inplace if form == "inplace" else _fla_gather)(q, kk, v, gate, beta, work, slots)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(o[i], want[i][0][0]), f"{form} B={b} K={k}: output of request {i} differs"
        assert torch.equal(work[s], want[i][1]), f"{form} B={b} K={k}: state of request {i} differs"


@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
@pytest.mark.parametrize("b,h,k", [(3, 4, 16), (64, 8, 128)])
def test_fla_rows_forms_equal_one_request_per_call(kernel, b, h, k):
    """The rows forms the fast step runs under kda_fla_chunk / kda_fla_recurrent (kda_step.ROW_FORMS,
    one call over B sequences of one token) give each request the bits of the toggle's own op called
    on that request alone: the toggle has one arithmetic, whichever form the engine takes."""
    from optimized_stack.kernels.kda import fla
    one, rows = {"chunk": (fla.fla_chunk, fla.fla_chunk_rows),
                 "recurrent": (fla.fla_recurrent, fla.fla_recurrent_rows)}[kernel]
    q, kk, v, gate, beta, pool = _kda_inputs(b, h, k)
    o, finals = rows(q, kk, v, gate, beta, pool[:b])
    for i in range(b):
        o_ref, s_ref = one(q[i:i + 1], kk[i:i + 1], v[i:i + 1], gate[i:i + 1], beta[i:i + 1], pool[i])
        assert torch.equal(o[i], o_ref[0]), f"{kernel} B={b} K={k}: output of request {i} differs"
        assert torch.equal(finals[i], s_ref), f"{kernel} B={b} K={k}: state of request {i} differs"


@pytest.fixture(scope="module")
def gpu_model():
    from optimized_stack import load_model
    return load_model(None, device="cuda", dtype=torch.bfloat16)


def _engine(model, n, **extra):
    from optimized_stack.engine import Engine, EngineOptions
    eng = Engine(model, EngineOptions(**{**OPTS, **extra}))
    g = torch.Generator().manual_seed(5)
    for i in range(n):
        eng.add_request(torch.randint(0, 256, (20 + 37 * i,), generator=g).tolist())
    # until all n run in decode: the token budget admits them over several steps, and a row of
    # the meta past the running requests is padding, whose logits are garbage by design
    for _ in range(4 * n):
        eng.step()
        running = eng.scheduler.running
        if len(running) == n and all(r.num_computed == len(r.tokens) - 1 for r in running):
            return eng
    raise AssertionError(f"{n} requests were not all decoding after {4 * n} steps")


def _pools(eng):
    st = eng.store
    out = {f"kda{i}.{n}": t for i, p in st.pool.pools.items() for n, t in p.items()}
    out.update({f"rows{i}": t for i, t in st.mla.rows.items()})
    out.update({f"kv{i}": t for i, t in st.mla.kv.items()})
    return out


def _real(eng, tensors):
    """The parts of the pools that belong to requests (every slot and block but the spare)."""
    st = eng.store
    return {k: (t[:st.pool.slots] if k.startswith("kda") else t[:st.mla.num_blocks]).clone() for k, t in tensors.items()}


def _meta(eng, size):
    from optimized_stack.engine.fast.batch import build_meta
    reqs = eng.scheduler.running
    for r in reqs:
        eng.fast.step.tables.sync(r.slot, r.blocks)
    return build_meta([r.tokens[-1] for r in reqs], [r.num_computed for r in reqs], [r.slot for r in reqs],
                      eng.fast.step.spare_slot, size, pin=True).meta


@pytest.mark.parametrize("n", [1, 3, 5])
def test_padding_changes_no_real_bits_on_the_gpu(gpu_model, n):
    from optimized_stack.engine.fast.batch import padded_size
    eng = _engine(gpu_model, n)
    live = _pools(eng)
    saved = {k: t.clone() for k, t in live.items()}
    results = {}
    for size in sorted({n, padded_size(n), 8}):
        for k, t in saved.items():
            live[k].copy_(t)
        logits, _ = eng.fast.step.forward(_meta(eng, size).cuda())
        results[size] = (logits[:n].clone(), _real(eng, live))
    base_logits, base_pools = results[n]
    for size, (logits, pools) in results.items():
        assert torch.equal(logits, base_logits), f"B={n} padded to {size}: logits differ"
        assert all(torch.equal(pools[k], base_pools[k]) for k in pools), f"B={n} padded to {size}: state differs"


def test_graph_replay_equals_eager(gpu_model):
    from optimized_stack.engine.fast.graphs import GraphRunner
    eng = _engine(gpu_model, 5)
    step = eng.fast.step
    assert step.capturable() is None, step.capturable()
    live = _pools(eng)
    start = {k: t.clone() for k, t in live.items()}
    runner = GraphRunner(step)
    for size in (8, 16):
        for k, t in start.items():
            live[k].copy_(t)
        eager = []
        meta = _meta(eng, size)
        for _ in range(3):                                   # three steps, fed their own tokens
            logits, sampled = step.forward(meta.cuda())
            eager.append((logits.clone(), _real(eng, live)))
            meta[0, :5] = sampled[0, :5].cpu()
            meta[1, :5] += 1
        for k, t in start.items():
            live[k].copy_(t)
        meta = _meta(eng, size)
        for i in range(3):
            logits, sampled = runner.run(meta)
            torch.cuda.synchronize()
            assert torch.equal(logits[:5], eager[i][0][:5]), f"size {size} replay {i}: logits differ from eager"
            bad = [k for k, t in _real(eng, live).items() if not torch.equal(t, eager[i][1][k])]
            assert not bad, f"size {size} replay {i}: pools differ from eager: {bad[:3]}"
            meta = meta.clone()
            meta[0, :5] = sampled[0, :5].cpu()
            meta[1, :5] += 1
    assert runner.captures == 2 and runner.replays == 6


def _tokens_and_rows(model, **extra):
    from optimized_stack.engine import Engine, EngineObserver, EngineOptions, SamplingParams

    class Rows(EngineObserver):
        def __init__(self):
            self.rows = {}

        def on_logits(self, rid, start, rows):
            for i in range(rows.shape[0]):
                self.rows[(rid, start + i)] = rows[i].float().cpu()
    cap = Rows()
    eng = Engine(model, EngineOptions(**{**OPTS, **extra}), [cap])
    g = torch.Generator().manual_seed(9)
    for i, n in enumerate((40, 90, 55, 70, 30, 85)):
        eng.add_request(torch.randint(0, 256, (n,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=6, ignore_eos=True), arrival_step=i // 2)
    res = eng.run()
    return {k: r.tokens for k, r in res.items()}, cap.rows, eng.fast.stats if eng.fast is not None else None


def test_engine_with_graphs_equals_the_engine_without(gpu_model):
    toks, rows, _ = _tokens_and_rows(gpu_model)
    g_toks, g_rows, stats = _tokens_and_rows(gpu_model, cuda_graphs=True)
    assert stats.graph_replays > 0 and stats.eager_reason is None, stats
    assert g_toks == toks
    assert all(torch.equal(g_rows[k], rows[k]) for k in rows), "a logits row differs under graphs"


def test_the_stale_input_fault_is_caught(gpu_model):
    toks, rows, _ = _tokens_and_rows(gpu_model)
    bad_toks, bad_rows, stats = _tokens_and_rows(gpu_model, cuda_graphs=True, faults=frozenset({"mut_graph_stale_input"}))
    assert stats.graph_replays > 0
    assert bad_toks != toks or any(not torch.equal(bad_rows[k], rows[k]) for k in rows), \
        "replays on stale token ids gave the right rows: the graph check proves nothing"


def test_the_absorbed_toggle_is_captured_and_replays_like_eager(gpu_model):
    """mla_absorbed inside the fast step on the GPU: its paged kernel runs in the graphs (no
    eager fallback), and replay == eager bit for bit under it too."""
    from optimized_stack import toggles
    with toggles.applied(["mla_absorbed"]):
        toks, rows, _ = _tokens_and_rows(gpu_model)
        g_toks, g_rows, stats = _tokens_and_rows(gpu_model, cuda_graphs=True)
    assert stats.graph_replays > 0 and stats.eager_reason is None, stats
    assert g_toks == toks and all(torch.equal(g_rows[k], rows[k]) for k in rows)


def test_the_flash_bf16_toggle_decodes_batched_with_the_bits_of_its_one_request_calls(gpu_model):
    """mla_flash_bf16's decode in the fast step (mla_step.paged_flash_bf16, eager and in graphs) gives
    every row the bits of the engine without the fast step, where each request calls the toggle's
    attention alone; the fast step took the paged form (no eager fallback, graphs replayed)."""
    from optimized_stack import toggles
    with toggles.applied(["mla_flash_bf16"]) as ap:
        toks, rows, _ = _tokens_and_rows(gpu_model, batched_decode=False)
        b_toks, b_rows, b_stats = _tokens_and_rows(gpu_model)
        g_toks, g_rows, g_stats = _tokens_and_rows(gpu_model, cuda_graphs=True)
    assert ap.events.get("op:attention", 0) > 0 and b_stats.steps > 0
    assert g_stats.graph_replays > 0 and g_stats.eager_reason is None, g_stats
    for name, (t, r) in {"batched": (b_toks, b_rows), "graphs": (g_toks, g_rows)}.items():
        assert t == toks, f"{name}: tokens differ from the one-request calls"
        assert all(torch.equal(r[k], rows[k]) for k in rows), f"{name}: a logits row differs"


def test_paged_absorbed_kernel_in_bf16_is_close_to_fp64():
    from optimized_stack.kernels.mla.paged_absorbed import paged_absorbed_attention
    g = torch.Generator().manual_seed(2)
    h, lat, rope, bs, n = 8, 512, 64, 64, 700
    rows = torch.randn(12 * bs, lat + rope, generator=g).bfloat16().cuda()
    tables = torch.tensor([[3, 7, 1, 0, 9, 2, 5, 4, 6, 8, 10, 11]], dtype=torch.int32).cuda()
    q_lat = (torch.randn(1, h, lat, generator=g) / lat ** 0.5).bfloat16().cuda()
    q_rope = (torch.randn(1, h, rope, generator=g) / rope ** 0.5).bfloat16().cuda()
    pos = torch.tensor([n - 1]).cuda()
    out = paged_absorbed_attention(q_lat, q_rope, rows, tables, torch.tensor([0]).cuda(), pos, 1.0, block_size=bs)
    p = torch.arange(n)
    r = rows[(tables[0].cpu()[p // bs].long() * bs + p % bs).cuda()].double().cpu()
    s = q_lat[0].double().cpu() @ r[:, :lat].T + q_rope[0].double().cpu() @ r[:, lat:].T
    want = torch.softmax(s, -1) @ r[:, :lat]
    err = (out[0].double().cpu() - want).abs().max() / want.abs().max()
    assert err <= 2e-2, f"bf16 absorbed attention off by {err:.2e} of max"
