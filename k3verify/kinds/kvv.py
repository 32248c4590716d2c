"""Check kind `kvv`: the Kimi Vendor Verifier API-contract checks against an OpenAI-compatible
endpoint, or KVV benchmark scores held to the vendor ranges (quality/kvv_gate.py).

`base_url` names the endpoint; without one the model under test is served in-process
(`k3verify serve` on a free loopback port) and checked. `import_file` reads KVV results
(JSON or CSV) instead. Each check is one result, pass / fail / skip with its reason; a skip
says what it would need (most often a real K3 endpoint). The API key, if any, is read from
OPENAI_API_KEY.
"""
from __future__ import annotations

import os
import time
import types
from urllib.parse import urlparse

from k3verify.verdict.result import Result

from .base import CheckSpec, Context, OptionError, Unit, check_int

NAME = "kvv"
OPTIONS = {"base_url": None, "model_name": None, "only": None, "max_tokens": 16, "structured_max_tokens": 2048,
           "import_file": None}
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
        from k3verify.serving.lifecycle import ServerThread, build_embedded_app
        with ServerThread(build_embedded_app(ctx.model_arg, **ctx.load_options, **ctx.placement)) as server:
            gate = _check_endpoint(o, server.base_url)
    return [r.tag(gate=NAME) for r in gate.results]


def _check_endpoint(o: dict, base_url: str):
    from k3verify.quality.evals.kvv import run_kvv
    from k3verify.quality.kvv_gate import kvv_gate
    from k3verify.serving.endpoint import served_model

    name = o["model_name"] or served_model(base_url)
    started = time.perf_counter()
    out = run_kvv(base_url, name, os.environ.get("OPENAI_API_KEY") or None, max_tokens=o["max_tokens"],
                  structured_max_tokens=o["structured_max_tokens"], only=o["only"])
    return kvv_gate(out, time.perf_counter() - started)
