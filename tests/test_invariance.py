"""The invariance check (k3verify/invariance.py): its plan is read off the model (every linear,
norm, AttnRes read, attention and KDA shape), it passes on the GPU profile's kernels (here
through Triton's interpreter on k3-mini), its negative controls fail as they must, a
non-invariant form is reported with op, shape and M, and its rows fit the report schema."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from k3verify.compare import invariance
from k3verify.report.schema import validate_result
from optimized_stack import load_model
from optimized_stack.kernels import gpu_reference
from optimized_stack.model.model import K3Model
from optimized_stack.presets import preset_config

from triton_env import DEVICE, REASON, needs_triton

MS = (1, 3, 17, 64, 130)      # both sides of the 64-token grid; n = 130 spans three key blocks


@pytest.fixture(scope="module")
def mini():
    return load_model("k3-mini")


def _by_op(cases):
    out: dict[str, set] = {}
    for c in cases:
        out.setdefault(c.op, set()).add(c.shape)
    return out


def test_plan_covers_every_linear_and_width_of_k3_mini(mini):
    cases = invariance.plan(mini)
    ops = _by_op(cases)
    linear_shapes = {tuple(m.weight.shape) for m in mini.modules() if isinstance(m, nn.Linear)}
    assert linear_shapes <= ops["linear"], f"linears missing from the plan: {linear_shapes - ops['linear']}"
    cfg = mini.config
    router = [c for c in cases if c.op == "linear" and c.shape == (cfg.num_experts, cfg.hidden_size)]
    assert [c.dtype for c in router] == [torch.float32], "the router runs in fp32 and must be checked there"
    assert ops["rms_norm"] == {(cfg.hidden_size,), (cfg.q_lora_rank,), (cfg.kv_lora_rank,),
                               (cfg.routed_expert_hidden_size,), (cfg.kda_head_dim,)}
    assert ops["attn_res_mix"] == {(2, 128), (3, 128)}       # 8 layers, blocks of 4
    assert ops["attention"] == {(cfg.num_heads, cfg.qk_head_dim, cfg.v_head_dim)}
    assert ops["kda_scan"] == {(cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim)}
    assert ops["l2_norm"] == {(cfg.kda_head_dim,)} and ops["row_sum"] == {(cfg.num_experts_per_token,)}
    assert ops["topk"] == {(cfg.num_experts, cfg.num_experts_per_token)}
    k3_ops = set(invariance.OPS) - {"softplus"}            # softplus: Kimi Linear's gate only
    assert set(ops) == k3_ops, f"ops never planned: {k3_ops - set(ops)}"
    lm = next(c for c in cases if c.shape == tuple(mini.lm_head.weight.shape))
    assert "lm_head" in lm.used_by


def test_plan_of_k3_small_follows_its_config():
    """Shapes come from the model, not a list: k3-small's (built on the meta device, no weights)."""
    cfg = preset_config("k3-small")
    with torch.device("meta"):
        model = K3Model(cfg).to(torch.bfloat16)
    ops = _by_op(invariance.plan(model))
    assert (32768, 768) in ops["linear"] and (8 * 192, 192) in ops["linear"]
    assert ops["attention"] == {(8, 192, 128)} and ops["kda_scan"] == {(8, 128, 128)}
    assert ops["attn_res_mix"] == {(2, 768), (3, 768), (4, 768), (5, 768)}     # 13 layers, blocks of 4
    dtypes = {c.dtype for c in invariance.plan(model) if c.op == "linear"}
    assert dtypes == {torch.bfloat16, torch.float32}, "bf16 projections and the fp32 router"


def test_plan_of_a_kimi_linear_shape():
    """No AttnRes (plain residual stream), the softplus gate, SiLU GLUs, no q-LoRA."""
    cfg = preset_config("k3-mini").replace(variant="kimi_linear", attn_res_block_size=None, q_lora_rank=None,
                                           activation="silu", kda_full_rank_gate=False,
                                           routed_expert_hidden_size=None, mla_output_gate=False)
    with torch.device("meta"):
        model = K3Model(cfg)
    ops = _by_op(invariance.plan(model))
    assert "attn_res_mix" not in ops and "situ" not in ops
    assert ops["softplus"] == {(cfg.kda_num_heads * cfg.kda_head_dim,)}
    assert (cfg.num_heads * cfg.qk_head_dim, cfg.hidden_size) in ops["linear"]    # q_proj


def test_unknown_op_is_refused(mini):
    with pytest.raises(ValueError, match=r"unknown op 'lineaar'; known ops: linear, "):
        invariance.run(mini, (1,), ops_filter=["lineaar"])


@pytest.mark.parametrize("text,expect", [("1-3,8", (1, 2, 3, 8)), ("4096", (4096,))])
def test_parse_ms(text, expect):
    assert invariance._parse_ms(text) == expect


def test_bit_equal_sees_signed_zero():
    assert not invariance.bit_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert invariance.bit_equal(torch.tensor([1, 2]), torch.tensor([1, 2]))


# ---- through the interpreter (CI) or on a GPU: the whole check on k3-mini -------------------------------
@pytest.fixture(scope="module")
def mini_dev():
    """k3-mini where the kernels run: a GPU, else the CPU under the interpreter."""
    if REASON:
        pytest.skip(REASON)
    return load_model("k3-mini", device=DEVICE)


@pytest.fixture(scope="module")
def mini_run(mini_dev):
    return invariance.run(mini_dev, MS)


@needs_triton
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_check_passes_and_its_controls_fail(mini_run, mini):
    res = mini_run
    assert res.failures == [], res.failures[0]["reason"]
    assert len(res.results) == len(invariance.plan(mini)) * len(MS)
    controls = {"control_triton_gemm_split_k_by_rows", "control_kda_unaligned_cut"}
    if DEVICE == "cuda":
        controls |= {"control_cublas_fp32_linear", "control_fla_chunk_varlen"}
    assert set(res.negative_controls_failed) == controls, [c["reason"] for c in res.controls]
    assert res.passed and res.summary()["invariance"] == "pass"
    forms = {r["op"]: r["form"] for r in res.results}
    assert forms["linear"] == "triton"                       # fp32: the Triton GEMM in every profile
    assert forms["kda_scan"].startswith("fla" if DEVICE == "cuda" else "cpu stand-ins")


@needs_triton
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_rows_fit_the_report_schema(mini_run):
    for i, row in enumerate(mini_run.results + mini_run.controls):
        validate_result(row, f"row[{i}]")
    json.dumps(mini_run.to_dict())                  # serialisable as is


@needs_triton
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_a_non_invariant_form_fails_with_op_shape_and_m(mini_dev, monkeypatch):
    """Swap the profile's RMSNorm for one whose chunk width follows the row count: the check
    must fail, and say which op, shape and M."""
    from optimized_stack.kernels.norm.rows import rms_norm_rows

    def drifting(x, w, eps):
        d = x.shape[-1]
        x2 = x.reshape(-1, d)
        return rms_norm_rows(x2, w, eps, _block_d=16 if x2.shape[0] < 8 else None).reshape(x.shape)
    monkeypatch.setattr(gpu_reference, "rms_norm", drifting)
    res = invariance.run(mini_dev, (1, 3, 17), ops_filter=["rms_norm"], controls=False)
    assert not res.passed
    bad = res.failures[0]
    assert bad["op"] == "rms_norm" and bad["m"] in (1, 3) and bad["first_divergence"]["row"] is not None
    assert f"rms_norm [{bad['shape'][0]}]" in bad["reason"] and f"M={bad['m']}" in bad["reason"]
    assert {r["m"] for r in res.failures} <= {1, 3}, "M = 17 uses the fixed chunk and must still pass"


@needs_triton
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_cli_writes_results_and_exits_by_verdict(tmp_path, capsys):
    rc = invariance.main(["--device", DEVICE, "--dtype", "float32", "--ops", "l2_norm,row_sum",
                          "--ms", "1-3", "--out", str(tmp_path), "--tag", "t"])
    assert rc == 0, capsys.readouterr().out
    doc = json.loads((tmp_path / "invariance_t.json").read_text())
    assert doc["summary"]["invariance"] == "pass" and doc["summary"]["rows"] == 6
    assert "negative control" in (tmp_path / "invariance_t.md").read_text()
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["negative_controls_failed"]


def test_an_informational_control_may_hold_a_required_one_may_not():
    """fla's varlen control differs in some processes and not in others (its tile choice): it is
    shown, never required; a required control that holds still voids the run."""
    from k3verify.compare.invariance import INFORMATIONAL_CONTROLS, InvarianceRun
    from k3verify.perf.gpu_exactness_report import invariance_status
    row = {"status": "pass"}
    varlen = {"toggle": INFORMATIONAL_CONTROLS[0], "caught": False, "informational": True}
    cublas = {"toggle": "control_cublas_fp32_linear", "caught": True}
    assert InvarianceRun([row], [cublas, varlen]).passed
    assert not InvarianceRun([row], [{**cublas, "caught": False}, {**varlen, "caught": True}]).passed
    assert not InvarianceRun([row], [varlen]).passed                       # no required control at all
    stored = {"status": "fail", "failed_rows": 0, "negative_controls": [cublas, varlen]}
    assert invariance_status(stored) == "pass"
    assert invariance_status({**stored, "negative_controls": [{**cublas, "caught": False}, varlen]}) == "fail"
    assert invariance_status({**stored, "failed_rows": 3}) == "fail"
