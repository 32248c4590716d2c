"""prefill_sorted_experts (kernels/moe/sorted.py): bit-identical to MoE.routed, without a `nonzero`
per expert, with a fraction of its launches; its seeded fault differs; the engine runs it only where
no toggle put its own experts in the slot."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optimized_stack.engine import Engine, EngineOptions, SamplingParams
from optimized_stack.kernels.moe.sorted import routed_sorted, routed_sorted_weights_unsorted
from optimized_stack.model import ops
from optimized_stack.model.moe import MoE
from optimized_stack.presets import init_model, preset_config

# ops that only make a view (no kernel launch on a GPU)
VIEWS = {"view", "slice", "unsqueeze", "t", "expand", "select", "squeeze", "transpose", "permute",
         "as_strided", "_unsafe_view", "alias", "detach", "split", "unbind", "reshape", "_reshape_alias"}


class OpCount(TorchDispatchMode):
    """Counts the ops that launch work, by name; OPS.linear calls count once each (its CPU form
    is several tiled ops; on the GPU it is one GEMM)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.in_linear = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.in_linear and name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def counting_linear(mode: OpCount):
    def linear(x, w):
        mode.ops["LINEAR"] += 1
        mode.in_linear = True
        try:
            return ops.row_linear(x, w)
        finally:
            mode.in_linear = False
    return linear


@pytest.fixture(scope="module", params=[("k3-mini", torch.float32), ("k3-mini", torch.bfloat16),
                                        ("k3-small", torch.bfloat16)], ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
def moe_layer(request):
    name, dtype = request.param
    model = init_model(preset_config(name)).eval().to(dtype)
    return next(layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))


def routing(moe, n_tok: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dtype = moe.gate.weight.dtype
    x = torch.randn(n_tok, moe.cfg.hidden_size, generator=g).to(dtype)
    idx, w = moe.gate(x)
    h = torch.randn(n_tok, moe.experts[0].w1.weight.shape[1], generator=g).to(dtype)
    return h, idx, w


@pytest.mark.parametrize("n_tok", [1, 3, 8, 37, 130])
def test_sorted_experts_are_bit_identical_to_the_reference(moe_layer, n_tok):
    h, idx, w = routing(moe_layer, n_tok, seed=n_tok)
    with torch.no_grad():
        ref = MoE.routed(moe_layer, h, idx, w)
        got = routed_sorted(moe_layer, h, idx, w)
        bad = routed_sorted_weights_unsorted(moe_layer, h, idx, w)
    assert got.dtype == ref.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), "sorted experts differ from MoE.routed in bits"
    # negative control: the seeded fault (weights not permuted with the rows) is far off, not a rounding
    assert (bad - ref).abs().max() > 1e-3


def test_experts_no_row_chose_are_skipped_and_still_exact(moe_layer):
    """Every row routed to the same k experts: all other experts get no rows (empty groups)."""
    h, idx, w = routing(moe_layer, 16, seed=5)
    idx = idx[:1].expand_as(idx).contiguous()
    w = w[:1].expand_as(w).contiguous()
    with torch.no_grad():
        assert torch.equal(routed_sorted(moe_layer, h, idx, w), MoE.routed(moe_layer, h, idx, w))


def test_sorted_experts_launch_a_fraction_of_the_reference_and_no_nonzero():
    """What the toggle is for (a prefill step is host-bound on the GPU): count the ops that launch
    work. The reference pays a `nonzero` (a device-to-host sync) and ~30 ops per active expert."""
    model = init_model(preset_config("k3-small")).eval().to(torch.bfloat16)
    moe = next(layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    h, idx, w = routing(moe, 256, seed=0)
    counts = {}
    for name, form in (("reference", MoE.routed), ("sorted", routed_sorted)):
        mode = OpCount()
        with torch.no_grad(), ops.override(linear=counting_linear(mode)), mode:
            form(moe, h, idx, w)
        counts[name] = mode.ops
    active = int((torch.bincount(idx.reshape(-1), minlength=len(moe.experts)) > 0).sum())
    # one `nonzero` per expert (a sync each), used or not; none in the sorted form
    assert counts["reference"]["nonzero"] == len(moe.experts) and counts["sorted"]["nonzero"] == 0
    assert counts["reference"]["LINEAR"] == counts["sorted"]["LINEAR"] == 3 * active
    ref_n, new_n = sum(counts["reference"].values()), sum(counts["sorted"].values())
    assert new_n * 3 < ref_n, f"sorted experts run {new_n} ops against the reference's {ref_n}"


def test_the_engine_runs_sorted_experts_only_when_no_toggle_holds_the_slot():
    model = init_model(preset_config("k3-mini")).eval()
    prompt = list(range(5, 45))

    def run(opts, **slots):
        engine = Engine(model, opts)
        engine.add_request(prompt, SamplingParams(max_new_tokens=3), request_id="r")
        with ops.override(**slots):
            out = engine.run()["r"].tokens
        return out, engine.events.get("prefill_sorted_experts", 0)

    plain, fired_off = run(EngineOptions())
    on = EngineOptions(prefill_sorted_experts=True, batched_decode=True, projected_kv_cache=True,
                       continuous_batching=True)
    tokens, fired = run(on)
    assert fired_off == 0 and fired > 0 and tokens == plain
    # a toggle's own experts in the slot win: the sorted form does not run
    _, fired_with_slot = run(on, moe_experts=MoE.routed)
    assert fired_with_slot == 0


def test_fused_situ_on_the_cpu_is_the_torch_form_and_fires_nothing():
    """fused_situ's kernel runs on CUDA tensors only: on the CPU the decode step's static experts and
    the sorted prefill experts keep model/ops.py situ (the same tokens as without the option) and its
    event never fires, so the CPU gate cannot mistake the torch form for the kernel's evidence."""
    model = init_model(preset_config("k3-mini")).eval()
    base = dict(prefill_sorted_experts=True, batched_decode=True, projected_kv_cache=True, continuous_batching=True)

    def run(**extra):
        engine = Engine(model, EngineOptions(**base, **extra))
        engine.add_request(list(range(5, 45)), SamplingParams(max_new_tokens=4), request_id="r")
        return engine.run()["r"].tokens, engine.events

    plain, _ = run()
    tokens, events = run(fused_situ=True)
    assert tokens == plain and events["fast_decode_rows"] > 0 and events["prefill_sorted_experts"] > 0
    assert events.get("fused_situ", 0) == 0, "the fused SiTU-GLU's event fired on the CPU, where no kernel ran"
