"""perf/gpu_probes on the CPU: the scaled_mm probe runs every cell (torch's CPU _scaled_mm takes any
shape) and reports each as ok with its error against the dequantized product; kda_fp32 says it
needs CUDA; an unknown probe is one line and exit 2."""
from __future__ import annotations

import json

from k3verify.perf import gpu_probes


def test_scaled_mm_probe_answers_every_cell_on_the_cpu(tmp_path):
    assert gpu_probes.main(["--out", str(tmp_path), "--only", "scaled_mm,kda_fp32"]) == 0
    doc = json.loads((tmp_path / "gpu_probes.json").read_text())
    cells = doc["scaled_mm"]
    assert len(cells) == 7 * 2 * 2 + 3 and {c["status"] for c in cells} == {"ok"}
    assert [c.get("scale_a_offset_floats") for c in cells[-3:]] == [0, 1, 4]
    # fp32 output is the dequantized product in fp32 (a real comparison: bf16 output is not)
    assert all(c["max_rel"] < 1e-6 for c in cells if c["out"] == "float32")
    assert any(c.get("max_rel", 0) > 1e-4 for c in cells if c["out"] == "bfloat16")
    assert doc["kda_fp32"] == {"skipped": "needs CUDA and fla"}


def test_unknown_probe_is_one_line_and_exit_2(tmp_path, capsys):
    assert gpu_probes.main(["--out", str(tmp_path), "--only", "nope"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_router_tiles_probe_says_it_needs_cuda(tmp_path):
    assert gpu_probes.main(["--out", str(tmp_path), "--only", "router_tiles"]) == 0
    assert json.loads((tmp_path / "gpu_probes.json").read_text())["router_tiles"] == {"skipped": "needs CUDA"}


def test_paged_tiles_probe_says_it_needs_cuda(tmp_path):
    assert gpu_probes.main(["--out", str(tmp_path), "--only", "paged_tiles"]) == 0
    assert json.loads((tmp_path / "gpu_probes.json").read_text())["paged_tiles"] == {"skipped": "needs CUDA"}
