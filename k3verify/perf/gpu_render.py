"""The GPU run's document as Markdown (perf/gpu_suite.py writes it beside the JSON after every item).

One table per section that has items: SECTIONS gives its title, its columns and the cells of
one item, in the order the run writes them.
"""
from __future__ import annotations

from typing import Any, Callable

from k3verify.perf.gpu_bench import fmt_ratio


def _why(v: dict[str, Any]) -> str:
    return str(v.get("reason", ""))[:140]


def _verdict_cells(v: dict[str, Any]) -> list[Any]:
    return [v.get("toggle"), v.get("kind", ""), v.get("contract", ""), v.get("scenario", ""), v.get("status"), _why(v)]


def _invariance_cells(v: dict[str, Any]) -> list[Any]:
    if "gemm" in v:
        return [f"{v['gemm']}: rows of an M-row call == rows of the 256-row call", v["rows_equal_to_256_row_call"],
                v["status"]]
    return [f"{v.get('toggle')} judged with tiled GEMMs", _why(v), v.get("status")]


def _split_cells(v: dict[str, Any]) -> list[Any]:
    split = f"{v['split']}{' (mutant: drops state)' if v['mutant_drops_state'] else ''}"
    return [f"{v['heads']}x{v['head_dim']}", split, v["output_bitwise"], v["state_bitwise"],
            "bitwise" if v["expected_bitwise"] else "-", v["status"]]


def _bench_cells(r: dict[str, Any]) -> list[Any]:
    if "tokens_per_s_candidate" not in r:
        return [r["workload"], "-", "-", "-", "-", "-", f"{r.get('status')}: {r.get('reason')}"]
    roof = (f"{r['roofline_fraction_reference']:.2%} / {r['roofline_fraction_candidate']:.2%}"
            if "roofline_fraction_candidate" in r else "-")
    ref_tps = f"{r['tokens_per_s_reference']:.0f}" if r.get("tokens_per_s_reference") else "-"
    return [r["workload"], "+".join(r["toggles"]), ref_tps, f"{r['tokens_per_s_candidate']:.0f}", fmt_ratio(r), roof,
            "yes" if r["counted"] else "no: " + r["why"]]


def _tp_cells(v: dict[str, Any]) -> list[Any]:
    sp = v.get("speed")
    sp_text = f"{sp['ratio']:.2f}x [{sp['ci95'][0]:.2f}, {sp['ci95'][1]:.2f}]" if sp else "-"
    return [v.get("toggle"), v.get("contract", ""), v.get("scenario", ""), v.get("status"), sp_text]


# section -> (title, columns, cells of one item); "{world_size}" is filled from the document
SECTIONS: dict[str, tuple[str, tuple[str, ...], Callable[[dict[str, Any]], list[Any]]]] = {
    "verdicts": ("Verdicts (embedded k3-mini on the GPU; reference = the reference path on the GPU)",
                 ("toggle", "kind", "contract", "scenario", "verdict", "why"), _verdict_cells),
    "invariance": ("Batch invariance on the GPU", ("what", "result", "verdict"), _invariance_cells),
    "split": ("fla chunk_kda split invariance (kernel level, state carried)",
              ("H x K", "split", "output bitwise", "state bitwise", "expected", "verdict"), _split_cells),
    "bench": ("Speed (k3-small, fp32, interleaved A/B, warm-up excluded)",
              ("workload", "toggles", "ref tok/s", "cand tok/s", "speedup [95% CI]", "roofline ref / cand", "counted"),
              _bench_cells),
    "tp": ("Tensor parallel, W={world_size} over NCCL (reference: the same W without the toggle)",
           ("toggle", "contract", "scenario", "verdict", "speed ratio [95% CI]"), _tp_cells),
}


def render(doc: dict[str, Any]) -> str:
    env = doc.get("environment", {})
    lines = ["# k3verify GPU run", "",
             f"- device: {env.get('cuda_device')} x{env.get('cuda_device_count', 1)}; torch {env.get('torch')}; "
             f"cuda {env.get('cuda')}; driver {doc.get('driver', '?')}; fla {doc.get('fla', '?')}"]
    if "hbm_copy_bytes_per_s" in doc:
        lines.append(f"- HBM copy (read+write): {doc['hbm_copy_bytes_per_s'] / 1e12:.2f} TB/s")
    sections = doc.get("sections", {})
    for name, (title, columns, cells) in SECTIONS.items():
        if not sections.get(name):
            continue
        lines += ["", f"## {title.format(world_size=doc.get('world_size', 2))}", "",
                  "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(c) for c in cells(item)) + " |" for item in sections[name]]
    lines += ["", "## Log", "", "```", *doc.get("log", []), "```", ""]
    return "\n".join(lines)
