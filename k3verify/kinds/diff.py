"""Check kind `diff`: a toggle's contract judged against the reference path, one unit per
(toggle, scenario): bitwise logits / KDA state / MLA rows / tokens for an exact toggle, the
drift budget for an approx one (verdict/gate.py). `k3verify diff` and a suite's
`kind = "diff"` both plan and run through here.

With world_size W > 1 every run goes through W tensor-parallel ranks (reference: the same W
without the toggle). With backend "vllm" the toggles are vLLM engine settings
(serving/backends/vllm_backend.py TOGGLES), each judged bitwise on full-vocabulary logprobs
of the vLLM prompts (compare/logprobs.py); the model is then a Hugging Face directory.
"""
from __future__ import annotations

import difflib
from pathlib import Path

from k3verify.scenarios.chooser import choose, scenario_tokens
from k3verify.scenarios.workloads import build
from k3verify.verdict.gate import check_toggle
from k3verify.verdict.result import Result, Subject

from .base import (CheckSpec, Context, OptionError, Unit, check_int, check_scale, check_scenarios, check_toggles,
                   select_toggles, units_for)

NAME = "diff"
OPTIONS = {"toggles": "all-exact", "scenarios": None, "scale": 1.0, "seed": 0, "world_size": 1,
           "backend": "embedded"}
BACKENDS = ("embedded", "vllm")
VLLM_SCENARIO = "vllm_toggle_prompts"
DIFF_S_PER_TOKEN = 0.08   # measured 2026-12-01 on the 2-core dev CPU, the other core busy (progress only)


def validate(o: dict, approx_only: bool = False) -> None:
    if o["backend"] not in BACKENDS:
        raise OptionError("backend", f"must be one of {', '.join(BACKENDS)}, got {o['backend']!r}")
    if o["backend"] == "embedded":
        check_toggles(o["toggles"], approx_only=approx_only)
    check_scenarios(o["scenarios"])
    check_scale(o["scale"])
    check_int(o["seed"], "seed", 0)
    check_int(o["world_size"], "world_size", 1)


def plan(spec: CheckSpec) -> list[Unit]:
    from optimized_stack import toggles as registry

    o = spec.options
    if o["backend"] == "vllm":
        return units_for(spec, _vllm_toggles(o["toggles"]), lambda t: ((VLLM_SCENARIO,), ""))

    def scenarios(name):
        choice = choose(registry.get(name), o["scenarios"])
        return tuple(dict.fromkeys(choice.names)), choice.note
    # a toggle named twice is one toggle: its results are not counted twice
    return units_for(spec, list(dict.fromkeys(select_toggles(o["toggles"], spec.kind))), scenarios)


def cost_s(unit: Unit) -> float:
    """Prior seconds of a reference + candidate run of the unit's scenario (progress only)."""
    if unit.options["backend"] == "vllm":
        return 60.0
    o = unit.options
    return 1.0 + DIFF_S_PER_TOKEN * scenario_tokens(build(unit.scenario, scale=o["scale"], seed=o["seed"]))


def run(unit: Unit, ctx: Context) -> list[Result]:
    o = unit.options
    if o["backend"] == "vllm":
        return [_run_vllm(unit, ctx)]
    sc = build(unit.scenario, scale=o["scale"], seed=o["seed"])
    results = check_toggle(ctx.model, unit.toggle, sc, runner=ctx.runner(o["world_size"]))
    if unit.note:
        for r in results:
            r.evidence["note"] = unit.note
    return results


# ---- vLLM engine settings -----------------------------------------------------------------

def _vllm_toggles(names) -> list[str]:
    from k3verify.serving.backends import vllm_backend as vb

    if not isinstance(names, list) or not names:
        raise OptionError("toggle", f"names vLLM settings with backend vllm (known: {', '.join(vb.TOGGLES)})")
    for name in names:
        if name not in vb.TOGGLES:
            close = difflib.get_close_matches(name, list(vb.TOGGLES), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise OptionError("toggle", f"unknown vLLM toggle {name!r}{hint} (known: {', '.join(vb.TOGGLES)})", bare=True)
    return list(names)


def _run_vllm(unit: Unit, ctx: Context) -> Result:
    from k3verify.compare.logprobs import compare_logprobs
    from k3verify.serving.backends import vllm_backend as vb

    model_dir = Path(ctx.model_arg or "")
    subject = Subject(f"vllm:{unit.toggle}")
    reason = vb.vllm_unavailable_reason()
    if reason:
        return Result.skipped(subject, "logprobs", f"vLLM not available: {reason}", scenario=VLLM_SCENARIO)
    ref, cand = vb.run_vllm_pair(model_dir, vb.toggle_prompts(unit.options["seed"]), 16, vb.REFERENCE,
                                 vb.candidate_settings(unit.toggle))
    summary, findings = compare_logprobs(ref, cand, label=f"vllm:{unit.toggle}")
    nf = summary.nonfinite
    if nf:
        why = nf["reason"]
        first = {"request": nf["request"], "step": nf["step"], "tensor": "logprobs", "side": "+".join(nf["sides"])}
    elif summary.passed:
        why, first = f"bit-identical full-vocabulary logprobs ({summary.n_steps_compared} steps)", None
    else:
        why = (f"{summary.n_mismatched} logprob entries differ, max ULP {summary.max_ulp}, first divergent "
               f"(request, step) {summary.first_divergent}, tokens part at {summary.tokens_part}")
        first = {"request": summary.first_divergent[0], "step": summary.first_divergent[1], "tensor": "logprobs"} \
            if summary.first_divergent is not None else None
    status = "pass" if summary.passed else "fail"
    if summary.passed and not summary.n_steps_compared:      # bit-identical over nothing is not a pass
        status, why = "not_exercised", "nothing compared: 0 logprob steps in common"
    return Result.make(status, subject, "logprobs", why, scenario=VLLM_SCENARIO,
                       duration_s=float(cand.get("seconds", 0.0) or 0.0), first_divergence=first,
                       findings=[{**f.to_dict(), "message": f.message(), "request": i, "tokens_part": part}
                                 for i, part, f in findings if not f.equal][:3])
