"""perf/step_profile on the CPU: what its cells and the prefill profile measure, the stacks it
knows, and its device-activity count (CUDA-only figures, so here only the counting is checked on
a stand-in profile)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3verify.perf import step_profile as sp
from k3verify.perf.fast_bench_setup import Donor
from optimized_stack import load_model

BATCHED = ("continuous_batching", "projected_kv_cache", "batched_decode")


@pytest.fixture(scope="module")
def mini():
    return load_model("k3-mini", device="cpu", dtype=torch.float32)


def test_unknown_stack_is_one_line_and_exit_2(tmp_path, capsys):
    assert sp.main(["--out", str(tmp_path), "--stacks", "cuda_graphs,nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0]
    assert sp.main(["--out", str(tmp_path), "--prefill-stacks", "+fused,nope"]) == 2


def test_every_fused_stack_adds_to_the_graphs_stack():
    assert set(sp.FUSED) <= set(sp.STACKS["+fused"])
    for name, names in sp.STACKS.items():
        assert names[:len(sp.GRAPHS)] == sp.GRAPHS, name
    # moe_grouped_static replaces the combine the fused kernel would run: only the conv joins it
    assert "fused_moe_combine" not in sp.STACKS["+moe_grouped_static+fused_conv"]


def test_device_activities_count_only_the_device():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(device_type=cuda, device_time=10.0)] * 6 + \
             [SimpleNamespace(device_type=cpu, device_time=99.0)] * 4
    prof = SimpleNamespace(events=lambda: events)
    assert sp.device_activities(prof, 3) == (2.0, 10.0 * 6 / 1e3 / 3)
    # negative control: a CPU-only profile has no device activity at all
    assert sp.device_activities(SimpleNamespace(events=lambda: events[6:]), 1) == (0.0, 0.0)


def test_decode_cell_runs_the_fast_step(mini):
    cell = sp.profile_cell(mini, BATCHED, Donor.prefill(mini, 40), 3, 2, kernels := [])
    assert cell["rows"] == 3 and cell["replay_ms"] is None          # no graphs on the CPU
    assert cell["events"].get("fast_decode_rows", 0) > 0, "the fast step did not run"
    assert "eager step x3" in kernels[0]


def test_prefill_cell_prefills_the_whole_prompt_in_one_step(mini):
    cell = sp.profile_prefill(mini, BATCHED, 96, kernels := [])
    assert cell["prefill_tokens"] == 96 and cell["tok_s"] > 0
    assert kernels[0].startswith("==== prefill 96 tokens")


def test_the_sorted_stack_is_the_fused_stack_plus_the_sorted_prefill_experts():
    assert sp.STACKS["+sorted"] == sp.STACKS["+fused"] + ("prefill_sorted_experts",)
    # fused_situ's engine carries the sorted experts: its row is timed against +sorted, nothing else added
    assert sp.STACKS["+situ"] == sp.STACKS["+sorted"] + ("fused_situ",)


def test_launch_sites_sum_device_time_by_the_model_line():
    cpu = torch.autograd.DeviceType.CPU
    line = "/x/optimized_stack/model/moe.py(53): route"
    events = [SimpleNamespace(device_type=cpu, self_device_time_total=2000.0, name="aten::_to_copy",
                              stack=[line, "/x/optimized_stack/engine/fast/decode_step.py(130): forward"])] * 3 + [
        SimpleNamespace(device_type=cpu, self_device_time_total=500.0, name="aten::mul",
                        stack=["/x/optimized_stack/model/kda.py(180): gate"]),
        # controls: no device time counts nowhere; launched from outside the model, or with no
        # stack (a Triton launch outside any aten op), goes to the last row
        SimpleNamespace(device_type=cpu, self_device_time_total=0.0, name="aten::add", stack=[line]),
        SimpleNamespace(device_type=cpu, self_device_time_total=900.0, name="aten::add", stack=["/x/k3verify/a.py(1): f"])]
    # the device's own events: the kernels above (6.5 + 0.9 ms) and a Triton launch no CPU op owns (0.1 ms)
    cuda = torch.autograd.DeviceType.CUDA
    events += [SimpleNamespace(device_type=cuda, device_time=us, name="k", stack=[]) for us in (6500.0, 900.0, 100.0)]
    rows = sp.launch_sites(SimpleNamespace(events=lambda: events)).splitlines()
    assert len(rows) == 3
    assert rows[0].split() == ["6.000", "ms", "3", "model/moe.py(53)", "aten::_to_copy"]
    assert rows[1].split()[:4] == ["0.500", "ms", "1", "model/kda.py(180)"]
    # 7.5 ms on the device, 6.5 owned by model lines: the k3verify op's 0.9 and the orphan launch's 0.1
    assert rows[2].split()[:2] == ["1.000", "ms"] and "no optimized_stack op" in rows[2] and "7.500 ms in all" in rows[2]


def test_launch_sites_refuses_a_profile_without_stacks():
    """The first --sites call on the H100 printed an empty table: the profile had no stacks."""
    cpu = torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(device_type=cpu, self_device_time_total=2000.0, name="aten::mm", stack=[])]
    with pytest.raises(RuntimeError, match="recorded no stacks"):
        sp.launch_sites(SimpleNamespace(events=lambda: events))


def test_launch_sites_on_a_real_profile_names_the_model_lines(mini):
    """A real profile taken as profile_cell takes it (with_stack, stacks_config), timed by CPU time
    here (no device): the model's own lines own the time."""
    from torch.profiler import ProfilerActivity, profile
    ids = torch.arange(1, 40)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, experimental_config=sp.stacks_config()) as prof:
        mini.forward(ids, mini.new_state())
    rows = sp.launch_sites(prof, time_of=lambda e: e.self_cpu_time_total).splitlines()
    assert len(rows) > 5 and any("model/" in r for r in rows[:10]), rows[:10]
    assert "no optimized_stack op" in rows[-1]


def test_decode_cell_with_sites_writes_a_section(mini):
    sp.profile_cell(mini, BATCHED, Donor.prefill(mini, 40), 2, 2, [], sites := [])
    assert len(sites) == 1 and "device ms by the model line" in sites[0]
