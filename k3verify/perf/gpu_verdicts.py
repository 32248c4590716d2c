"""How the GPU exactness run judges one toggle or mutant on the GPU reference: the exact
toggles' default scenarios (as `k3verify diff` picks them), the full-size grid scenarios of the
prefix and host-tier toggles, a toggle whose own path cannot run on the 64-token grid (judged
switched on, reported inert, never a pass), and a mutant (caught?)."""
from __future__ import annotations

from typing import Any

from optimized_stack import toggles as registry

from k3verify.kinds import selftest as selftest_kind
from k3verify.kinds.base import Context, Unit
from k3verify.run.runner import Runner
from k3verify.scenarios import workloads
from k3verify.scenarios.chooser import choose
from k3verify.verdict.gate import check_toggle

SCALE = 0.5                                   # scenario scale of the verdicts (one device call)


def exact_toggles() -> list[str]:
    return [t.name for t in registry.all_toggles("optimization")
            if t.contract.kind == "exact" and 1 in t.world_sizes and ("cuda" in t.devices or "cuda" in t.not_exact_on)]


def judge(model, name: str, runner: Runner) -> list:
    """The toggle on its default scenarios (scenarios/chooser.py), as `k3verify diff` judges it;
    a prefix or host-tier toggle on its full-size grid scenarios instead: at SCALE no prompt
    reaches an aligned checkpoint, so on the grid its path never ran (the events said so)."""
    toggle = registry.get(name)
    if name in GRID_SCENARIOS:
        return [r for sc in GRID_SCENARIOS[name]
                for r in check_toggle(model, name, workloads.build(sc, scale=1.0), runner=runner)]
    return [r for sc in choose(toggle).names
            for r in check_toggle(model, name, workloads.build(sc, scale=SCALE), runner=runner)]


def judge_one(model, m, runner: Runner) -> dict[str, Any]:
    """The selftest's verdict on one toggle or mutant (kinds/selftest.py), as a report row."""
    unit = Unit("selftest", "selftest", {"scale": SCALE}, toggle=m.name,
                scenario=choose(m, one=True, scale=SCALE).names[0])
    ctx = Context(model)
    ctx._runners[(1, ctx.tp_backend)] = runner       # share the reference captures
    return selftest_kind.run(unit, ctx)[0].to_dict()


def verdict(name: str, results) -> dict[str, Any]:
    by_sc: dict[str, dict[str, str]] = {}
    for r in results:
        by_sc.setdefault(r.scenario, {})[r.check] = r.status
    bad = [r for r in results if r.status in ("fail", "error")]
    ran = [r for r in results if r.status == "pass"]
    if bad:
        status, reason = "fail", f"{bad[0].scenario}/{bad[0].check}: {bad[0].reason}"
    elif results and all(r.status == "not_exercised" and _inert(name, r) for r in results):
        # switched on, bit-identical everywhere, with none of its own paths able to run (gate.py)
        why = next(iter(results[0].evidence["events_impossible"].values()))
        fired = {}
        for r in results:
            for event, n in (r.evidence.get("counters") or {}).items():
                fired[event] = max(fired.get(event, 0), int(n))
        ran_instead = ", ".join(f"{e}={n}" for e, n in sorted(fired.items()) if e.startswith("prefix_hit"))
        status = "inert-on-cuda"
        reason = (f"{why}; switched on, bit-identical on {len(by_sc)} grid scenarios ({len(results)} checks; "
                  f"in its place: {ran_instead or 'no prefix hit'})")
    elif not ran:
        reason = results[0].reason if results else "no scenario"
        status = "not-exact-on-cuda" if reason.startswith("not exact on cuda") else "skip"
    else:
        status = "pass"
        reason = f"bit-identical on {len(by_sc)} scenarios ({sum(1 for r in ran)} checks)"
    return {"toggle": name, "status": status, "reason": reason, "scenarios": by_sc}


# On the 64-token grid prefix hits happen only at aligned checkpoints (engine/store.py), which
# the selftest's cheapest prefix scenario at half scale never reaches: these mutants are judged on
# full-size scenarios whose forks and evictions land on the grid, the first that catches counts.
GRID_SCENARIOS = {"prefix_cache": ("shared_prefix_forks", "multi_turn"),
                  "prefix_cache_subblock": ("shared_prefix_forks", "multi_turn"),
                  "ckpt_with_mla_tail": ("shared_prefix_forks", "multi_turn"),
                  "host_kv_tier": ("eviction",)}


def _inert(name: str, result) -> bool:
    """Every event the toggle declares is impossible on this grid (gate.unexercised's inert case)."""
    declared = registry.get(name).events
    return bool(declared) and set(declared) <= set(result.evidence.get("events_impossible") or {})


def judge_on_grid(model, refs, m, scenarios: tuple[str, ...]) -> dict[str, Any]:
    tried = []
    for name in scenarios:
        sc = workloads.build(name, scale=1.0)
        results = check_toggle(model, m.name, sc, runner=refs)
        if results and all(r.status == "skip" for r in results):      # e.g. its path cannot run on the grid
            return {"toggle": m.name, "status": "skip", "scenario": name, "reason": results[0].reason}
        failed = {r.check for r in results if r.status == "fail"}
        tried.append(f"{name}: {sorted(failed) or 'nothing failed'}")
        if failed & set(m.caught_by):
            where = next((r.localization for r in results if r.localization), None) or {}
            found = where.get("component")
            return {"toggle": m.name, "status": "pass", "scenario": name,
                    "reason": f"caught by {', '.join(sorted(failed & set(m.caught_by)))} on {name} (full scale); "
                              f"localised to {found}",
                    "evidence": {"localisation": {"lives_in": m.lives_in, "found": found,
                                                  "exact": m.lives_in is not None and found == m.lives_in}}}
    return {"toggle": m.name, "status": "fail", "scenario": ",".join(scenarios),
            "reason": "not caught on the grid scenarios (" + "; ".join(tried) + "): its path is not reached on the "
                      "64-token grid, where hits need aligned checkpoints"}
