"""The GPU exactness run's sections, driven on the CPU (the judging is device-independent; only
main() insists on CUDA): an exact toggle with its mutant, an approx toggle with its mutants, and
the report they make — so a change to the run's wiring fails here, not on a device call."""
from __future__ import annotations

import json

from k3verify.perf import gpu_exactness as gx
from k3verify.run.runner import Runner
from model_fixtures import model  # noqa: F401  (the module-scoped k3-mini fixture)


def test_sections_judge_and_report_on_the_cpu(model, tmp_path):  # noqa: F811
    run = gx.Run(tmp_path, budget_s=600.0)
    refs = Runner(model)
    gx.section_exact(run, model, refs, only={"state_offload_roundtrip"})
    gx.section_mutants(run, model, refs, only={"state_offload_roundtrip"})
    gx.section_approx(run, model, refs, only={"kda_chunked"})
    sec = run.doc["sections"]
    assert [(v["toggle"], v["status"]) for v in sec["exact"]] == [("state_offload_roundtrip", "pass")]
    assert sec["exact_mutants"] and all(m["caught"] for m in sec["exact_mutants"]), sec["exact_mutants"]
    assert sec["approx"][0]["status"] == "pass" and sec["approx"][0]["budget"].startswith("approx(max_kl=1e-06")
    assert sec["approx_mutants"] and all(m["caught"] for m in sec["approx_mutants"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exact"] == {"state_offload_roundtrip": "pass"}
    assert summary["mutants"]["caught"] == summary["mutants"]["total"] > 0
    assert "state_offload_roundtrip" in (tmp_path / "gpu_exactness.md").read_text()
