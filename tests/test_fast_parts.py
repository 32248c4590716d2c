"""The pieces of the batched decode step (optimized_stack/engine/fast) against the reference's
per-request code, bit for bit, each with a negative control that must fail:

- conv_step (B windows at once, in place in the pool) == causal_conv per request;
- recurrent_step ([B, H, K, V]) == kda_recurrent per request, at 1 and 2 threads;
- paged_attention_cpu (B queries over paged pools) == blocked_attention per request, at 1 and
  2 threads, block sizes 16 / 64 / 128 (control: einsum scores);
- routed_static (experts on fixed-capacity buffers) == MoE.routed (control: torch's plain GEMM,
  whose row bits depend on the row count, gives other bits on the padded buffer);
- the block tables follow appends and new lists; build_meta puts padding on the spare slot.
"""
from __future__ import annotations

import pytest
import torch

from optimized_stack.engine.fast.batch import BlockTables, build_meta
from optimized_stack.engine.fast.kda_step import conv_step, recurrent_step
from optimized_stack.engine.fast.moe_static import placement, routed_static
from optimized_stack.engine.fast.paged_attention import paged_attention_cpu
from optimized_stack.model import ops
from optimized_stack.model.kda import causal_conv, kda_recurrent
from optimized_stack.model.mla import blocked_attention
from peer_fixtures import random_kda_inputs
from optimized_stack.model.moe import MoE
from model_fixtures import model  # noqa: F401  (the module-scoped k3-mini fixture)


@pytest.fixture(params=[1, 2], ids=["t1", "t2"])
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def test_conv_step_equals_causal_conv_per_request():
    g = torch.Generator().manual_seed(0)
    b, c, taps, slots = 5, 48, 4, 8
    pool = torch.randn(slots, taps - 1, c, generator=g)
    weight = torch.randn(c, 1, taps, generator=g)
    x = torch.randn(b, c, generator=g)
    slot = torch.tensor([6, 0, 3, 1, 7])
    want = [causal_conv(x[i:i + 1], pool[s].clone(), weight) for i, s in enumerate(slot.tolist())]
    before = pool.clone()
    y = conv_step(x, pool, slot, weight)
    for i, s in enumerate(slot.tolist()):
        assert torch.equal(y[i:i + 1], want[i][0]) and torch.equal(pool[s], want[i][1]), f"row {i}"
    untouched = [s for s in range(slots) if s not in slot.tolist()]
    assert torch.equal(pool[untouched], before[untouched]), "slots outside the batch changed"
    # the seeded fault (options.FAULTS mut_fast_conv_wrong_row) stores another row's input
    pool2 = before.clone()
    conv_step(x, pool2, slot, weight, wrong_row=True)
    assert not torch.equal(pool2[6], want[0][1]), "the wrong-row fault left the window right"


@pytest.mark.parametrize("b,h,k", [(1, 4, 16), (7, 4, 16), (33, 8, 128)], ids=["B1-K16", "B7-K16", "B33-K128"])
def test_recurrent_step_equals_kda_recurrent_per_request(threads, b, h, k):
    x = random_kda_inputs(b, b, h, k, k, with_state=False)       # one row per request
    q, kk, v, gate, beta = x.q, x.k, x.v, x.g, x.beta
    state = torch.randn(b, h, k, k, generator=torch.Generator().manual_seed(b + 1))
    o, new = recurrent_step(q, kk, v, gate, beta, state)
    for i in range(b):
        o_ref, s_ref = kda_recurrent(q[i:i + 1], kk[i:i + 1], v[i:i + 1], gate[i:i + 1], beta[i:i + 1], state[i])
        assert torch.equal(o[i], o_ref[0]) and torch.equal(new[i], s_ref), f"request {i}"


def _paged(lengths, block_size, h=4, c=24, nope=16, vd=16, lat=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    n_blocks = sum(need) + 2
    perm = torch.randperm(n_blocks, generator=g).tolist()
    rows = torch.randn(n_blocks * block_size, lat + c - nope, generator=g)
    kv = torch.randn(n_blocks * block_size, h * (nope + vd), generator=g)
    tables = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    at = 0
    for r, k in enumerate(need):
        tables[r, :k] = torch.tensor(perm[at:at + k], dtype=torch.int32)
        at += k
    q = torch.randn(len(lengths), h, c, generator=g)
    refs = []
    for r, n in enumerate(lengths):
        p = torch.arange(n)
        flat = tables[r][p // block_size].long() * block_size + p % block_size
        kv3 = kv[flat].view(n, h, nope + vd)
        k = torch.cat([kv3[..., :nope], rows[flat][:, lat:].unsqueeze(1).expand(-1, h, -1)], -1)
        refs.append((k, kv3[..., nope:]))
    pos = torch.tensor([n - 1 for n in lengths])
    return q, rows, kv, tables, pos, refs


def _model_pool(model, seed: int, lengths=(5, 64, 65, 130), bs: int = 16):
    """An MLA layer of the model and a random paged pool at its widths: (layer, q, pool, tables, pos)."""
    from optimized_stack.engine.fast.mla_step import PagedMLA
    layer = next(l.self_attn for l in model.model.layers if l.kind == "mla")
    cfg = model.config
    q, rows, kv, tables, pos, _ = _paged(lengths, bs, h=cfg.num_heads, c=cfg.qk_head_dim, nope=cfg.qk_nope_head_dim,
                                         vd=cfg.v_head_dim, lat=cfg.kv_lora_rank, seed=seed)
    return layer, q, PagedMLA(rows.view(-1, bs, rows.shape[-1]), kv.view(-1, bs, kv.shape[-1]), bs), tables, pos


def _request_rows(pool, table: torch.Tensor, n: int, kv: bool = False) -> torch.Tensor:
    """One request's first n rows of a pool through its table, gathered alone (the form the fast
    step's packed gather is compared with): [n, R] or [n, W]."""
    p = torch.arange(n, device=table.device)
    flat = table[p // pool.block_size].long() * pool.block_size + p % pool.block_size
    return (pool.kv if kv else pool.rows)[flat]


PAGED = [((1,), 64), ((5, 64, 65, 130, 1), 64), ((200, 3, 129, 128, 77, 63), 16), ((70, 256, 3), 128)]


@pytest.mark.parametrize("lengths,bs", PAGED, ids=[f"{'-'.join(map(str, l))}-bs{b}" for l, b in PAGED])
def test_paged_attention_cpu_equals_blocked_attention_per_request(threads, lengths, bs):
    q, rows, kv, tables, pos, refs = _paged(lengths, bs)
    out = paged_attention_cpu(q, rows, kv, tables, pos, 24 ** -0.5, nope=16, v_dim=16, block_size=bs)
    for r, (k, v) in enumerate(refs):
        want = blocked_attention(q[r:r + 1], k, v, pos[r:r + 1], 24 ** -0.5)
        assert torch.equal(out[r:r + 1], want), f"request {r} (length {lengths[r]}): {(out[r] - want[0]).abs().max()}"


def test_paged_attention_negative_control_einsum_scores_differ():
    """The same comparison on a form that sums the scores another way must fail somewhere."""
    lengths, bs = (200, 130, 77, 65), 64
    q, rows, kv, tables, pos, refs = _paged(lengths, bs, h=8, c=192, nope=128, vd=128, lat=64, seed=4)
    differ = 0
    for r, (k, v) in enumerate(refs):
        want = blocked_attention(q[r:r + 1], k, v, pos[r:r + 1], 192 ** -0.5)
        s = torch.einsum("hc,shc->hs", q[r], k) * 192 ** -0.5
        other = torch.einsum("hs,shv->hv", torch.softmax(s, -1), v)
        differ += not torch.equal(other, want[0])
    assert differ, "einsum-softmax attention gave blocked_attention's bits: the equality test proves nothing"


def _moe_inputs(model, t_len: int, seed: int = 0):
    moe = next(layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t_len, model.config.hidden_size, generator=g)
    idx, w = moe.gate(x)
    h = ops.OPS.linear(x, moe.routed_expert_down_proj.weight)
    return moe, h, idx, w


@pytest.mark.parametrize("t_len", [1, 3, 8, 21])
def test_routed_static_equals_the_per_expert_reference(model, t_len):
    moe, h, idx, w = _moe_inputs(model, t_len)
    assert torch.equal(routed_static(moe, h, idx, w), MoE.routed(moe, h, idx, w))


def test_routed_static_negative_control_plain_gemm_differs(model):
    """On torch's plain GEMM a row's bits depend on the row count: the padded buffer then gives
    other bits than the per-expert rows (what the row-invariant GEMM rules out)."""
    moe, h, idx, w = _moe_inputs(model, 21, seed=1)
    with ops.override(linear=ops.plain_linear):
        assert not torch.equal(routed_static(moe, h, idx, w), MoE.routed(moe, h, idx, w)), \
            "the plain GEMM gave equal bits: the static-capacity test proves nothing"


def test_placement_ranks_rows_per_expert_in_row_order():
    idx = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    flat, pos = placement(idx, 3)
    assert flat.tolist() == [2, 0, 0, 1, 2, 1, 0, 2]
    assert pos.tolist() == [0, 0, 1, 0, 1, 1, 2, 2]
    assert pos.dtype == torch.long


@pytest.mark.parametrize("tokens,top_k,n_exp", [(1, 2, 4), (64, 8, 64), (256, 8, 64), (300, 6, 7)])
def test_placement_equals_counting_earlier_choosers(tokens, top_k, n_exp):
    """Against the definition, counted directly: slot i's position is how many earlier slots chose
    its expert. Shapes of the H200 profile's B=64 and B=256 steps among them. The control: an
    off-by-one rank (the inclusive count) differs from the definition."""
    g = torch.Generator().manual_seed(tokens)
    idx = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(tokens)])
    flat, pos = placement(idx, n_exp)
    f = flat.tolist()
    counted = [sum(1 for j in range(i) if f[j] == f[i]) for i in range(len(f))]
    assert pos.tolist() == counted
    assert (pos + 1).tolist() != counted


def test_block_tables_follow_appends_and_new_lists():
    t = BlockTables(num_slots=3, spare_slot=2, max_blocks=4, spare_block=9, device="cpu")
    blocks = [5]
    t.sync(0, blocks)
    blocks.append(7)
    t.sync(0, blocks)
    assert t.tables[0].tolist() == [5, 7, 9, 9]
    t.sync(0, [1, 2, 3])                       # the slot's next request: a new list, rewritten
    assert t.tables[0, :3].tolist() == [1, 2, 3]   # (entries past it are never read: keys <= pos)
    assert t.tables[2].tolist() == [9, 9, 9, 9], "the spare slot's table must stay on the spare block"
    with pytest.raises(ValueError, match="holds 5 blocks, the tables have room for 4"):
        t.sync(1, [0, 1, 2, 3, 4])


def test_build_meta_pads_on_the_spare_slot():
    b = build_meta([11, 12, 13], [40, 7, 99], [4, 0, 2], spare_slot=8, size=4, pin=False)
    assert b.meta.tolist() == [[11, 12, 13, 0], [40, 7, 99, 0], [4, 0, 2, 8], [4, 0, 2, 8]]
    bad = build_meta([11, 12, 13], [40, 7, 99], [4, 0, 2], spare_slot=8, size=4, pin=False, pad_shares_table=True)
    assert bad.meta[3].tolist() == [4, 0, 2, 4], "the fault points padding at the first request's table"


def test_routed_static_grouped_is_close_and_its_fault_is_not(model):
    """The approx form (torch.bmm over every expert's buffer) agrees to rounding; its seeded
    fault (the highest expert dropped from the combine) does not."""
    from optimized_stack.engine.fast.moe_static import routed_static_grouped
    moe, h, idx, w = _moe_inputs(model, 21, seed=2)
    ref = MoE.routed(moe, h, idx, w)
    scale = ref.abs().max()
    assert (routed_static_grouped(moe, h, idx, w) - ref).abs().max() <= 1e-5 * scale
    assert (routed_static_grouped(moe, h, idx, w, _drop_last=True) - ref).abs().max() > 1e-2 * scale


@pytest.mark.parametrize("op", ["reference", "mla_sdpa", "mla_absorbed"])
def test_one_by_one_on_packed_rows_gives_each_request_its_own_calls_bits(model, op):
    """_one_by_one gathers every request's rows in one go (packed_rows) and calls the op per request
    on its slice: each output row must be bitwise the op called on that request's own gathered rows
    (_request_rows), the form before, for the reference attention, an attention op (mla_sdpa) and a
    decode op (mla_absorbed's own, not its paged form). Slots out of order, one reused table."""
    from optimized_stack import toggles
    from optimized_stack.engine.fast.mla_step import _one_by_one
    from optimized_stack.model.mla import blocked_attention
    from optimized_stack.model.ops import OPS
    layer, q, pool, tables, pos = _model_pool(model, seed=7)
    cfg = model.config
    order = torch.tensor([2, 0, 3, 1, 2])                 # table slots out of order, slot 2 twice
    q5, pos5 = torch.cat([q, q[:1]]), pos[order]
    h, nope, lat = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank

    def alone(b: int) -> torch.Tensor:
        slot, n = int(order[b]), int(pos5[b]) + 1
        r = _request_rows(pool, tables[slot], n)
        if OPS.mla_decode is not None:
            return OPS.mla_decode(layer, q5[b:b + 1], r, pos5[b:b + 1])
        kv3 = _request_rows(pool, tables[slot], n, kv=True).view(n, h, nope + cfg.v_head_dim)
        k = torch.cat([kv3[..., :nope], r[:, lat:].unsqueeze(1).expand(-1, h, -1)], -1)
        return (OPS.attention or blocked_attention)(q5[b:b + 1], k, kv3[..., nope:], pos5[b:b + 1],
                                                    cfg.qk_head_dim ** -0.5)

    names = [] if op == "reference" else [op]
    with toggles.applied(names):
        got = _one_by_one(layer, q5, pool, tables, order, pos5)
        for b in range(len(order)):
            assert torch.equal(got[b:b + 1], alone(b)), f"{op}: request {b} differs from its own call"
        # control: another request's own call gives other bits, so a slice mix-up would be seen
        assert not torch.equal(got[1:2], alone(0))


def test_paged_absorbed_cpu_is_the_absorbed_op_per_request_to_rounding(model):
    """The batched paged form of mla_absorbed (what the fast step runs under that toggle) against
    the toggle's own op on each request's rows: approx (another summation order), 1e-5 relative."""
    from optimized_stack.engine.fast.absorbed_step import paged_absorbed
    from optimized_stack.kernels.mla.absorbed import mla_absorbed
    layer, q, pool, tables, pos = _model_pool(model, seed=6)
    slots = torch.arange(q.shape[0])
    got = paged_absorbed(layer, q, pool, tables, slots, pos)
    for b, n in enumerate((pos + 1).tolist()):
        want = mla_absorbed(layer, q[b:b + 1], _request_rows(pool, tables[b], n), pos[b:b + 1])
        assert (got[b] - want[0]).abs().max() <= 1e-5 * want.abs().max(), f"request {b}"


def test_batched_decode_runs_the_absorbed_toggle_batched(model):
    """Under mla_absorbed the fast step takes its paged form (no per-request fallback) and stays
    within the toggle's drift of the reference (the verifier's approx gate judges it for real)."""
    from optimized_stack import toggles
    from optimized_stack.engine import Engine, EngineOptions, SamplingParams
    from optimized_stack.engine.fast.mla_step import PAGED_FORMS
    from optimized_stack.model.ops import OPS
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (30, 70, 45)]
    runs = {}
    for fast in (False, True):
        with toggles.applied(["mla_absorbed"]) as ap:
            assert toggles.base_form(OPS.mla_decode) in PAGED_FORMS      # behind the slot's counting wrapper
            eng = Engine(model, EngineOptions(continuous_batching=True, projected_kv_cache=True, batched_decode=fast))
            for p in prompts:
                eng.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True))
            runs[fast] = {k: r.tokens for k, r in eng.run().items()}
            if fast:
                assert eng.fast.stats.steps > 0
                # the paged form ran in the slot's place and counted as the toggle's decode op
                assert ap.events.get("op:mla_decode", 0) > 0
    assert runs[True] == runs[False]


def test_the_fast_step_finds_a_paged_form_for_the_mla_ops_that_have_one():
    """mla_absorbed (decode slot) and mla_flash_bf16 (attention slot) decode batched through their
    paged forms; mla_sdpa (attention slot, torch's SDPA) has none and stays one request at a time,
    which the capture check names. The forms run on CUDA (the kernel) and under Triton's interpreter
    (tests/test_fast_paged_kernel.py); here the dispatch, with the ops behind their counting wrappers."""
    from optimized_stack import toggles
    from optimized_stack.engine.fast.mla_step import paged_absorbed, paged_flash_bf16, paged_form
    assert paged_form() is None                                            # the reference: attend's own path
    for name, want in (("mla_absorbed", paged_absorbed), ("mla_flash_bf16", paged_flash_bf16),
                       ("mla_sdpa", None)):
        with toggles.applied([name]):
            assert paged_form() is want, name


@pytest.mark.parametrize("with_rows_form", [True, False], ids=["rows-form", "partial-one-by-one"])
def test_a_kda_decode_op_with_a_rows_form_runs_once_over_the_rows(monkeypatch, with_rows_form):
    """A KDA decode toggle's op with a rows form (kda_step.ROW_FORMS: fla's kernels over B
    sequences of one token) runs that form once over the B rows, counted as one call of the slot,
    and its states land in the request's slots; an op without one (a mutant's functools.partial)
    runs one request at a time, B calls. Stand-ins on the CPU: kda_recurrent per request and
    recurrent_step over the rows (bitwise equal, the test above), so both give the same bits."""
    import functools

    from optimized_stack import toggles
    from optimized_stack.engine.fast import kda_step
    from optimized_stack.events import Events
    b, h, k = 5, 4, 16
    x = random_kda_inputs(3, b, h, k, k, with_state=False)
    pool = torch.randn(b + 3, h, k, k, generator=torch.Generator().manual_seed(4))
    slots = torch.tensor([6, 0, 3, 7, 1])
    calls = []

    def rows_form(q, kk, v, g, beta, states):
        calls.append(q.shape[0])
        return recurrent_step(q, kk, v, g, beta, states)

    monkeypatch.setattr(kda_step, "ROW_FORMS", {kda_recurrent: rows_form})
    op = kda_recurrent if with_rows_form else functools.partial(kda_recurrent)
    events = Events()
    work = pool.clone()
    with ops.override(kda_decode=toggles._counted(op, "op:kda_decode", events)):
        o = kda_step._one_by_one(x.q, x.k, x.v, x.g, x.beta, work, slots)
    assert calls == ([b] if with_rows_form else [])
    assert events["op:kda_decode"] == (1 if with_rows_form else b)
    for i, s in enumerate(slots.tolist()):
        o_ref, s_ref = kda_recurrent(x.q[i:i + 1], x.k[i:i + 1], x.v[i:i + 1], x.g[i:i + 1], x.beta[i:i + 1], pool[s])
        assert torch.equal(o[i], o_ref[0]) and torch.equal(work[s], s_ref), f"request {i}"
    untouched = sorted(set(range(b + 3)) - set(slots.tolist()))
    assert torch.equal(work[untouched], pool[untouched])


def test_the_fla_decode_toggles_have_rows_forms_and_their_mutants_do_not():
    """The real mapping (the test above patches it): kda_fla_chunk's and kda_fla_recurrent's decode ops
    take a rows form; their mutants' ops (partials of the same forms) run one request at a time."""
    from optimized_stack import toggles
    from optimized_stack.engine.fast.kda_step import ROW_FORMS
    for name in ("kda_fla_chunk", "kda_fla_recurrent"):
        assert toggles.base_form(toggles.get(name).ops["kda_decode"]) in ROW_FORMS, name
    for name in ("mut_fla_chunk_drops_state", "mut_fla_recurrent_state_transposed"):
        assert toggles.base_form(toggles.get(name).ops["kda_decode"]) not in ROW_FORMS, name
