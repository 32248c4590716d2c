"""The FP8 toggles (issue 28): the e4m3 per-row quantizer's error bound, per-row against
per-tensor scales on rows of very different magnitude, and each toggle within its declared
budget on a short scenario with its seeded faults outside it and its path events fired.
"""
from __future__ import annotations

import pytest
import torch

from k3verify.run.runner import Runner
from k3verify.scenarios import workloads
from k3verify.verdict.gate import check_toggle
from optimized_stack import load_model
from optimized_stack.config import KDA
from optimized_stack import toggles as registry
from optimized_stack.kernels.fp8_rows import E4M3, E4M3_MAX, fp8_roundtrip, quantize_rows
from optimized_stack.parallel import Comm, TPModel, TPOptions
from optimized_stack.parallel.dcp_fp8 import gather_context_fp8

# e4m3fn: 3 mantissa bits, smallest normal 2^-6, subnormal spacing 2^-9. Round to nearest:
# a normal value moves by at most half its ulp = 2^-4 of itself, a subnormal by half the
# spacing = 2^-10; both in the scaled domain (x / scale), so back in x's units:
REL_NORMAL = 2.0 ** -4
ABS_SUBNORMAL = 2.0 ** -10
FP32_SLACK = 2.0 ** -22          # the fp32 divide and multiply around the cast (2^-24 each)


def roundtrip_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.maximum(REL_NORMAL * x.abs(), ABS_SUBNORMAL * scale) + FP32_SLACK * x.abs()


def rows_of_many_magnitudes(seed: int) -> torch.Tensor:
    """[64, 96]: each row's values spread over 2^-20..2^0 of the row's own magnitude, rows 2^-30..2^30."""
    g = torch.Generator().manual_seed(seed)
    mag = 2.0 ** torch.randint(-30, 31, (64, 1), generator=g).float()
    spread = 2.0 ** (-20 * torch.rand(64, 96, generator=g))
    sign = torch.where(torch.rand(64, 96, generator=g) < 0.5, -1.0, 1.0)
    return mag * spread * sign


# ---- the quantizer -------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_roundtrip_error_is_within_e4m3s_bound_per_row_and_the_bound_is_tight(seed):
    x = rows_of_many_magnitudes(seed)
    q, scale = quantize_rows(x, 1)
    assert q.dtype == E4M3 and scale.shape == (64, 1), "one e4m3 value per entry, one fp32 scale per row"
    err = (x - fp8_roundtrip(x, 1)).abs()
    ratio = err / roundtrip_bound(x, scale)
    worst = ratio.flatten().argmax()
    assert ratio.max() <= 1.0, (f"|x - dq(q(x))| <= max(2^-4 |x|, 2^-10 scale): exceeded {float(ratio.max()):.4f}x "
                                f"at {divmod(int(worst), 96)}, x={float(x.flatten()[worst]):.6g}")
    # a bound nothing comes near would pass a quantizer with one bit less: it must be reached
    assert ratio.max() > 0.9, f"the bound is loose: the worst value reaches only {float(ratio.max()):.3f} of it"
    # each row's amax maps onto 448 itself, so the largest entry of every row is kept exactly
    amax_err = (x.abs().amax(1) - fp8_roundtrip(x, 1).abs().amax(1)).abs() / x.abs().amax(1)
    assert amax_err.max() <= FP32_SLACK, "a row's amax must map onto e4m3's 448 and come back"


def test_values_on_the_e4m3_grid_come_back_exactly_and_zero_rows_stay_zero():
    grid = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    grid = grid[torch.isfinite(grid)].view(2, -1)                     # every finite e4m3 value
    assert float(grid.abs().max()) == E4M3_MAX
    assert torch.equal(fp8_roundtrip(grid, 1), grid), "e4m3 values with amax 448 are their own storage"
    zeros = torch.zeros(3, 8)
    assert torch.equal(fp8_roundtrip(zeros, 1), zeros), "a zero row gets scale 1, not 0/0"


def test_per_tensor_scale_breaks_the_per_row_bound_on_rows_of_different_magnitude():
    """The negative control of the bound above: one scale for rows 10^6 apart pushes the small
    row under e4m3's subnormals, where it rounds to zero (relative error 1, not 2^-4)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, generator=g) * torch.tensor([[1e3], [1e-3]])
    per_row = (x - fp8_roundtrip(x, 1)).abs()
    per_tensor = (x - fp8_roundtrip(x, 1, fault="per_tensor")).abs()
    _, scale = quantize_rows(x, 1)
    assert (per_row <= roundtrip_bound(x, scale)).all()
    small = per_tensor[1] / x[1].abs()
    assert (per_tensor > roundtrip_bound(x, scale)).any(), "per-tensor must break the per-row bound here"
    assert small.max() > 0.5, f"the small row under a per-tensor scale: worst relative error {float(small.max()):.3f}"
    # the large row sets the tensor's scale: it alone is unharmed
    assert torch.equal(per_tensor[0], per_row[0])


def test_the_wrong_scale_faults_and_unknown_faults_are_refused():
    x = rows_of_many_magnitudes(3)
    assert torch.equal(fp8_roundtrip(x, 1, fault="dequant_scale_x2"), 2 * fp8_roundtrip(x, 1))
    q, scale = quantize_rows(x, 1)
    shifted = q.float() * scale.roll(1, 0)                          # row i read with row i-1's scale
    assert torch.equal(fp8_roundtrip(x, 1, fault="row_shifted_scale"), shifted)
    with pytest.raises(ValueError, match="fp8 fault must be one of"):
        fp8_roundtrip(x, 1, fault="per_column")
    with pytest.raises(ValueError, match="row_dims must be in 1..1 for a 2-d tensor, got 2"):
        quantize_rows(x, 2)


def test_dcp_fp8_gather_at_world_size_1_is_the_rows_roundtrip_in_position_order():
    rows = rows_of_many_magnitudes(4)[:10]
    full = gather_context_fp8(rows, 10, Comm(0, 1))
    assert torch.equal(full, fp8_roundtrip(rows, 1))
    per_tensor = gather_context_fp8(rows, 10, Comm(0, 1), frozenset({"dcp_fp8_per_tensor"}))
    assert torch.equal(per_tensor, fp8_roundtrip(rows, 1, fault="per_tensor"))


# ---- the toggles on k3-mini ----------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_model()          # the embedded trained k3-mini (the preset name is random weights)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runner(model):
    return Runner(model)


@pytest.fixture(scope="module")
def short():
    return workloads.build("single", scale=0.5)


def test_registry_declares_the_fp8_toggles_and_their_mutants():
    for name, slot, faults in (("moe_fp8_stage2", "moe_experts", ["row_shifted_scale"]),
                               ("mla_fp8_prefill", "mla_prefill", ["dequant_scale_x2"]),
                               ("dcp_fp8_allgather", None, ["dequant_scale_x2"])):
        t = registry.get(name)
        muts = [m for m in registry.all_toggles("mutant") if m.mutant_of == name]
        assert sorted(m.name.rsplit("_fp8_", 1)[1] for m in muts) == faults, name
        assert all(m.contract == t.contract and m.caught_by == ("drift_budget",) for m in muts)
        if slot is not None:
            assert t.contract.kind == "approx" and set(t.contract.quality) == {"gsm8k", "needle"}, name
            assert t.events == (f"op:{slot}",) and set(t.ops) == {slot}, name
    dcp = registry.get("dcp_fp8_allgather")
    assert dcp.requires == ("dcp_mla",) and dcp.world_sizes == (2, 4, 8) and dcp.contract.quality == ()
    assert dcp.events == ("dcp_fp8_gather",)


@pytest.mark.parametrize("name", ["moe_fp8_stage2", "mla_fp8_prefill"])
def test_fp8_toggle_is_within_its_budget_and_its_path_ran(model, runner, short, name):
    res = check_toggle(model, name, short, runner=runner, localize_failures=False)
    assert [r.status for r in res] == ["pass"], "; ".join(f"{r.check}: {r.reason}" for r in res)
    # a pass implies the declared op-slot event fired (else the gate says `not exercised`)
    assert res[0].evidence["kl_mean"] > 0, "an FP8 path that moves nothing did not run"


def test_a_uniform_scale_error_in_stage2_is_divided_out_by_k3s_latent_norm(model):
    """Why moe_fp8_stage2's wrong-scale mutant is a shifted row scale, not amax/224: the routed
    output passes the latent RMSNorm, so a common factor is invisible (an equivalent mutant),
    while a per-row one is not."""
    from optimized_stack.kernels.moe.fp8_stage2 import routed_fp8_stage2
    from optimized_stack.model import ops
    moe = next(L.block_sparse_moe for L in model.model.layers if hasattr(L, "block_sparse_moe"))
    assert model.config.routed_expert_hidden_size is not None, "k3-mini has K3's latent MoE"
    x = torch.randn(16, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    out = {}
    with torch.no_grad():
        for fault in (None, "dequant_scale_x2", "row_shifted_scale"):
            with ops.override(moe_experts=lambda *a, f=fault: routed_fp8_stage2(*a, _fault=f)):
                out[fault] = moe.routed_part(x)
    size = out[None].abs().max()
    # measured: 1.6% of max|out| (the norm's eps, 1e-5, against small rows), FP8 itself 3.3%
    doubled, shifted = ((out[f] - out[None]).abs().max() / size for f in ("dequant_scale_x2", "row_shifted_scale"))
    assert doubled < 0.05, f"a common factor must (nearly) cancel in the latent RMSNorm: moved {float(doubled):.3f}"
    assert shifted > 0.2, f"a per-row scale error must not cancel: moved only {float(shifted):.3f}"


@pytest.mark.parametrize("name", ["mut_moe_fp8_row_shifted_scale", "mut_mla_fp8_dequant_scale_x2"])
def test_fp8_wrong_scale_mutant_fails_the_budget(model, runner, short, name):
    res = check_toggle(model, name, short, runner=runner, localize_failures=False)
    assert [r.status for r in res] == ["fail"], "; ".join(f"{r.check} {r.status}: {r.reason}" for r in res)


def test_dcp_fp8_prefill_gathers_in_fp8_and_fires_its_event(model):
    """At W = 1 (no process group) the gather is the rows' FP8 round trip: the prefill logits
    move against dcp_mla alone by e4m3 rounding, decode rows follow, and the event is counted."""
    ids = torch.tensor(list(b"The quick brown fox jumps over the lazy dog. " * 2))
    plain, fp8 = TPModel(model, Comm(0, 1), TPOptions(dcp_mla=True)), \
        TPModel(model, Comm(0, 1), TPOptions(dcp_mla=True, dcp_fp8_allgather=True))
    a_st, b_st = plain.new_state(), fp8.new_state()
    a, b = plain.forward(ids, a_st), fp8.forward(ids, b_st)
    assert fp8.events["dcp_fp8_gather"] == sum(L["kind"] != KDA for L in fp8.layers) > 0, "once per MLA layer"
    assert not plain.events["dcp_fp8_gather"]
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert 0 < float(kl.mean()) < registry.get("dcp_fp8_allgather").contract.mean_kl
    fired = fp8.events["dcp_fp8_gather"]
    fp8.forward(ids[:1], b_st)                                    # a decode step: the LSE merge, no gather
    assert fp8.events["dcp_fp8_gather"] == fired and fp8.events["dcp_merge"] > 0
    with pytest.raises(Exception, match="needs dcp_mla"):
        TPOptions(dcp_fp8_allgather=True)


@pytest.fixture(scope="module")
def runner2(model):
    """W = 2 gloo ranks (spawned once; seconds on 2 cores), reference the same W with no toggle."""
    refs = Runner(model, world_size=2)
    yield refs
    refs.close()


@pytest.mark.parametrize("name,status", [("dcp_fp8_allgather", "pass"), ("mut_dcp_fp8_dequant_scale_x2", "fail")])
def test_dcp_fp8_allgather_at_world_size_2(model, runner2, short, name, status):
    """The real exchange: two ranks' interleaved shards quantized, gathered as bytes, dequantized."""
    res = check_toggle(model, name, short, runner=runner2, localize_failures=False)
    assert [r.status for r in res] == [status], "; ".join(f"{r.check} {r.status}: {r.reason}" for r in res)
    fired = res[0].evidence["events"]                     # counted on rank 0
    assert fired.get("dcp_fp8_gather"), f"{name}: the FP8 gather never ran: {fired}"
    if status == "pass":
        assert res[0].evidence["kl_mean"] > 0, "an FP8 gather that moves nothing did not quantize"
