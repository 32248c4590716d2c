"""CUDA toggles (kernels/kda, kernels/moe toggle_defs.py): registered CUDA-only and skipped on a CPU with
the reason; the grouped-expert and side-stream forms checked where they can run (their
arithmetic on the CPU, their kernels on a GPU). The model-level verdicts on the GPU are the
GPU suite's (k3verify/perf/gpu_suite.py, scripts/gpu_suite.sh); GPU tests here skip on a CPU."""
from __future__ import annotations

import json

import pytest
import torch

from k3verify.scenarios import workloads
from k3verify.verdict.gate import check_toggle
from optimized_stack import load_model
from optimized_stack import toggles as registry
from optimized_stack.kernels.kda import fla
from optimized_stack.kernels.moe.grouped import routed_grouped
from optimized_stack.kernels.moe.side_stream import moe_forward_side_stream
from optimized_stack.model.moe import MoE
from optimized_stack.presets import preset_config

CUDA_TOGGLES = ("kda_fla_chunk", "kda_fla_chunk_prefill", "kda_fla_recurrent", "moe_grouped",
                "shared_expert_side_stream")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")


def _fla_available() -> bool:
    try:
        import fla.ops.kda  # noqa: F401
        return torch.cuda.is_available()
    except Exception:
        return False


needs_fla = pytest.mark.skipif(not _fla_available(), reason="needs fla-core's Triton kernels on a CUDA GPU")


@pytest.fixture(scope="module")
def moe_layer():
    torch.manual_seed(0)
    cfg = preset_config("k3-mini")
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


@pytest.mark.parametrize("name", CUDA_TOGGLES)
def test_cuda_toggle_is_cuda_only_and_has_a_mutant(name):
    t = registry.get(name)
    assert t.devices == ("cuda",)
    mutants = [m for m in registry.all_toggles("mutant") if m.mutant_of == name]
    assert mutants, f"{name} has no mutant"
    assert all(m.devices == ("cuda",) for m in mutants)


def test_cuda_toggle_skips_on_cpu_with_reason():
    model = load_model()
    sc = workloads.build("single", scale=0.25)
    res = check_toggle(model, "moe_grouped", sc)
    assert {r.status for r in res} == {"skip"}
    assert "runs on cuda, not cpu" in res[0].reason
    # negative control: a toggle that runs on the CPU is judged on the same scenario
    res_cpu = check_toggle(model, "mla_sdpa", sc, localize_failures=False)
    assert {r.status for r in res_cpu} == {"pass"}


def _routing(layer, t_len=37):
    x = torch.randn(t_len, layer.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    idx, w = layer.gate(x)
    h = torch.nn.functional.linear(x, layer.routed_expert_down_proj.weight)
    return x, h, idx, w


def test_routed_grouped_matches_per_expert_loop_on_cpu(moe_layer):
    _, h, idx, w = _routing(moe_layer)
    ref = MoE.routed(moe_layer, h, idx, w)
    got = routed_grouped(moe_layer, h, idx, w)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # negative control: the slot-0-weight mutant is far outside that tolerance
    bad = routed_grouped(moe_layer, h, idx, w, _slot0_weight=True)
    assert (bad - ref).abs().max() > 1e-3 * ref.abs().max()


def test_moe_forward_is_routed_part_plus_shared(moe_layer):
    x, *_ = _routing(moe_layer)
    assert torch.equal(moe_layer(x), moe_layer.routed_part(x) + moe_layer.shared_experts(x))
    # on a CPU tensor the side-stream form is the reference itself
    assert torch.equal(moe_forward_side_stream(moe_layer, x), moe_layer(x))


@pytest.mark.gpu
@needs_cuda
def test_side_stream_is_bitwise_on_gpu_and_row0_mutant_is_not(moe_layer):
    layer = moe_layer.cuda()
    x = torch.randn(64, layer.cfg.hidden_size, generator=torch.Generator().manual_seed(2)).cuda()
    ref = layer(x)
    assert torch.equal(moe_forward_side_stream(layer, x), ref)
    assert not torch.equal(moe_forward_side_stream(layer, x, _row0=True), ref)
    moe_layer.cpu()


@pytest.mark.gpu
@needs_cuda
def test_routed_grouped_close_on_gpu(moe_layer):
    layer = moe_layer.cuda()
    _, h, idx, w = (t.cuda() for t in _routing(layer.cpu()))
    layer.cuda()
    ref = MoE.routed(layer, h, idx, w)
    torch.testing.assert_close(routed_grouped(layer, h, idx, w), ref, rtol=1e-4, atol=1e-5)
    moe_layer.cpu()


def _kda_inputs(t_len, heads=4, dim=16, seed=0, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(t_len, heads, dim, generator=gen), dim=-1) * dim ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t_len, heads, dim, generator=gen), dim=-1)
    v = torch.randn(t_len, heads, dim, generator=gen)
    g = -torch.rand(t_len, heads, dim, generator=gen)
    beta = torch.rand(t_len, heads, generator=gen)
    s0 = torch.randn(heads, dim, dim, generator=gen) * 0.1
    return [x.to(device) for x in (q, k, v, g, beta, s0)]


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("op", ["fla_chunk", "fla_recurrent"])
def test_fla_ops_match_the_reference_recurrence(op):
    from optimized_stack.model.kda import kda_recurrent
    q, k, v, g, beta, s0 = _kda_inputs(150)
    ref_o, ref_s = kda_recurrent(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), s0.cpu())
    fn = getattr(fla, op)
    o, s = fn(q, k, v, g, beta, s0)
    scale = ref_o.abs().max()
    assert (o.cpu() - ref_o).abs().max() < 5e-3 * scale           # TF32 inside fla's kernels
    assert (s.cpu() - ref_s).abs().max() < 5e-3 * ref_s.abs().max()
    # negative control: the op's mutant misses by far more
    bad = {"fla_chunk": {"_drop_state": True}, "fla_recurrent": {"_transpose_state": True}}[op]
    o_bad, _ = fn(q, k, v, g, beta, s0, **bad)
    assert (o_bad.cpu() - ref_o).abs().max() > 5e-2 * scale


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("argv", [["diff", "--toggle", "moe_grouped"], ["bench", "--toggle", "mla_sdpa"],
                                  ["selftest"]], ids=["diff", "bench", "selftest"])
def test_device_cuda_is_refused_in_one_line_without_a_gpu(argv, capsys):
    from k3verify.cli import main
    assert main(argv + ["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch.cuda.is_available() is False" in err[0]


def test_cuda_toggle_diff_on_cpu_says_why_it_skipped(tmp_path, capsys):
    """Negative control of the refusal above: the same diff on the CPU runs and reports the skip."""
    from k3verify.cli import main
    rc = main(["diff", "--toggle", "moe_grouped", "--report-dir", str(tmp_path), "--json"])
    out = capsys.readouterr().out
    # every row a skip: nothing verified, which is not a pass (issue 29: exit 1, not a green 0)
    assert rc == 1 and "runs on cuda, not cpu" in out and json.loads(out)["verdict"] == "nothing_verified"
