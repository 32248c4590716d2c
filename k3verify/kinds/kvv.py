"""Check kind `kvv`: the Kimi Vendor Verifier API-contract checks against an OpenAI-compatible
endpoint, or KVV benchmark scores held to the vendor ranges (quality/kvv_gate.py).

`base_url` names the endpoint; without one the model under test is served in-process
(`k3verify serve` on a free loopback port, on the run's device) and checked: on the reference path,
or with `stack = "counted"` / `toggles = [...]` through the engine (serving/stack.py), its fast
path included. Every row then names the stack it judged (`served_stack`, from the server's /stack
and the X-K3verify-Stack header of every response), and one more row, kvv/served-stack, passes
only if every response came from that stack and one of each named toggle's own path events fired
during the run (fast_decode_rows for batched_decode, graph_replay for cuda_graphs): not exercised
otherwise. `import_file` reads KVV results
(JSON or CSV) instead. Each check is one result, pass / fail / skip with its reason; a skip
says what it would need (most often a real K3 endpoint). The API key, if any, is read from
OPENAI_API_KEY.
"""
from __future__ import annotations

import os
import time
from collections import Counter
import types
from urllib.parse import urlparse

from k3verify.verdict.result import Result

from .base import CheckSpec, Context, OptionError, Unit, check_int

NAME = "kvv"
OPTIONS = {"base_url": None, "model_name": None, "only": None, "max_tokens": 16, "structured_max_tokens": 2048,
           "import_file": None, "stack": None, "toggles": None}
KVV_S = 60.0          # against the served model on the 2-core dev CPU (progress only)


def validate(o: dict) -> None:
    if o["base_url"] is not None:
        try:
            url = urlparse(str(o["base_url"]))
            url.port                     # parsed lazily: "http://h:x/v1" raises only here
        except ValueError as exc:        # urllib's "Invalid IPv6 URL", a port that is not a number
            raise OptionError("base_url", f"must be an http(s) URL with a host, like http://127.0.0.1:8000/v1, "
                                          f"got {o['base_url']!r} ({exc})") from None
        if url.scheme not in ("http", "https") or not url.netloc:
            raise OptionError("base_url", f"must be an http(s) URL with a host, like http://127.0.0.1:8000/v1, "
                                          f"got {o['base_url']!r}")
    if o["import_file"] is not None and o["base_url"] is not None:
        raise OptionError("import_file", "reads a file; a base_url does not apply")
    served = o["stack"] is not None or o["toggles"] is not None
    if served and (o["base_url"] is not None or o["import_file"] is not None):
        raise OptionError("stack", "picks what the in-process server runs; a base_url or import_file does not apply")
    from k3verify.serving.stack import STACKS
    if o["stack"] is not None and o["stack"] not in STACKS:
        raise OptionError("stack", f"must be one of {', '.join(STACKS)}, got {o['stack']!r}")
    toggles = o["toggles"]
    if toggles is not None:
        if not (isinstance(toggles, list) and toggles and all(isinstance(x, str) for x in toggles)):
            raise OptionError("toggles", f"must be a non-empty list of toggle names, got {toggles!r}")
        if o["stack"] is not None:
            raise OptionError("toggles", "give either stack or toggles, not both")
        from optimized_stack import toggles as registry
        from optimized_stack.errors import K3Error
        try:
            registry.resolve(toggles)
        except K3Error as e:
            raise OptionError("toggles", str(e)) from None
    check_int(o["max_tokens"], "max_tokens", 1)
    check_int(o["structured_max_tokens"], "structured_max_tokens", 1)
    only = o["only"]
    if only is not None:
        if not (isinstance(only, list) and only and all(isinstance(x, str) for x in only)):
            raise OptionError("only", f"must be a non-empty list of check-name prefixes, got {only!r}")
        from k3verify.quality.evals.kvv import _plan  # the check names run_kvv matches `only` against:
        stub = types.SimpleNamespace(base_url="http://127.0.0.1/v1", model="m")   # building the plan sends nothing
        names = [n for n, _ in _plan(stub, False, o["max_tokens"], o["structured_max_tokens"])]
        unknown = [p for p in only if not any(n.startswith(p) for n in names)]
        if unknown:
            raise OptionError("only", f"{unknown[0]!r}: no KVV check starts with it; names are like {names[1]!r}",
                              bare=False)


def plan(spec: CheckSpec) -> list[Unit]:
    return [Unit(spec.kind, spec.name, spec.options, check_index=spec.index)]


def cost_s(unit: Unit) -> float:
    return KVV_S


def run(unit: Unit, ctx: Context) -> list[Result]:
    from k3verify.quality.kvv_gate import kvv_import_gate

    o = unit.options
    if o["import_file"] is not None:
        from k3verify.quality.evals.kvv_ranges import import_kvv_results
        gate = kvv_import_gate(import_kvv_results(o["import_file"]))
    elif o["base_url"] is not None:
        gate = _check_endpoint(o, o["base_url"])
    else:
        return _check_served(o, ctx)
    return [r.tag(gate=NAME) for r in gate.results]


def _check_served(o: dict, ctx: Context) -> list[Result]:
    """Serve the model under test in-process on the chosen stack, run KVV, and prove which stack it judged."""
    import httpx

    from k3verify.serving.lifecycle import ServerThread, build_embedded_app
    from k3verify.serving.stack import serve_stack

    device = str(ctx.placement.get("device", "cpu"))
    stack = serve_stack(o["stack"], o["toggles"] or [], device)
    headers: Counter = Counter()

    def seen(response) -> None:
        headers[response.headers.get("x-k3verify-stack", "(none)")] += 1

    with ServerThread(build_embedded_app(ctx.model_arg, stack=stack, **ctx.load_options, **ctx.placement)) as server:
        root = server.base_url.removesuffix("/v1")
        before = httpx.get(f"{root}/stack", timeout=30).json()
        gate = _check_endpoint(o, server.base_url, seen)
        after = httpx.get(f"{root}/stack", timeout=30).json()
    fired = {k: v - before["path_events"].get(k, 0) for k, v in after["path_events"].items()
             if v - before["path_events"].get(k, 0)}
    evidence = {"served_stack": after["label"], "served_toggles": after["toggles"], "served_device": device,
                "stack_events": fired, "responses_by_stack": dict(headers)}
    results = [r.tag(gate=NAME, **evidence) for r in gate.results]
    return results + [served_stack_result(stack, after["label"], headers, fired, gate.results[0].scenario)
                      .tag(gate=NAME, **evidence)]


def served_stack_result(stack, label: str, headers: Counter, fired: dict[str, int], scenario: str) -> Result:
    """kvv/served-stack: every response came from `stack`, and each toggle it names left its events."""
    from optimized_stack import toggles as registry
    from k3verify.verdict.result import Subject

    subject = Subject("endpoint", contract=f"KVV API contract on the {stack.name} stack")
    check = "kvv/served-stack"
    others = {h: n for h, n in headers.items() if h != label}
    if label != stack.label or others or not headers:
        return Result.failed(subject, check, f"expected every response from {stack.label}; the server says "
                                             f"{label}, responses by stack {dict(headers)}", scenario=scenario)
    # a toggle's own events: those its requires do not also declare (cuda_graphs is proven by
    # graph_replay, not by the fast_decode_rows of the batched_decode it needs)
    silent = []
    for t in registry.resolve(list(stack.toggles)):
        inherited = {e for r in registry.resolve(list(t.requires)) for e in r.events}
        own = [e for e in t.events if e not in inherited]
        if t.name in stack.toggles and own and not any(fired.get(e) for e in own):
            silent.append(f"{t.name} ({', '.join(own)})")
    if silent:
        return Result.not_exercised(subject, check, f"{sum(headers.values())} responses from {label}, but no "
                                                    f"event of {', '.join(silent)} fired during the run",
                                    scenario=scenario)
    shown = ", ".join(f"{k}={v}" for k, v in sorted(fired.items())) or "none (reference path)"
    return Result.passed(subject, check, f"all {sum(headers.values())} responses from {label}; events: {shown}",
                         scenario=scenario)


def _check_endpoint(o: dict, base_url: str, on_response=None):
    from k3verify.quality.evals.kvv import run_kvv
    from k3verify.quality.kvv_gate import kvv_gate
    from k3verify.serving.endpoint import served_model

    name = o["model_name"] or served_model(base_url)
    started = time.perf_counter()
    out = run_kvv(base_url, name, os.environ.get("OPENAI_API_KEY") or None, max_tokens=o["max_tokens"],
                  structured_max_tokens=o["structured_max_tokens"], only=o["only"], on_response=on_response)
    return kvv_gate(out, time.perf_counter() - started)
