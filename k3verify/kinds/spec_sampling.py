"""Check kind `spec_sampling`: the distribution contract of sampled speculation (temperature > 0,
optimized_stack/engine/spec_sampling.py), judged statistically, with its negative controls.

Why a kind of its own and not a registry toggle: the registry's contracts are judged by comparing
a candidate run with the reference run (bitwise, or teacher-forced drift), and sampled speculation
draws from another random stream, so no two runs agree token for token even when it is right.
Its contract is "distributed as the plain sampler": n seeded samples per arm, the chi-square test
of homogeneity at level alpha (k3verify/quality/distribution.py), at an n with power 0.9 for a
total-variation shift of 0.01.

One unit per drafter ("ngram": q a point mass; "model": q a distribution). Each unit returns
- the rule (subject spec_sampled): pass when every statistic (first token, pairs, triples given the
  context) holds, fail with the p-values when one is rejected, not exercised when some
  verification outcome (all accepted / some / none) never happened;
- one row per seeded fault (the engine's mutants mut_spec_sampled_*): pass ("caught") when the same
  test at the same n rejects it, fail when the fault passes (a check that cannot fail);
- with engine_samples N > 0 (and a model), the engine itself: N requests with sampled
  speculation against N without, judged the same way, not exercised when no sampled
  verification fired.
"""
from __future__ import annotations

import time

from k3verify.verdict.result import Result, Subject

from .base import CheckSpec, Context, OptionError, Unit, check_int, is_number

NAME = "spec_sampling"
OPTIONS = {"samples": 600_000, "alpha": 1e-3, "drafters": ["ngram", "model"], "seed": 0, "engine_samples": 0}
DRAFTERS = ("ngram", "model")
# the rule's seeded faults: the engine fault name -> the rule's keyword
FAULTS = {"mut_spec_sampled_accept_sqrt": {"accept_power": 0.5},
          "mut_spec_sampled_resample_from_p": {"resample_from_p": True}}
S_PER_SAMPLE = 5e-6       # measured 2026-12-02: ~3 s per arm pair at 600,000 on the 2-core dev CPU


def subject(name: str, alpha: float) -> Subject:
    contract = f"distribution(alpha={alpha:g})"
    return Subject(name, "mutant" if name.startswith("mut_") else "optimization", contract)


def validate(o: dict) -> None:
    check_int(o["samples"], "samples", 100)
    check_int(o["seed"], "seed", 0)
    check_int(o["engine_samples"], "engine_samples", 0)
    if not is_number(o["alpha"]) or not 0 < o["alpha"] < 1:
        raise OptionError("alpha", f"must be a number in (0, 1), got {o['alpha']!r}")
    d = o["drafters"]
    if not isinstance(d, list) or not d or any(x not in DRAFTERS for x in d):
        raise OptionError("drafters", f"must be a non-empty list of {', '.join(DRAFTERS)}, got {d!r}")


def plan(spec: CheckSpec) -> list[Unit]:
    units = [Unit(spec.kind, spec.name, spec.options, "spec_sampled", f"toy_chain_{d}", check_index=spec.index)
             for d in spec.options["drafters"]]
    if spec.options["engine_samples"]:
        units.append(Unit(spec.kind, spec.name, spec.options, "spec_sampled", "engine", check_index=spec.index))
    return units


def cost_s(unit: Unit) -> float:
    if unit.scenario == "engine":
        return 0.15 * 2 * unit.options["engine_samples"]
    return S_PER_SAMPLE * unit.options["samples"] * (1 + len(FAULTS))


def label(unit: Unit) -> str:
    return f"sampled speculation on {unit.scenario}"


def _pvalues(verdicts) -> str:
    return ", ".join(f"{name} p={v.p_value:.3g} (chi2 {v.statistic:.1f}, df {v.df})" for name, v in verdicts.items())


def _evidence(rep) -> dict:
    return {"distribution": rep.to_dict()}


def run(unit: Unit, ctx: Context) -> list[Result]:
    if unit.scenario == "engine":
        return [_run_engine(unit, ctx)]
    from k3verify.quality.spec_sampling_check import rule_check

    o = unit.options
    drafter = unit.scenario.removeprefix("toy_chain_")
    rep = rule_check(o["samples"], drafter=drafter, alpha=o["alpha"], seed=o["seed"])
    sub = subject("spec_sampled", o["alpha"])
    common = dict(scenario=unit.scenario, duration_s=rep.seconds, evidence=_evidence(rep))
    silent = [k for k, n in rep.outcomes.items() if not n]
    if rep.passed and silent:
        out = [Result.not_exercised(sub, "distribution", f"held ({_pvalues(rep.verdicts)}), but no verification "
                                    f"ended in {', '.join(silent)}", **common)]
    elif rep.passed:
        out = [Result.passed(sub, "distribution", f"n={rep.n} per arm: {_pvalues(rep.verdicts)}", **common)]
    else:
        out = [Result.failed(sub, "distribution", f"not distributed as plain sampling, n={rep.n} per arm: "
                             f"{_pvalues(rep.verdicts)}", **common)]
    for fault, kw in FAULTS.items():
        bad = rule_check(o["samples"], drafter=drafter, alpha=o["alpha"], seed=o["seed"], **kw)
        msub, ev = subject(fault, o["alpha"]), dict(scenario=unit.scenario, duration_s=bad.seconds,
                                                      evidence=_evidence(bad))
        if bad.passed:
            out.append(Result.failed(msub, "distribution", f"the seeded fault passed the distribution test at "
                                     f"n={bad.n}: {_pvalues(bad.verdicts)}", caught=False, **ev))
        else:
            out.append(Result.passed(msub, "distribution", f"caught at n={bad.n}: {_pvalues(bad.verdicts)}",
                                     caught=True, **ev))
    return out


def _run_engine(unit: Unit, ctx: Context) -> Result:
    from k3verify.quality.distribution import min_detectable_tv
    from k3verify.quality.spec_sampling_check import engine_check

    o = unit.options
    sub = subject("spec_sampled", o["alpha"])
    if ctx.model is None:
        return Result.skipped(sub, "distribution", "the engine arm needs a model", scenario="engine")
    t0 = time.perf_counter()
    rep = engine_check(ctx.model, o["engine_samples"], alpha=o["alpha"], seed=o["seed"])
    common = dict(scenario="engine", duration_s=time.perf_counter() - t0, evidence=_evidence(rep))
    informative = [v for v in rep.verdicts.values() if v.df >= 1]
    if not rep.exercised or not informative:
        why = "no sampled verification fired" if not rep.exercised else "every statistic had one category (df 0)"
        return Result.not_exercised(sub, "distribution", f"{why}: {rep.events}", **common)
    if all(v.passed for v in rep.verdicts.values()):
        # a small n sees only large shifts: say how large (the rule itself is held to 0.01 above)
        worst = max(min_detectable_tv(rep.n, v.df, o["alpha"]) for v in informative)
        return Result.passed(sub, "distribution", f"n={rep.n} requests per arm, events {rep.events}: "
                             f"{_pvalues(rep.verdicts)}; sees a TV shift >= {worst:.2f} with power 0.9", **common)
    return Result.failed(sub, "distribution", f"engine output not distributed as plain sampling: "
                         f"{_pvalues(rep.verdicts)}", **common)
