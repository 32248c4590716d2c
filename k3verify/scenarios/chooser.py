"""Which scenarios judge a toggle: the one chooser behind `diff`, `selftest`, the suites, the
GPU run and `bench`.

It reads the registry's static tags (scenarios/workloads.py SCENARIOS: name, description,
tags, builder) and never builds a scenario to learn them. The rules:

- `choose(toggle)` (no names): DEFAULT_SCENARIOS, plus every scenario whose tags meet the
  toggle's `scenario_tags` or `exercised_by` (what `k3verify diff` runs);
- `choose(toggle, names)`: the names as written (listed scenarios a toggle does not apply to
  stay, so their skips are in the report); if the toggle applies only to tagged scenarios and
  none listed carries a tag, the first registered scenario that does is added, and the note
  says so (an automatic choice is always stated);
- `choose(toggle, one=True, scale=s)`: the cheapest scenario that exercises the toggle, or
  the toggle it mutates ("single" when none does): the selftest proves a check can fail and
  needs no bigger case. Among the candidates, those whose static `fires` claims every event
  the toggle declares come first (a cheaper one that cannot fire them would judge nothing;
  tests/test_events.py proves the claims). Cheapest means fewest prompt + new tokens at that
  scale, which does build the few tagged candidates (their size, not their tags, is measured);
- `workload(name)`: the bench workloads (agentic, decode, prefill) by scenario.
"""
from __future__ import annotations

from dataclasses import dataclass

from k3verify.errors import UsageError

from .workloads import SCENARIOS, build

DEFAULT_SCENARIOS = ("single", "multi_length", "boundaries")
FALLBACK_SCENARIO = "single"
BENCH_WORKLOADS = {"agentic": "agentic", "decode": "single", "prefill": "long_prompt"}


@dataclass(frozen=True)
class Choice:
    names: tuple[str, ...]
    note: str = ""                 # why a scenario was added, when one was


def tagged(tags: set[str]) -> list[str]:
    """Registered scenarios carrying any of `tags`, in registry order."""
    return [name for name, entry in SCENARIOS.items() if tags & set(entry.tags)]


def _tags(toggle) -> set[str]:
    return set(toggle.scenario_tags) | set(toggle.exercised_by)


def scenario_tokens(scenario) -> int:
    """Prompt + new tokens of a built scenario (its cost on the reference path)."""
    return sum(len(r.prompt_ids) + r.max_new_tokens for r in scenario.requests)


def choose(toggle, names=None, *, one: bool = False, scale: float = 1.0) -> Choice:
    """See the module docstring."""
    if one:
        return Choice((_cheapest(toggle, scale),))
    if not names:
        return Choice(tuple(dict.fromkeys([*DEFAULT_SCENARIOS, *tagged(_tags(toggle))])))
    names = tuple(names)
    need = set(toggle.scenario_tags)
    if not need or any(need & set(SCENARIOS[n].tags) for n in names if n in SCENARIOS):
        return Choice(names)
    for n in tagged(need):
        return Choice(names + (n,), f"added {n!r}: none of {list(names)} carries the toggle's tags {sorted(need)}")
    return Choice(names)


def _cheapest(toggle, scale: float) -> str:
    tags = _tags(toggle)
    if toggle.mutant_of:
        from optimized_stack import toggles as registry
        tags |= _tags(registry.get(toggle.mutant_of))
    candidates = tagged(tags)
    if not candidates:
        return FALLBACK_SCENARIO
    covering = [n for n in candidates if toggle.events and set(toggle.events) <= set(SCENARIOS[n].fires)]
    candidates = covering or candidates
    return min(candidates, key=lambda n: scenario_tokens(build(n, scale=scale)))


def workload(name: str, scale: float = 1.0):
    """agentic | decode | prefill -> the built Scenario the bench times."""
    if name not in BENCH_WORKLOADS:
        raise UsageError(f"workload must be one of {', '.join(BENCH_WORKLOADS)}, got {name!r}")
    return build(BENCH_WORKLOADS[name], scale=scale)
