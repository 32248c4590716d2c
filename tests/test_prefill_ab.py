"""perf/prefill_ab.py: named prefill sets against the reference (and transformers) in one process."""
from __future__ import annotations

import json

import pytest

from k3verify.perf import prefill_ab
from optimized_stack.errors import K3Error


def test_the_phase_set_takes_the_attention_form_the_device_ab_chose():
    phase = prefill_ab.resolve_set("phase")
    assert "mla_flash_bf16" in phase and "mla_sdpa" not in phase
    swapped = prefill_ab.resolve_set("phase/mla_sdpa")
    assert "mla_sdpa" in swapped and "mla_flash_bf16" not in swapped
    assert set(phase) - {"mla_flash_bf16"} == set(swapped) - {"mla_sdpa"}, "only the attention slot changes"
    assert prefill_ab.resolve_set("kda_chunked+moe_grouped") == ("kda_chunked", "moe_grouped")


@pytest.mark.parametrize("bad", ["nope", "kda_chunked+nope", "+"])
def test_a_set_naming_no_registered_toggle_is_refused(bad):
    with pytest.raises(K3Error):
        prefill_ab.resolve_set(bad)


def test_a_cpu_run_times_each_set_against_the_reference_and_writes_its_rows(tmp_path, capsys):
    assert prefill_ab.main(["--out", str(tmp_path), "--model", "k3-mini", "--device", "cpu", "--dtype", "float32",
                            "--tokens", "16,32", "--repeats", "2", "--sets", "kda_chunked"]) == 0
    doc = json.loads((tmp_path / "prefill_ab.json").read_text())
    assert [(r["tokens"], r["set"]) for r in doc["rows"]] == [(16, "kda_chunked"), (32, "kda_chunked")]
    assert all(r["ratio"] > 0 and r["tokens_per_s_reference"] > 0 and r["repeats"] == 2 for r in doc["rows"])
    assert "| 32 | kda_chunked | reference path |" in capsys.readouterr().out


def test_the_peer_arm_times_transformers_against_the_last_set(tmp_path):
    pytest.importorskip("transformers")
    assert prefill_ab.main(["--out", str(tmp_path), "--model", "k3-mini", "--device", "cpu", "--dtype", "float32",
                            "--tokens", "16", "--repeats", "2", "--sets", "moe_grouped;kda_chunked", "--peer"]) == 0
    rows = json.loads((tmp_path / "prefill_ab.json").read_text())["rows"]
    peer = [r for r in rows if r.get("reference") == "transformers"]
    assert len(peer) == 1 and peer[0]["set"] == "kda_chunked vs transformers" and peer[0]["ratio"] > 0
    assert peer[0]["peer"]["transformers"]


@pytest.mark.parametrize("args", [["--sets", "nope"], ["--repeats", "0"]])
def test_bad_input_is_exit_2_and_writes_nothing(tmp_path, args, capsys):
    assert prefill_ab.main(["--out", str(tmp_path / "o"), "--device", "cpu", *args]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "o").exists()


def test_a_bad_token_count_is_argparse_exit_2(tmp_path):
    with pytest.raises(SystemExit) as exc:
        prefill_ab.main(["--out", str(tmp_path / "o"), "--device", "cpu", "--tokens", "0"])
    assert exc.value.code == 2 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("name,want", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "gemm"),
    ("_attn_fwd_blocked", "attention"),
    ("chunk_kda_fwd_kernel_o", "kda"),
    ("_moe_route_topk", "moe"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("some_kernel_nobody_named", "other"),
])
def test_kernel_families_by_name(name, want):
    assert prefill_ab.family(name) == want


def test_the_profile_covers_every_set_and_the_reference_and_keeps_the_ab(tmp_path):
    assert prefill_ab.main(["--out", str(tmp_path), "--model", "k3-mini", "--device", "cpu", "--dtype", "float32",
                            "--tokens", "16", "--repeats", "2", "--sets", "kda_chunked", "--profile", "16"]) == 0
    doc = json.loads((tmp_path / "prefill_ab.json").read_text())
    assert doc["rows"] and set(doc["profile"]["forwards"]) == {"reference", "kda_chunked"}
    assert all({"device_ms", "launches", "families_ms", "top"} <= set(p) for p in doc["profile"]["forwards"].values())
    text = (tmp_path / "prefill_kernels.txt").read_text()
    assert "==== prefill 16 tokens: reference ====" in text and "==== prefill 16 tokens: kda_chunked ====" in text
    assert "aten::" in text, "the profiler's table of what ran"


def test_a_phase_set_takes_added_toggles():
    more = prefill_ab.resolve_set("phase+gemm_per_shape")
    assert more[:-1] == prefill_ab.resolve_set("phase") and more[-1] == "gemm_per_shape"
    assert prefill_ab.resolve_set("phase/mla_sdpa+gemm_per_shape")[-2:] == ("mla_sdpa", "gemm_per_shape")
    with pytest.raises(K3Error):
        prefill_ab.resolve_set("phase+nope")
