"""Real answers for multi-turn scenarios (the AgentX shape: every turn re-sends the history,
the model's own previous answers included).

A scenario builder cannot run the model, so a turn that continues an earlier request names
it (`RequestSpec.parent`) and carries what it appends (`extend`); its static prompt holds a
stand-in answer of the same length. `realized(model, scenario)` replaces each stand-in with
the parent's real answer: the reference path (every request alone, whole-prompt prefill,
greedy unless the request samples with its own seed) is run on the parent, in arrival order,
and the child's prompt becomes parent prompt + generated tokens + extend. Deterministic, so
the realised scenario is a pure function of (scenario, model); it is cached per model.

The realised scenario records in `meta["reuse"]` what a perfect cache could serve
(theoretical: longest common prefix with any earlier prompt, and the same in whole 64-token
blocks); the engine's `metrics` in a capture say what it did serve (prefix_hit_tokens).
"""
from __future__ import annotations

import dataclasses
import weakref

from k3verify.errors import UsageError
from k3verify.scenarios.requests import (Scenario, arrival_order, reusable_block_tokens,
                                         reusable_fraction, reusable_prefix_tokens)

_CACHE: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def _key(scenario: Scenario) -> tuple:
    m = scenario.meta
    return scenario.name, m.get("seed"), m.get("scale"), m.get("vocab"), tuple(r.prompt_ids for r in scenario.requests)


def realized(model, scenario: Scenario) -> Scenario:
    """The scenario with every stand-in answer replaced by the model's real one (see above)."""
    if not scenario.needs_answers:
        return scenario
    cache = _CACHE.setdefault(model, {})
    key = _key(scenario)
    if key not in cache:
        cache[key] = _realize(model, scenario)
    return cache[key]


def _realize(model, scenario: Scenario) -> Scenario:
    from k3verify.run.sequential import run_scenario     # the reference path itself

    prompts: dict[str, tuple[int, ...]] = {}
    answers: dict[str, tuple[int, ...]] = {}
    by_id = {}
    for r in arrival_order(scenario.requests):
        if r.parent is None:
            prompt = r.prompt_ids
        elif r.parent not in answers:
            raise UsageError(f"scenario {scenario.name}: request {r.request_id} continues {r.parent!r}, "
                             f"which does not arrive before it")
        else:
            prompt = prompts[r.parent] + answers[r.parent] + r.extend
        prompts[r.request_id] = prompt
        by_id[r.request_id] = dataclasses.replace(r, prompt_ids=prompt)
        if any(c.parent == r.request_id for c in scenario.requests):
            one = dataclasses.replace(scenario, name=f"{scenario.name}/{r.request_id}", requests=(by_id[r.request_id],),
                                      meta={**scenario.meta, "answers": "reference"})
            cap = run_scenario(model, one, ())
            answers[r.request_id] = tuple(cap.requests[r.request_id].tokens)
    requests = tuple(by_id[r.request_id] for r in scenario.requests)
    reuse = reusable_prefix_tokens(requests)
    total = sum(r.prompt_len for r in requests)
    meta = {**scenario.meta, "answers": "reference",
            "answer_tokens": {rid: len(a) for rid, a in answers.items()},
            "reuse": {"prompt_tokens": total, "theoretical_tokens": sum(reuse.values()),
                      "theoretical_block_tokens": reusable_block_tokens(requests)}}
    return dataclasses.replace(scenario, requests=requests, reusable_fraction=reusable_fraction(requests), meta=meta)

