"""One tree's side of `k3verify diff --base REV`: a worker that runs in that tree's code.

Started by k3verify/patch/tree.py as

    python -P driver.py SPEC_JSON          (the tree on PYTHONPATH, the same venv)

so `import k3verify` / `import optimized_stack` resolve to the tree under test (REV's
temporary worktree, or the working tree), never to the k3verify that started it. This
file is not imported from there: it is run as a script, so the REV it drives need not
contain it, and it uses only the narrow API every tree shares:

    optimized_stack.load_model, optimized_stack.toggles.all_toggles()   (Toggle.to_dict)
    k3verify.workloads.build / SCENARIOS
    k3verify.runner.run_scenario(model, scenario, toggles, keep=True[, force=...])
    k3verify.capture.Capture.to_json and its kept tensors (RequestCapture logits / kda / mla)
    optional: k3verify.golden_hashes (numerics key, model id, golden check),
              k3verify.gate (check_toggle: only asked of the working tree)

A tree that lacks a required name is answered with {"ok": false, "kind": "api"} and a
one-line message (the caller turns it into exit 2).

Protocol: the caller writes one JSON request per line on stdin; the worker answers each
with one JSON line on its original stdout (anything the tree prints goes to stderr), and
may send {"progress": "..."} and {"unit_done": id} lines before an answer. Requests:
    {"cmd": "describe", "scale": s, "seed": n}  -> env, model, toggles, scenario tags
    {"cmd": "capture", "out": DIR, "units": [...]}  -> per unit DIR/<id>.json + <id>.safetensors
    {"cmd": "contract", "checks": [[toggle, scenario]], "scale", "seed", "golden": bool, "localize": bool}
    {"cmd": "exit"}
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import time
import traceback
from pathlib import Path

PROTOCOL = 1


class ApiMissing(Exception):
    """The tree lacks a name of the narrow API."""


# Where each piece of the narrow API lives: the stage layout first (2026-12-01), then the
# flat layout of older revisions, so one driver drives either side of a patch.
LAYOUTS = {
    "workloads": ("k3verify.scenarios.workloads", "k3verify.workloads"),
    "runner": ("k3verify.run.sequential", "k3verify.runner"),
    "capture": ("k3verify.capture.capture", "k3verify.capture"),
    "golden": ("k3verify.compare.golden", "k3verify.golden_hashes"),
    "golden_rows": ("k3verify.kinds.golden", "k3verify.golden_hashes"),
    "gate": ("k3verify.verdict.gate", "k3verify.gate"),
}


def _where(piece: str, attr: str) -> str:
    """The first module of the piece's layouts that has attr (else the newest, for the message)."""
    import importlib
    for name in LAYOUTS[piece]:
        try:
            if hasattr(importlib.import_module(name), attr):
                return name
        except Exception:  # noqa: BLE001 - a layout this revision does not have
            continue
    return LAYOUTS[piece][0]


def _need(module_name: str, attr: str | None = None):
    import importlib
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure means the API is not there
        raise ApiMissing(f"cannot import {module_name} ({type(exc).__name__}: {exc})".splitlines()[0]) from None
    if attr is None:
        return module
    if not hasattr(module, attr):
        raise ApiMissing(f"{module_name} has no {attr}")
    return getattr(module, attr)


def prompt_digest(scenario) -> str:
    """What the requests ask for, as golden_hashes._prompt_digest plus arrival, sampling and
    engine hints (they decide the bits too): equal digests mean the same scenario."""
    h = hashlib.sha256()
    for r in scenario.requests:
        h.update(f"{r.request_id}:{r.max_new_tokens}:{getattr(r, 'arrival_step', 0)}:"
                 f"{getattr(r, 'temperature', 0.0)}:{getattr(r, 'seed', None)}:"
                 f"{','.join(map(str, r.prompt_ids))};".encode())
    h.update(json.dumps(getattr(scenario, "engine_hints", {}) or {}, sort_keys=True, default=str).encode())
    return h.hexdigest()


def tensor_key(*parts) -> str:
    """safetensors key of one captured tensor: ["r0", "logits", 12] as JSON text."""
    return json.dumps(list(parts), separators=(",", ":"))


def write_unit(out: Path, uid: str, unit: dict, scenario, cap, duration_s: float) -> dict:
    """DIR/<uid>.safetensors (every kept tensor) and DIR/<uid>.json (Capture.to_json and the prompt digest)."""
    from safetensors.torch import save_file
    tensors = {}
    for rid, rc in cap.requests.items():
        for pos, item in rc.logits.items():
            tensors[tensor_key(rid, "logits", pos)] = item.tensor
        for n, point in rc.kda.items():
            for (layer, name), item in point.items():
                tensors[tensor_key(rid, "kda", n, layer, name)] = item.tensor
        for layer, item in rc.mla.items():
            tensors[tensor_key(rid, "mla", layer)] = item.tensor
    missing = [k for k, t in tensors.items() if t is None]
    if missing:
        raise ApiMissing(f"run_scenario(keep=True) kept no tensor for {missing[0]}")
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(out / f"{uid}.safetensors"))
    record = {"id": uid, "unit": unit, "prompts_sha256": prompt_digest(scenario), "capture": cap.to_json(),
              "duration_s": duration_s}
    (out / f"{uid}.json").write_text(json.dumps(record), encoding="utf-8")
    return record


class Worker:
    def __init__(self, spec: dict):
        self.tree = Path(spec["tree"]).resolve()
        self.device = spec.get("device", "cpu")
        self.model_arg = spec.get("model")
        self.reply_to = None
        self.refs: dict[tuple, object] = {}      # (scenario, scale, seed) -> reference Capture of this session
        self._import_api()
        self.model = self.load_model(self.model_arg, device=self.device)

    def _import_api(self) -> None:
        import optimized_stack
        import k3verify
        for pkg in (k3verify, optimized_stack):
            where = Path(pkg.__file__).resolve()
            if self.tree not in where.parents:
                raise ApiMissing(f"{pkg.__name__} was imported from {where.parent}, not from {self.tree} "
                                 f"(PYTHONPATH did not take)")
        self.load_model = _need("optimized_stack", "load_model")
        self.all_toggles = _need("optimized_stack.toggles", "all_toggles")
        self.workloads = _need(_where("workloads", "build"))
        self.build = _need(_where("workloads", "build"), "build")
        self.run_scenario = _need(_where("runner", "run_scenario"), "run_scenario")
        self.capture_cls = _need(_where("capture", "Capture"), "Capture")
        self.golden_module = _where("golden", "check")
        self.gate_module = _where("gate", "check_toggle")
        if not hasattr(self.capture_cls, "to_json"):
            raise ApiMissing("Capture has no to_json")
        params = inspect.signature(self.run_scenario).parameters
        if "keep" not in params:
            raise ApiMissing("run_scenario takes no keep= (captures cannot keep tensors)")
        self.can_force = "force" in params

    # ---- describe ------------------------------------------------------------------------
    def describe(self, req: dict) -> dict:
        import torch
        env, key, model_id, fingerprint = None, None, None, {}
        try:
            gh = _need(self.golden_module)
            env = gh.numerics_environment(self.model)
            key = gh.env_key(env)
            model_id = gh.model_id(self.model)
        except (ApiMissing, AttributeError):
            p = next(self.model.parameters())
            env = {"torch": torch.__version__, "device": p.device.type, "dtype": str(p.dtype),
                   "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
        try:
            fingerprint = _need("k3verify.report.environment", "model_fingerprint")(self.model)
        except ApiMissing:
            fingerprint = {"source": str(getattr(self.model, "source", None))}
        if model_id is None:
            sha = fingerprint.get("sha256")
            model_id = f"sha256:{sha}" if sha else str(fingerprint.get("source"))
        toggles = []
        for t in self.all_toggles():
            toggles.append({"name": t.name, "kind": t.kind, "contract": t.contract.describe(),
                            "contract_kind": t.contract.kind, "devices": list(t.devices),
                            "world_sizes": list(t.world_sizes), "scenario_tags": list(t.scenario_tags),
                            "exercised_by": list(getattr(t, "exercised_by", ()))})
        names = list(getattr(self.workloads, "SCENARIOS", {}))
        scenarios = {}
        for name in names:
            sc = self.build(name, scale=req.get("scale", 1.0), seed=req.get("seed", 0))
            scenarios[name] = {"tags": list(sc.tags), "prompts_sha256": prompt_digest(sc),
                               "prompt_tokens": sum(len(r.prompt_ids) for r in sc.requests)}
        return {"protocol": PROTOCOL, "tree": str(self.tree), "env": env, "env_key": key, "model_id": model_id,
                "model": fingerprint, "toggles": toggles, "scenarios": scenarios,
                "capabilities": {"force": self.can_force, "contract": self._has_gate(),
                                 "golden": self._has(self.golden_module, "check")}}

    def _has(self, module: str, attr: str) -> bool:
        try:
            _need(module, attr)
            return True
        except ApiMissing:
            return False

    def _has_gate(self) -> bool:
        return self._has(self.gate_module, "check_toggle") and self._runs_class() is not None

    def _runs_class(self):
        """The reference-run cache check_toggle takes: Runner (stage layout) or ReferenceRuns."""
        for module, attr in (("k3verify.run.runner", "Runner"), ("k3verify.gate", "ReferenceRuns")):
            if self._has(module, attr):
                return _need(module, attr)
        return None

    # ---- capture -------------------------------------------------------------------------
    def capture(self, req: dict) -> dict:
        out = Path(req["out"])
        out.mkdir(parents=True, exist_ok=True)
        done = []
        for unit in req["units"]:
            self.progress(f"{unit['label']} on {unit['scenario']}")
            t0 = time.perf_counter()
            uid = unit["id"]
            try:
                sc = self.build(unit["scenario"], scale=unit["scale"], seed=unit["seed"])
                kw = {"keep": True}
                if unit.get("force") is not None:
                    if not self.can_force:
                        raise ApiMissing("run_scenario takes no force= (teacher forcing)")
                    kw["force"] = unit["force"]
                cap = self.run_scenario(self.model, sc, tuple(unit["toggles"]), **kw)
                if not unit["toggles"]:
                    self.refs[(unit["scenario"], unit["scale"], unit["seed"])] = cap
                record = write_unit(out, uid, unit, sc, cap, time.perf_counter() - t0)
            except ApiMissing:
                raise
            except Exception as exc:  # noqa: BLE001 - a crashing run is that unit's error, reported
                record = {"id": uid, "unit": unit, "error": f"{type(exc).__name__}: {exc}"[:400],
                          "traceback": traceback.format_exc()[-3000:], "duration_s": time.perf_counter() - t0}
            if "error" in record:
                (out / f"{uid}.json").write_text(json.dumps(record), encoding="utf-8")
            done.append(uid)
            self.reply({"unit_done": uid})
        return {"units": done}

    # ---- contract (working tree only) ----------------------------------------------------
    def contract(self, req: dict) -> dict:
        gate = _need(self.gate_module)
        primed = self.refs
        scale, seed = req["scale"], req["seed"]
        base = self._runs_class()
        cached = "reference" if hasattr(base, "reference") else "get"      # Runner.reference / ReferenceRuns.get

        class Primed(base):
            """The reference captures of this session's capture request are the same runs."""

        def primed_reference(self_, scenario):
            cap = primed.get((scenario.name, scale, seed))
            return cap if cap is not None else getattr(base, cached)(self_, scenario)
        setattr(Primed, cached, primed_reference)

        refs = Primed(self.model)
        params = inspect.signature(gate.check_toggle).parameters
        kw = {"runner" if "runner" in params else "references": refs}
        if "localize_failures" in params:
            kw["localize_failures"] = bool(req.get("localize"))
        rows = []
        for toggle, scenario in req["checks"]:
            self.progress(f"contract of {toggle} on {scenario}")
            sc = self.build(scenario, scale=scale, seed=seed)
            try:
                rows += [r.to_dict() for r in gate.check_toggle(self.model, toggle, sc, **kw)]
            except Exception as exc:  # noqa: BLE001 - reported as an error result of that check
                rows.append({"toggle": toggle, "scenario": scenario, "check": "contract", "status": "error",
                             "reason": f"{type(exc).__name__}: {exc}"[:400], "findings": [],
                             "traceback": traceback.format_exc()[-3000:]})
        golden = None
        if req.get("golden"):
            self.progress("golden check")
            gh = _need(self.golden_module)
            t0 = time.perf_counter()
            gc = gh.check(self.model)
            golden = {"status": gc.status, "reason": gc.reason, "env_key": gc.env_key, "path": gc.path,
                      "rows": self._golden_rows(gc, time.perf_counter() - t0)}
        return {"rows": rows, "golden": golden}

    @staticmethod
    def _golden_rows(gc, duration_s: float) -> list[dict]:
        """The golden check's report rows: Result objects in the stage layout, dicts before it."""
        module = _where("golden_rows", "results")
        if module.endswith("kinds.golden") and hasattr(_need(module), "results"):
            return [r.to_dict() for r in _need(module, "results")(gc, duration_s)]
        return _need(_where("golden_rows", "to_results"), "to_results")(gc, duration_s)

    def progress(self, message: str) -> None:
        self.reply({"progress": message})

    def reply(self, obj: dict) -> None:
        self.reply_to.write(json.dumps(obj, default=str) + "\n")
        self.reply_to.flush()


def main(argv: list[str]) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)      # answers go here ...
    os.dup2(2, 1)                                        # ... and whatever the tree prints, to stderr
    sys.stdout = sys.stderr
    try:
        spec = json.loads(argv[0])
        worker = Worker(spec)
    except ApiMissing as exc:
        proto.write(json.dumps({"ok": False, "kind": "api", "message": str(exc)}) + "\n")
        return 3
    except Exception as exc:  # noqa: BLE001 - the tree cannot even load its model
        proto.write(json.dumps({"ok": False, "kind": "crash", "message": f"{type(exc).__name__}: {exc}"[:400],
                                "traceback": traceback.format_exc()[-3000:]}) + "\n")
        return 3
    worker.reply_to = proto
    worker.reply({"ok": True, "ready": True, "protocol": PROTOCOL})
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "exit":
            return 0
        try:
            answer = getattr(worker, req["cmd"])(req)
            worker.reply({"ok": True, **answer})
        except ApiMissing as exc:
            worker.reply({"ok": False, "kind": "api", "message": str(exc)})
        except Exception as exc:  # noqa: BLE001 - one line back to the caller, the traceback with it
            worker.reply({"ok": False, "kind": "crash", "message": f"{type(exc).__name__}: {exc}"[:400],
                          "traceback": traceback.format_exc()[-3000:]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
