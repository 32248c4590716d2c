"""The GPU run's document as Markdown (perf/gpu_suite.py writes it beside the JSON after every item)."""
from __future__ import annotations

from typing import Any

from k3verify.perf.gpu_bench import fmt_ratio


def _heading(title: str, columns: tuple[str, ...]) -> list[str]:
    """A Markdown section title and table header."""
    return ["", f"## {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def render(doc: dict[str, Any]) -> str:
    env = doc.get("environment", {})
    lines = ["# k3verify GPU run", "",
             f"- device: {env.get('cuda_device')} x{env.get('cuda_device_count', 1)}; torch {env.get('torch')}; "
             f"cuda {env.get('cuda')}; driver {doc.get('driver', '?')}; fla {doc.get('fla', '?')}"]
    if "hbm_copy_bytes_per_s" in doc:
        lines.append(f"- HBM copy (read+write): {doc['hbm_copy_bytes_per_s'] / 1e12:.2f} TB/s")
    sec = doc.get("sections", {})
    if sec.get("verdicts"):
        lines += _heading("Verdicts (embedded k3-mini on the GPU; reference = the reference path on the GPU)",
                          ("toggle", "kind", "contract", "scenario", "verdict", "why"))
        for v in sec["verdicts"]:
            lines.append(f"| {v.get('toggle')} | {v.get('kind', '')} | {v.get('contract', '')} | "
                         f"{v.get('scenario', '')} | {v.get('status')} | {str(v.get('reason', ''))[:140]} |")
    if sec.get("invariance"):
        lines += _heading("Batch invariance on the GPU", ("what", "result", "verdict"))
        for v in sec["invariance"]:
            if "gemm" in v:
                lines.append(f"| {v['gemm']}: rows of an M-row call == rows of the 256-row call | "
                             f"{v['rows_equal_to_256_row_call']} | {v['status']} |")
            else:
                lines.append(f"| {v.get('toggle')} judged with tiled GEMMs | {str(v.get('reason', ''))[:140]} | {v.get('status')} |")
    if sec.get("split"):
        lines += _heading("fla chunk_kda split invariance (kernel level, state carried)",
                          ("H x K", "split", "output bitwise", "state bitwise", "expected", "verdict"))
        for v in sec["split"]:
            lines.append(f"| {v['heads']}x{v['head_dim']} | {v['split']}{' (mutant: drops state)' if v['mutant_drops_state'] else ''} | "
                         f"{v['output_bitwise']} | {v['state_bitwise']} | {'bitwise' if v['expected_bitwise'] else '-'} | {v['status']} |")
    if sec.get("bench"):
        lines += _heading("Speed (k3-small, fp32, interleaved A/B, warm-up excluded)",
                          ("workload", "toggles", "ref tok/s", "cand tok/s", "speedup [95% CI]",
                           "roofline ref / cand", "counted"))
        for r in sec["bench"]:
            if "tokens_per_s_candidate" not in r:
                lines.append(f"| {r['workload']} | - | - | - | - | - | {r.get('status')}: {r.get('reason')} |")
                continue
            roof = (f"{r['roofline_fraction_reference']:.2%} / {r['roofline_fraction_candidate']:.2%}"
                    if "roofline_fraction_candidate" in r else "-")
            ref_tps = f"{r['tokens_per_s_reference']:.0f}" if r.get("tokens_per_s_reference") else "-"
            lines.append(f"| {r['workload']} | {'+'.join(r['toggles'])} | {ref_tps} | {r['tokens_per_s_candidate']:.0f} | "
                         f"{fmt_ratio(r)} | {roof} | {'yes' if r['counted'] else 'no: ' + r['why']} |")
    if sec.get("tp"):
        lines += _heading(f"Tensor parallel, W={doc.get('world_size', 2)} over NCCL (reference: the same W "
                          "without the toggle)", ("toggle", "contract", "scenario", "verdict", "speed ratio [95% CI]"))
        for v in sec["tp"]:
            sp = v.get("speed")
            sp_text = f"{sp['ratio']:.2f}x [{sp['ci95'][0]:.2f}, {sp['ci95'][1]:.2f}]" if sp else "-"
            lines.append(f"| {v.get('toggle')} | {v.get('contract', '')} | {v.get('scenario', '')} | "
                         f"{v.get('status')} | {sp_text} |")
    lines += ["", "## Log", "", "```", *doc.get("log", []), "```", ""]
    return "\n".join(lines)
