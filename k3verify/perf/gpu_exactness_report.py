"""summary.json (issue 18 item 6) and the Markdown of a GPU exactness run, from its document."""
from __future__ import annotations

from typing import Any

from k3verify.compare.invariance import INFORMATIONAL_CONTROLS

from .gpu_drift import DRIFT_RULE


def slim(item: dict[str, Any]) -> dict[str, Any]:
    """The fields of a verdict row a report keeps."""
    keep = ("toggle", "kind", "contract", "scenario", "status", "reason", "caught", "op", "shape", "m", "wall_s")
    out = {k: item.get(k) for k in keep if k in item}
    loc = (item.get("evidence") or {}).get("localisation")
    if loc:
        out["localisation"] = loc
    return out


def _localisation(muts: list[dict[str, Any]]) -> dict[str, Any]:
    """The selftest's localisation figure (suites/verdicts.localisation) over the GPU's mutant rows."""
    from k3verify.suites.verdicts import localisation
    return localisation([{"kind": "mutant", "caught": m.get("caught"), "evidence": {
        "localisation": m.get("localisation") or (m.get("evidence") or {}).get("localisation")}} for m in muts])


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """summary.json of issue 18 item 6 (fields this run did not reach are null)."""
    sec, env = doc.get("sections", {}), doc.get("environment") or {}
    exact = {}
    for v in sec.get("exact", []):
        st = v["status"]
        exact[v["toggle"]] = f"not-exact-on-cuda: {v['reason'].removeprefix('not exact on cuda: ')}" \
            if st == "not-exact-on-cuda" else f"inert-on-cuda: {v['reason']}" if st == "inert-on-cuda" else st
    muts = [m for m in sec.get("exact_mutants", []) + sec.get("approx_mutants", []) if m.get("status") != "skip"]
    inv = sec.get("invariance", [])
    price = sec.get("price", [{}])[0] if sec.get("price") else {}       # the kernel-bound prefill
    return {"device": env.get("cuda_device"), "torch": env.get("torch"), "fla": doc.get("fla"),
            "driver": doc.get("driver"), "exact": exact,
            "mutants": {"caught": sum(1 for m in muts if m.get("caught")), "total": len(muts),
                        "not_judged": sum(1 for m in sec.get("exact_mutants", []) + sec.get("approx_mutants", [])
                                          if m.get("status") == "skip"),
                        **_localisation(muts)},
            "invariance": {"pass": sum(1 for i in inv if invariance_status(i) == "pass"),
                           "fail": sum(1 for i in inv if invariance_status(i) == "fail"),
                           "negative_controls_failed": sum(len(i.get("negative_controls_failed", [])) for i in inv),
                           "required_controls": sum(len(_required(i)) for i in inv),
                           "required_controls_failed": sum(sum(1 for c in _required(i) if c.get("caught"))
                                                           for i in inv),
                           "informational_controls": list(INFORMATIONAL_CONTROLS)},
            "price_of_exactness": price.get("price_of_exactness"),
            "price_of_exactness_rows": [{"workload": p["workload"], "ratio": p["price_of_exactness"], "ci95": p["ci95"]}
                                        for p in sec.get("price", [])],
            "drift": _drift_summary(sec.get("drift", []))}


def _required(item: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in item.get("negative_controls", []) if c.get("toggle") not in INFORMATIONAL_CONTROLS]


def invariance_status(item: dict[str, Any]) -> str:
    """An invariance row's verdict by compare/invariance.py's rule: no row differs and every
    required control failed (an informational control may hold; the row shows which did)."""
    if item.get("status") not in ("pass", "fail"):
        return item.get("status", "skip")
    required = _required(item)
    ok = item.get("failed_rows") == 0 and bool(required) and all(c.get("caught") for c in required)
    return "pass" if ok else "fail"


def _drift_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    judged = [d for d in rows if d["status"] in ("pass", "fail")]
    controls = [d for d in rows if d["status"] in ("control-failed", "CONTROL-PASSED")]
    return {"rule": DRIFT_RULE, "pass": sum(d["status"] == "pass" for d in judged),
            "fail": sum(d["status"] == "fail" for d in judged),
            "negative_controls_failed": sum(d["status"] == "control-failed" for d in controls),
            "negative_controls": len(controls),
            "kl_mean_max": max((d["kl_mean"] for d in judged), default=None),
            "kl_max": max((d["kl_max"] for d in judged), default=None),
            "top1_min": min((d["top1"] for d in judged), default=None)}


def render(doc: dict[str, Any]) -> str:
    env, sec = doc.get("environment") or {}, doc.get("sections", {})
    lines = ["# k3verify GPU exactness run", "",
             f"- device: {env.get('cuda_device')}; torch {env.get('torch')}; cuda {env.get('cuda')}; "
             f"driver {doc.get('driver', '?')}; fla {doc.get('fla', '?')}"]

    def table(title: str, cols: tuple[str, ...], rows: list[tuple]) -> None:
        lines.extend(["", f"## {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)])
        lines.extend("| " + " | ".join(str(c) for c in r) + " |" for r in rows)

    if sec.get("invariance"):
        table("Batch invariance of the GPU reference profile (every op x shape x M)",
              ("model", "verdict", "rows", "failed", "required controls that failed (must)",
               "informational controls"),
              [(i["model"], invariance_status(i), i.get("rows"), i.get("failed_rows"),
                ", ".join(c["toggle"] for c in _required(i) if c.get("caught")) + f" ({len(_required(i))} required)",
                ", ".join(f"{c['toggle']}: {'differed' if c.get('caught') else 'equal in this process'}"
                          for c in i.get("negative_controls", []) if c.get("toggle") in INFORMATIONAL_CONTROLS))
               for i in sec["invariance"]])
    if sec.get("drift"):
        table(f"GPU reference (bf16) vs CPU reference (fp32), teacher-forced; rule {DRIFT_RULE} against the "
              "CPU bf16 floor (k3verify/perf/gpu_drift.py)",
              ("scenario", "GPU side", "rows", "KL max", "KL mean", "top-1", "floor KL mean / top-1",
               "max|d|/max|ref|", "verdict"),
              [(d["scenario"], d.get("mode", ""), d["rows"], f"{d['kl_max']:.3g}", f"{d['kl_mean']:.3g}",
                f"{d['top1']:.4f}", _floor_text(d), f"{d['rel_to_max']:.3g}", d["status"]) for d in sec["drift"]])
    if sec.get("fla"):
        table("fla chunk_kda vs fused_recurrent_kda (random inputs, g in (-5, 0))",
              ("fla dots", "H x K", "T", "output rel", "state rel"),
              [(f.get("dots", "fla"), f"{f['heads']}x{f['head_dim']}", f["tokens"], f"{f['out_rel']:.2g}",
                f"{f['state_rel']:.2g}")
               for f in sec["fla"]])
    if sec.get("fla_decode"):
        table("Decode through chunk_kda vs fused_recurrent_kda, one token per call, state carried",
              ("H x K", "steps", "last output rel", "state rel"),
              [(f"{f['heads']}x{f['head_dim']}", f["steps"], f"{f['out_rel']:.2g}", f"{f['state_rel']:.2g}")
               for f in sec["fla_decode"]])
    for key, title in (("exact", "Exact toggles on the GPU reference (bitwise: tokens, logits, KDA state, MLA rows)"),
                       ("approx", "Approx toggles on CUDA (their cuda:bfloat16 budget)"),
                       ("approx_diagnostic", "Approx toggles, diagnostic lane (not verdicts)")):
        if sec.get(key):
            table(title, ("toggle", "verdict", "why"), [(v["toggle"], v["status"], str(v.get("reason"))[:160])
                                                       for v in sec[key]])
    for key in ("exact_mutants", "approx_mutants", "approx_mutants_diagnostic"):
        if sec.get(key):
            table(f"Mutants ({key.split('_')[0]} toggles)", ("mutant", "of", "caught", "how"),
                  [(m["toggle"], m.get("mutant_of"), {True: "yes", False: "NO"}.get(m.get("caught"), "not judged"),
                    str(m.get("reason"))[:140]) for m in sec[key]])
    if sec.get("price"):
        table("Price of exactness (same workload, interleaved; > 1 = the invariant profile is slower)",
              ("model", "workload", "torch tok/s", "invariant tok/s", "price [95% CI]"),
              [(p["model"], p["workload"], f"{p['tokens_per_s_torch']:.0f}", f"{p['tokens_per_s_invariant']:.0f}",
                f"{p['price_of_exactness']:.3f}x [{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}]") for p in sec["price"]])
    lines += ["", "## Log", "", "```", *doc.get("log", []), "```", ""]
    return "\n".join(lines)




def _floor_text(row: dict[str, Any]) -> str:
    f = row.get("floor")
    return f"{f['kl_mean']:.3g} / {f['top1']:.4f}" if f else "-"
