"""`k3verify diff --base REV`: what this patch changes, bit for bit, against the branch it goes into.

    REV (default: the merge base with main)      the working tree (uncommitted changes included)
      `git worktree add --detach` in a temp dir     the checkout itself
      driver.py, REV on PYTHONPATH            driver.py, the tree on PYTHONPATH
                \\ the same units: (reference | toggle, scenario), capture on, tensors kept /
                                compare.py: per tensor kind, changed or not
                     the working tree's contracts for what moved; the golden rule
                                report.{json,md,html}, junit.xml, summary.md

Each side runs in its own Python process (this interpreter, so the same venv's packages)
with only its tree on PYTHONPATH, through k3verify/driver.py and the narrow API both
trees share. REV's worktree is always removed again; the user's checkout is only read.
Approx toggles are teacher-forced on their side's own reference tokens (as the gate does),
so a kernel that moves one logit still compares on every position.

REV's captures are cached under <checkout>/reports/.cache/patch-diff/<rev sha>-<model
sha256>-<numerics env key>/, one entry per unit with the sha256 of its files, so a second
run only runs the working tree's side; an entry whose files or tensor hashes do not check
out is recomputed, never trusted.
"""
from __future__ import annotations

import contextlib
import difflib
import hashlib
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..capture.capture import Capture
from ..errors import UsageError
from .cache import BadUnit, CaptureCache, load_unit, sha256_file
from .compare import REFERENCE, UnitDiff, contracts_needed, diff_captures, golden_verdict, judge
from .tree import (MERGE_BASE, TreeWorker, checkout_root, git, git_blob, resolve_base, rev_worktree,
                         sigterm_unwinds)

__all__ = ["MERGE_BASE", "Options", "checkout_root", "resolve_base", "run"]
DEFAULT_MODEL_PATH = "golden/k3-mini/model.safetensors"
REFERENCE_SCENARIOS = ("single", "long_prompt")       # golden_hashes.GOLDEN_SCENARIOS' names


# ---- the plan ---------------------------------------------------------------------------

@dataclass
class Options:
    repo: str | None = None
    base: str = MERGE_BASE
    toggles: list[str] | None = None
    scenarios: list[str] | None = None
    scale: float = 1.0
    seed: int = 0
    model: str | None = None
    device: str = "cpu"
    # replay a failing contract to its first divergent sublayer (gate.check_toggle); off by default:
    # the diff already names the first divergence, and `k3verify diff --toggle T` localises it
    localize: bool = False
    progress: Callable[[str], None] = field(default=lambda msg: None)


def _hint(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _runs_here(t: dict, device: str) -> str | None:
    if device not in t["devices"]:
        return f"toggle runs on {', '.join(t['devices'])}, not {device}"
    if 1 not in t["world_sizes"]:
        return f"toggle runs at world size {', '.join(map(str, t['world_sizes']))}, not 1"
    return None


def _scenarios_for(t: dict, names: list[str] | None, scen: dict[str, dict]) -> list[str]:
    """--scenario, or `single` plus the first scenario tagged for the toggle (what exercises it);
    only those it applies to (scenario_tags)."""
    if names:
        chosen = list(names)
    else:
        chosen = ["single"] if "single" in scen else list(scen)[:1]
        tags = set(t["scenario_tags"]) | set(t["exercised_by"])
        chosen += [n for n, s in scen.items() if set(s["tags"]) & tags][:1]
    if t["scenario_tags"]:
        chosen = [n for n in chosen if set(scen[n]["tags"]) & set(t["scenario_tags"])]
    return list(dict.fromkeys(chosen))


def make_plan(head: dict, base: dict, opts: Options, base_info: dict) -> dict:
    head_t = {t["name"]: t for t in head["toggles"]}
    base_t = {t["name"]: t for t in base["toggles"]}
    scen = head["scenarios"]
    for name in opts.scenarios or ():
        if name not in scen:
            raise UsageError(f"unknown scenario {name!r}{_hint(name, list(scen))} (known: {', '.join(scen)})")
    if opts.toggles:
        for name in opts.toggles:
            if name not in head_t:
                raise UsageError(f"unknown toggle {name!r}{_hint(name, list(head_t))}")
        names = list(dict.fromkeys(opts.toggles))
    else:
        names = [n for n, t in head_t.items() if t["kind"] == "optimization" and not _runs_here(t, opts.device)]
    force = head["capabilities"]["force"] and base["capabilities"]["force"]
    labels = []
    for name in names:
        t = head_t[name]
        lp = {"label": name, "kind": t["kind"], "contract": t["contract"], "contract_kind": t["contract_kind"],
              "scenarios": _scenarios_for(t, opts.scenarios, scen),
              "forced": force and t["contract_kind"] == "approx"}    # teacher-forced on its side's reference
        skip = _runs_here(t, opts.device)
        if skip:
            lp.update(status="skip", reason=skip, scenarios=[])
        elif not lp["scenarios"]:
            lp.update(status="skip", reason=f"applies only to scenarios tagged {', '.join(t['scenario_tags'])}")
        elif name not in base_t:
            lp.update(status="added", reason=f"new in this patch: REV {base_info['short']} has no toggle {name} to "
                                             f"compare with; judged by its contract on the working tree")
        else:
            lp.update(status="compare", reason="")
        labels.append(lp)
    if not opts.toggles:
        for name, t in base_t.items():
            if t["kind"] == "optimization" and name not in head_t and not _runs_here(t, opts.device):
                labels.append({"label": name, "kind": t["kind"], "contract": t["contract"],
                               "contract_kind": t["contract_kind"], "scenarios": [], "forced": False,
                               "status": "removed",
                               "reason": f"removed by this patch: REV {base_info['short']} has it, the working "
                                         f"tree does not"})
    # The reference is compared on the golden scenarios (or --scenario) and wherever an approx
    # toggle is teacher-forced; a toggle's own diff needs no reference, and an exact contract
    # computes its reference on the working tree when it runs.
    wanted = set(opts.scenarios or REFERENCE_SCENARIOS)
    wanted |= {s for lp in labels if lp["status"] == "compare" and lp["forced"] for s in lp["scenarios"]}
    ref_scen = [n for n in scen if n in wanted] or list(scen)[:1]
    labels.insert(0, {"label": REFERENCE, "contract": "exact", "contract_kind": "exact", "scenarios": ref_scen,
                      "forced": False, "status": "compare", "reason": ""})
    return {"base": base_info, "labels": labels, "scale": float(opts.scale), "seed": opts.seed, "forced": force}


def unit_id(label: str, scenario: str, plan: dict, forced: bool) -> str:
    name = "reference" if label == REFERENCE else label
    return f"{name}__{scenario}__x{plan['scale']:g}__s{plan['seed']}" + ("__forced" if forced else "")


def _units(plan: dict) -> tuple[list[dict], list[dict]]:
    """(reference units, toggle units) of the plan: every (label, scenario) compared."""
    refs, toggles = [], []
    for lp in plan["labels"]:
        if lp["status"] != "compare":
            continue
        for s in lp["scenarios"]:
            u = {"id": unit_id(lp["label"], s, plan, lp["forced"]), "label": lp["label"], "scenario": s,
                 "toggles": [] if lp["label"] == REFERENCE else [lp["label"]], "scale": plan["scale"],
                 "seed": plan["seed"], "forced": lp["forced"]}
            (refs if lp["label"] == REFERENCE else toggles).append(u)
    return refs, toggles


def _force_tokens(unit: dict, results: dict[str, tuple], plan: dict) -> dict | None:
    """An approx toggle's unit is fed its own side's reference tokens (as the gate does)."""
    if not unit["forced"]:
        return None
    cap = results.get(unit_id(REFERENCE, unit["scenario"], plan, False), (None, {}))[0]
    return None if cap is None else {rid: rc.tokens for rid, rc in cap.requests.items()}


def capture_side(worker_for: Callable[[], TreeWorker], plan: dict, out: Path,
                 cache: CaptureCache | None = None) -> dict[str, tuple[Capture | None, dict]]:
    """Every unit of the plan on one side: from the cache when it checks out, else run (and stored)."""
    refs, toggles = _units(plan)
    results: dict[str, tuple[Capture | None, dict]] = {}
    for batch in (refs, toggles):
        todo = []
        for u in batch:
            hit = cache.load(u["id"]) if cache else None
            if hit:
                results[u["id"]] = hit
            else:
                todo.append(u)
        if not todo:
            continue
        for u in list(todo):
            u["force"] = _force_tokens(u, results, plan)
            if u["forced"] and u["force"] is None:     # nothing to teacher-force it on
                results[u["id"]] = (None, {"error": f"the reference run of {u['scenario']} failed on this side"})
                todo.remove(u)
        if not todo:
            continue
        def landed(uid: str) -> None:        # cached as it lands: an interrupted run keeps what it did
            try:
                results[uid] = load_unit(out, uid)
            except BadUnit as exc:
                raise UsageError(f"captures of {uid} do not read back ({exc})") from None
            if cache and results[uid][0] is not None:
                cache.store(out, uid)
        worker_for().request("capture", on_unit=landed, out=str(out), units=todo)
        missing = [u["id"] for u in todo if u["id"] not in results]
        if missing:
            raise UsageError(f"the worker answered without capturing {missing[0]}")
    return results


# ---- the run ----------------------------------------------------------------------------

def _model_key(root: Path, sha: str, model: str | None) -> tuple[str, str | None]:
    """(cache key part, the resolved --model to hand both sides)."""
    if model is None:
        blob = git_blob(root, sha, DEFAULT_MODEL_PATH)
        return (hashlib.sha256(blob).hexdigest()[:16] if blob else "default"), None
    path = Path(model)
    if path.is_dir():
        weights = path / "model.safetensors"
        raw = sha256_file(weights) if weights.is_file() else hashlib.sha256(str(path.resolve()).encode()).hexdigest()
        return raw[:16], str(path.resolve())
    return "preset-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in model), model


def run(opts: Options) -> dict[str, Any]:
    """Both sides, the comparison and the rules -> {"rows", "summary", "plan", "meta"}."""
    with sigterm_unwinds():
        return _run(opts)


def _run(opts: Options) -> dict[str, Any]:
    t_start = time.perf_counter()
    root = checkout_root(opts.repo)
    base_info = resolve_base(root, opts.base)
    model_key, model_arg = _model_key(root, base_info["sha"], opts.model)
    scratch = Path(tempfile.mkdtemp(prefix="k3verify-patch-diff-"))
    head: TreeWorker | None = None
    base: TreeWorker | None = None
    timings: dict[str, float] = {}
    try:
        head = TreeWorker(root, "working tree", model_arg, opts.device, scratch / "head.log", opts.progress)
        head_desc = head.request("describe", scale=opts.scale, seed=opts.seed)
        key = f"{base_info['sha']}-{model_key}-{head_desc.get('env_key') or 'unknown-env'}"
        cache = CaptureCache(root / "reports" / ".cache" / "patch-diff" / key)
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            def base_worker() -> TreeWorker:
                nonlocal base
                if base is None:
                    opts.progress(f"REV {base_info['short']}: git worktree add --detach")
                    tree = stack.enter_context(rev_worktree(root, base_info["sha"], scratch))
                    base = TreeWorker(tree, f"REV {base_info['short']}", model_arg, opts.device,
                                      scratch / "base.log", opts.progress)
                    stack.callback(base.close)
                return base
            base_desc = cache.describe()
            if base_desc is None:
                base_desc = base_worker().request("describe", scale=opts.scale, seed=opts.seed)
                cache.put_describe(base_desc)
            plan = make_plan(head_desc, base_desc, opts, base_info)
            base_units = capture_side(base_worker, plan, scratch / "base", cache)
            base_ran = base is not None
        timings["base_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        head_units = capture_side(lambda: head, plan, scratch / "head")
        timings["head_s"] = time.perf_counter() - t0
        diffs = _diffs(plan, base_units, head_units)
        t0 = time.perf_counter()
        needed = contracts_needed(plan, diffs)
        ref_changed = any(d.changed for (label, _), d in diffs.items() if label == REFERENCE)
        contracts: dict[tuple[str, str], list[dict]] = {}
        golden_check = None
        golden_texts = _golden_texts(root, base_info["sha"], head_desc.get("env_key")) if ref_changed else (None, None)
        # `golden check` only proves something when the patch re-recorded the file
        run_golden = ref_changed and golden_texts[1] is not None and golden_texts[0] != golden_texts[1]
        if needed or run_golden:
            caps = head_desc["capabilities"]
            if needed and not caps["contract"]:
                raise UsageError("the working tree lacks check_toggle and its run cache (verdict/gate.py, run/runner.py): cannot judge "
                                 "the contracts of what moved")
            answer = head.request("contract", checks=needed, scale=plan["scale"], seed=plan["seed"],
                                  golden=run_golden and caps["golden"], localize=opts.localize)
            for r in answer["rows"]:
                contracts.setdefault((r["toggle"], r["scenario"]), []).append(r)
            golden_check = answer.get("golden")
        timings["contracts_s"] = time.perf_counter() - t0
    finally:
        if head is not None:
            head.close()
        shutil.rmtree(scratch, ignore_errors=True)
    golden = {"allowed": True, "why": "the reference did not change", "evidence": {}}
    if ref_changed:
        golden = golden_verdict(*golden_texts, head_desc["model_id"], head_desc.get("env_key"), golden_check)
    rows, summary = judge(plan, diffs, contracts, golden)
    timings["total_s"] = time.perf_counter() - t_start
    head_git = {"commit": _try_git(root, "rev-parse", "HEAD"),
                "dirty": bool(_try_git(root, "status", "--porcelain"))}   # untracked modules are on PYTHONPATH too
    meta = {"root": str(root), "base": base_info, "head": head_git, "env_key": head_desc.get("env_key"),
            "env": head_desc.get("env"), "model": head_desc.get("model"), "model_id": head_desc.get("model_id"),
            "base_model_id": base_desc.get("model_id"), "base_env_key": base_desc.get("env_key"),
            "cache": {"dir": str(cache.dir), "hits": len(cache.hits), "recomputed": cache.recomputed,
                      "computed": 0 if not base_ran else len(base_units) - len(cache.hits)},
            "timings": timings}
    if meta["base_model_id"] != meta["model_id"]:
        summary["line"] += f"; the model changed ({str(meta['base_model_id'])[:19]} -> {str(meta['model_id'])[:19]})"
    if meta["base_env_key"] != meta["env_key"]:
        summary["line"] += f"; numerics environment REV {meta['base_env_key']} vs working tree {meta['env_key']}"
    return {"rows": rows, "summary": summary, "plan": plan, "meta": meta}


def _golden_texts(root: Path, sha: str, env_key: str | None) -> tuple[str | None, str | None]:
    """This numerics environment's golden file in REV and in the working tree (None: absent)."""
    if not env_key:
        return None, None
    rel = f"golden/hashes/{env_key}.json"
    blob = git_blob(root, sha, rel)
    head_file = root / rel
    return (None if blob is None else blob.decode("utf-8", "replace"),
            head_file.read_text(encoding="utf-8") if head_file.is_file() else None)


def _try_git(root: Path, *args: str) -> str | None:
    try:
        return git(root, *args)
    except UsageError:
        return None


def _diffs(plan: dict, base_units: dict, head_units: dict) -> dict[tuple[str, str], UnitDiff]:
    out = {}
    refs, toggles = _units(plan)
    for u in refs + toggles:
        d = UnitDiff(u["label"], u["scenario"])
        (bcap, brec), (hcap, hrec) = base_units[u["id"]], head_units[u["id"]]
        if hcap is None:
            d.error, d.traceback = hrec.get("error", "no capture"), hrec.get("traceback")
        elif bcap is None:
            d.not_compared = f"REV could not run it: {brec.get('error')}"
        elif brec["prompts_sha256"] != hrec["prompts_sha256"]:
            d.not_compared = (f"scenario changed: REV and the working tree build other requests for {u['scenario']} "
                              f"(prompts sha256 {brec['prompts_sha256'][:12]} vs {hrec['prompts_sha256'][:12]}); "
                              f"nothing to compare")
        else:
            d.kinds, d.prompts_sha256 = diff_captures(bcap, hcap, u["scenario"]), hrec["prompts_sha256"]
        out[(u["label"], u["scenario"])] = d
    return out
