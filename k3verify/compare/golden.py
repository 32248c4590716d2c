"""Golden reference hashes: has the reference path itself drifted?

`record` runs the reference path (no toggles) on a fixed small scenario set and stores
each scenario's capture hashes (Capture.to_json: every logit row, every KDA state
point, MLA rows at the end, the token streams) in golden/hashes/<env-key>.json.
`check` re-runs and compares with the gate's own comparator (compare/captures.py),
so a torch upgrade or a "harmless" refactor of a reference op that changes bits is
reported with its location: scenario, request, position/step, tensor, layer.

Bits legitimately differ across numerics environments (torch version, CPU SIMD level,
device, dtype, thread count, the BLAS code branch), so the file is keyed by those; a check
in an environment with no file is a skip that says so, never a failure. The CPU reference
pins MKL's code branch (optimized_stack/numerics.py), so the bits do not depend on which
kernels MKL would pick for the processor. What may still differ from machine to machine is
caught by the primitive probe (primitive_probe.py): the recorded file lists every rounding
primitive the reference called with its bits; when a check mismatches and one of those
primitives gives other bits here from the same inputs, the file does not apply to this
machine (a skip naming the op and the record command); when all agree, the mismatch is a
drift and fails with its location. One file holds several models, keyed by the weights'
sha256 (or the preset name and seed), because retraining the embedded model is a
deliberate change that needs a new record, not a drift.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from k3verify import REPO_ROOT
from k3verify.capture.capture import Capture
from k3verify.compare import primitive_probe
from k3verify.compare.captures import EXACT_CHECKS, compare_captures
from k3verify.errors import UsageError
from k3verify.io import atomic_write_json, read_json
from k3verify.report.environment import model_fingerprint
from k3verify.run.sequential import run_scenario
from k3verify.scenarios import workloads
from optimized_stack.numerics import mkl_state

GOLDEN_FORMAT = "k3verify.golden"
GOLDEN_VERSION = 2          # v2 adds the primitive probe and the machine; v1 files still load
GOLDEN_DIR = REPO_ROOT / "golden" / "hashes"
# (scenario, scale): one short request, and one 383-token prompt that crosses several
# KDA chunks, MLA blocks and AttnRes blocks; together ~10 s of reference compute on 2 cores.
GOLDEN_SCENARIOS: tuple[tuple[str, float], ...] = (("single", 1.0), ("long_prompt", 0.25))


def numerics_environment(model) -> dict[str, Any]:
    """What decides the reference path's bits: torch build, SIMD level, device, dtype, threads,
    and the BLAS code branch (a pinned MKL branch, or MKL's own per-processor dispatch)."""
    p = next(model.parameters())
    device = p.device.type
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "device": device if device != "cuda" else f"cuda:{torch.cuda.get_device_name(p.device)}",
        "dtype": str(p.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "blas": mkl_state()["blas"] if device == "cpu" else "cublas",
    }


def env_key(env: dict[str, Any]) -> str:
    """'torch2.13.0_cpu-cpu-avx512-float32-t2-mkl-compatible': safe as a file name, readable in a listing."""
    raw = f"torch{env['torch']}-{env['device']}-{env['cpu_capability']}-{env['dtype']}-t{env['threads']}"
    if env.get("blas"):
        raw += f"-{env['blas']}"
    return re.sub(r"[^a-z0-9.-]+", "_", raw.lower())


def machine() -> dict[str, Any]:
    """The recording machine, for the reason a skip gives: CPU, MKL's dispatch, library versions."""
    from k3verify.report.environment import numerics_libraries
    return numerics_libraries()


def model_id(model) -> str:
    fp = model_fingerprint(model)
    return f"sha256:{fp['sha256']}" if fp.get("sha256") else str(fp.get("source") or "unknown")


def _prompt_digest(scenario) -> str:
    h = hashlib.sha256()
    for r in scenario.requests:
        h.update(f"{r.request_id}:{r.max_new_tokens}:{','.join(map(str, r.prompt_ids))};".encode())
    return h.hexdigest()


def _vocab(model) -> int:
    return min(256, model.config.vocab_size)


def capture_reference(model, scenarios: tuple[tuple[str, float], ...] | None = None
                      ) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """({scenario: {"scale", "prompts_sha256", "capture"}}, the primitives the reference called).

    The captures are taken under the primitive recorder; `check` re-runs without it, so a
    record followed by a check also proves the recorder leaves the bits alone."""
    def run() -> dict[str, dict[str, Any]]:
        out = {}
        for name, scale in scenarios or GOLDEN_SCENARIOS:
            sc = workloads.build(name, scale=scale, vocab=_vocab(model))
            out[name] = {"scale": scale, "prompts_sha256": _prompt_digest(sc),
                         "capture": run_scenario(model, sc, ()).to_json()}
        return out
    return primitive_probe.record(run)


def golden_path(model, directory: Path = GOLDEN_DIR) -> Path:
    return Path(directory) / f"{env_key(numerics_environment(model))}.json"


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=GOLDEN_DIR.parent.parent, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def record(model, reason: str, directory: Path = GOLDEN_DIR) -> Path:
    """Write (or replace) this model's entry in this environment's golden file."""
    if not reason or not reason.strip():
        raise UsageError("golden record needs a reason (--reason TEXT): why the reference hashes change")
    path = golden_path(model, directory)
    env = numerics_environment(model)
    data = _read(path) if path.is_file() else {"format": GOLDEN_FORMAT, "version": GOLDEN_VERSION,
                                               "env_key": env_key(env), "environment": env, "models": {}}
    scenarios, primitives = capture_reference(model)
    data.update(version=GOLDEN_VERSION)
    data["models"][model_id(model)] = {
        "source": model_fingerprint(model).get("source"),
        "recorded": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(), "reason": reason.strip(), "machine": machine(),
        "scenarios": scenarios, "primitives": primitives}
    atomic_write_json(path, data, indent=1)
    os.chmod(path, 0o644)                    # committed to the repository: readable like any source file
    return path


def _read(path: Path) -> dict[str, Any]:
    """The golden file, its structure checked: every problem is one UsageError line."""
    try:
        data = read_json(path)                   # bounded: ReadError names the file and the problem
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable golden hash file ({exc})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a JSON object ({GOLDEN_FORMAT}), got a JSON {type(data).__name__}")
    if data.get("format") != GOLDEN_FORMAT or data.get("version") not in (1, GOLDEN_VERSION):
        raise UsageError(f"{path}: expected format {GOLDEN_FORMAT} v1 or v{GOLDEN_VERSION}, "
                         f"got {data.get('format')!r} v{data.get('version')!r}")
    models = data.get("models")
    if not isinstance(models, dict) or not all(isinstance(m, dict) and isinstance(m.get("scenarios"), dict)
                                               for m in models.values()):
        raise UsageError(f"{path}: expected 'models' to map model ids to entries with 'scenarios'")
    return data


@dataclass
class ScenarioVerdict:
    scenario: str
    status: str                         # pass / fail / skip / not_exercised (0 hashes compared)
    reason: str
    first_divergence: dict | None = None
    divergences: list[dict] = field(default_factory=list)     # the first one per failing check


@dataclass
class GoldenCheck:
    status: str                         # pass / fail / skip (no golden file or model entry here) /
    #                                     not_exercised (an entry without scenarios: nothing compared)
    reason: str
    env_key: str
    path: str
    model_id: str
    scenarios: list[ScenarioVerdict] = field(default_factory=list)
    primitive: dict | None = None       # the machine difference a skip is attributed to


def location(first: dict) -> str:
    """'scenario single, request r0, position 3 (step -96), tensor logits' from a first-divergence dict."""
    keys = ("scenario", "request", "position", "num_tokens", "step", "tensor", "layer")
    # a prompt position has a negative generated-step index; the position says it already
    return ", ".join(f"{k} {first[k]}" for k in keys
                     if first.get(k) is not None and not (k == "step" and first[k] < 0))


def check_dir(directory: Path, what: str = "--dir") -> None:
    """A golden directory that does not exist is a typo, not an environment without hashes: refused."""
    if not Path(directory).is_dir():
        raise UsageError(f"{what} {directory}: no such directory (expected a golden hash directory such as "
                         f"{GOLDEN_DIR.relative_to(GOLDEN_DIR.parents[1])})")


def check(model, directory: Path = GOLDEN_DIR) -> GoldenCheck:
    check_dir(directory)
    env = numerics_environment(model)
    key, path, mid = env_key(env), golden_path(model, directory), model_id(model)
    base = dict(env_key=key, path=str(path), model_id=mid)
    if not path.is_file():
        known = sorted(p.stem for p in Path(directory).glob("*.json"))
        return GoldenCheck("skip", f"no golden hashes for numerics environment {key} (have: {', '.join(known) or 'none'}); "
                                   f"bits legitimately differ across environments: record them here with "
                                   f"`k3verify golden record --reason ...`", **base)
    entry = _read(path)["models"].get(mid)
    if entry is None:
        return GoldenCheck("skip", f"no golden hashes for model {mid[:23]} in {path.name}; "
                                   f"after a deliberate model change run `k3verify golden record --reason ...`", **base)
    if not entry["scenarios"]:
        # an entry with nothing in it compares nothing: not a pass (summarize: nothing_verified)
        return GoldenCheck("not_exercised", f"golden entry for model {mid[:23]} in {path.name} holds no scenarios: "
                                            f"nothing compared; re-record it with `k3verify golden record --reason ...`",
                           **base)
    verdicts = []
    for name, rec in entry["scenarios"].items():
        if not isinstance(rec, dict) or not {"scale", "prompts_sha256", "capture"} <= set(rec):
            raise UsageError(f"{path}: scenario {name!r} of {mid[:23]} lacks scale/prompts_sha256/capture")
        sc = workloads.build(name, scale=rec["scale"], vocab=_vocab(model))
        if _prompt_digest(sc) != rec["prompts_sha256"]:
            verdicts.append(ScenarioVerdict(name, "fail", f"scenario {name!r} no longer builds the recorded prompts "
                                            f"(workloads changed): re-record with a reason"))
            continue
        now = run_scenario(model, sc, ())
        try:
            recorded = Capture.from_json(rec["capture"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UsageError(f"{path}: scenario {name!r}: not a readable capture ({exc})") from None
        cmp = compare_captures(recorded, now, name)
        failing = [c for c in EXACT_CHECKS if not cmp[c]["equal"]]
        if not failing:
            n = sum(cmp[c]["compared"] for c in EXACT_CHECKS)
            if not n:
                verdicts.append(ScenarioVerdict(name, "not_exercised", f"scenario {name!r}: 0 hashes compared "
                                                f"(the recorded capture is empty): nothing verified"))
                continue
            verdicts.append(ScenarioVerdict(name, "pass", f"reference bit-identical to golden ({n} hashes compared)"))
            continue
        firsts = [{"check": c, **cmp[c]["first"]} for c in failing]
        primary = next((f for f in firsts if f["check"] == "logits"), firsts[0])
        verdicts.append(ScenarioVerdict(
            name, "fail", f"reference drifted from golden at {location(primary)} ({cmp[primary['check']]['reason']}); "
                          f"failing: {', '.join(failing)}", primary, firsts))
    status = ("fail" if any(v.status == "fail" for v in verdicts) else
              "pass" if any(v.status == "pass" for v in verdicts) else "not_exercised")
    reason = ("reference path bit-identical to the golden hashes" if status == "pass" else
              "; ".join(v.reason for v in verdicts if v.status == status))
    if status == "fail":
        return _attribute(GoldenCheck(status, reason, scenarios=verdicts, **base), entry)
    return GoldenCheck(status, reason, scenarios=verdicts, **base)


def _attribute(gc: GoldenCheck, entry: dict[str, Any]) -> GoldenCheck:
    """A mismatch: another machine's numerics (skip, naming the primitive) or a drift (fail)."""
    primitives = entry.get("primitives")
    if not primitives:
        gc.reason += " (this golden file predates the primitive probe: machine and drift cannot be told apart)"
        return gc
    differing, count = primitive_probe.first_difference(primitives)
    if differing is None:
        gc.reason += (f"; all {len(primitives)} rounding primitives the recorded reference called give the "
                      f"recorded bits here, so the code or the model changed, not the machine")
        return gc
    rec_cpu = (entry.get("machine") or {}).get("cpu_model") or "unknown CPU"
    here = machine()
    reason = (f"the golden hashes do not apply to this machine: {count} of {len(primitives)} rounding primitives "
              f"give other bits here from the same inputs, first {primitive_probe.describe(differing)} "
              f"(recorded on {rec_cpu}, MKL {(entry.get('machine') or {}).get('mkl_cnr_branch')}; this is "
              f"{here.get('cpu_model')}, MKL {here.get('mkl_cnr_branch')}); record this machine's with "
              f"`k3verify golden record --reason ...` (drift is then checked against them)")
    for v in gc.scenarios:
        if v.status == "fail":
            v.status, v.reason = "skip", f"{v.reason}; {reason}"
    return GoldenCheck("skip", reason, gc.env_key, gc.path, gc.model_id, gc.scenarios,
                       primitive={"op": differing["op"], "describe": primitive_probe.describe(differing),
                                  "differing": count, "recorded": len(primitives)})
