"""`k3verify diff --base REV` (issue 21) on revisions made in a temporary git repo.

The repo holds a copy of this project's tracked engine and verifier files; each test edits
its working tree (the patch) and diffs it against `main` (REV), then resets. Every rule has
its negative control: a changed reduction order in the reference fails with its location
until the golden hashes are re-recorded with a reason; an exact toggle broken by a patch
fails; an approx kernel change passes within budget and fails over it; a pure refactor is
unchanged. Tiny on purpose: scenario `single` at scale 0.25, two cheap toggles, REV's side
cached after the first run.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3verify import cli
from k3verify.patch.compare import REFERENCE
from k3verify.patch.cache import CaptureCache

SRC = Path(__file__).resolve().parents[1]
COPIED = ("optimized_stack/", "k3verify/", "golden/k3-mini/", "golden/hashes/", "checks/", "pyproject.toml",
          ".gitignore")
# one exact runner toggle and one approx kernel: both cheap; each test names the ones it needs
EXACT, APPROX = "state_offload_roundtrip", "mla_absorbed"
ARGS = ("--scenario", "single", "--scale", "0.25")
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


def git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV})
    assert done.returncode == 0, f"git {' '.join(args)}: {done.stderr}"
    return done.stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed: `diff --base` compares git revisions")
    try:
        tracked = git(SRC, "ls-files").splitlines()
    except AssertionError:
        pytest.skip(f"{SRC} is not a git checkout: the test copies its tracked files")
    root = tmp_path_factory.mktemp("patch-diff") / "repo"
    for rel in tracked:
        if rel.startswith(COPIED) and (SRC / rel).is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(SRC / rel, root / rel)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "base")
    return root


@pytest.fixture
def patched(repo):
    """The repo at main with a clean working tree; reset again afterwards."""
    git(repo, "reset", "-q", "--hard", "main")
    git(repo, "clean", "-qfd", "--exclude=reports/")
    yield repo
    git(repo, "reset", "-q", "--hard", "main")
    git(repo, "clean", "-qfd", "--exclude=reports/")


def edit(root: Path, rel: str, old: str, new: str) -> None:
    path = root / rel
    text = path.read_text()
    assert text.count(old) >= 1, f"{rel} no longer contains the text this test patches: {old!r}"
    path.write_text(text.replace(old, new))


def diff(capsys, root: Path, out: Path, *toggles: str, base: tuple[str, ...] = ("--base", "main")
         ) -> tuple[int, dict, str]:
    names = [w for t in toggles for w in ("--toggle", t)]
    code = cli.main(["diff", *base, "--repo", str(root), *ARGS, *names, "--report-dir", str(out)])
    captured = capsys.readouterr()
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
    return code, report, captured.out + captured.err


def rows(report: dict, label: str, check: str | None = None) -> list[dict]:
    return [r for r in report["results"] if r["toggle"] == label and (check is None or r["check"] == check)]


REORDER_OLD = """        out = p[0] * vals[0]
        for i in range(1, vals.shape[0]):                                   # fixed order
            out = out + p[i] * vals[i]"""
REORDER_NEW = """        out = p[-1] * vals[-1]
        for i in range(vals.shape[0] - 2, -1, -1):                          # newest first
            out = out + p[i] * vals[i]"""


def test_pure_refactor_is_unchanged_and_a_second_run_takes_rev_from_the_cache(patched, tmp_path, capsys):
    edit(patched, "optimized_stack/model/ops.py", "_pointwise", "_simd_pointwise")   # a rename, nothing numeric
    before = git(patched, "worktree", "list")
    for run in ("first", "second"):
        code, report, out = diff(capsys, patched, tmp_path / run, EXACT, APPROX)
        assert code == 0, out
        line = report["patch_diff"]["summary"]["line"]
        assert line.startswith("this patch changes no bits: the reference and 2 toggles are bit-identical"), line
        changed = [r for r in report["results"] if r["evidence"].get("change") != "unchanged"]
        assert not changed, f"a rename moved bits: {changed[0]['reason']}"
        assert git(patched, "worktree", "list") == before, "REV's temporary worktree was left behind"
        assert git(patched, "status", "--porcelain") == "M optimized_stack/model/ops.py", "the checkout was touched"
    c = report["patch_diff"]["cache"]
    assert c["computed"] == 0 and c["hits"] == 3 and not c["recomputed"], f"REV's side ran again: {c}"
    summary_md = (tmp_path / "second" / "summary.md").read_text()
    assert line in summary_md and len(summary_md.splitlines()) < 40, "summary.md: the line, short enough for a comment"
    assert "3 units from the cache" in summary_md


@pytest.fixture(scope="module")
def cached_entry(tmp_path_factory) -> tuple[Path, str]:
    """One reference unit written as the driver writes it and stored as the cache stores it (in-process)."""
    from k3verify.scenarios import workloads
    from k3verify.patch.driver import write_unit
    from k3verify.run.sequential import run_scenario
    from optimized_stack import load_model

    scratch, cache_dir = tmp_path_factory.mktemp("unit"), tmp_path_factory.mktemp("cache")
    sc = workloads.build("single", scale=0.25)
    uid = "reference__single__x0.25__s0"
    write_unit(scratch, uid, {"id": uid}, sc, run_scenario(load_model(), sc, (), keep=True), 0.0)
    CaptureCache(cache_dir).store(scratch, uid)
    return cache_dir, uid


def _damage_tensor_hash(copy: Path, uid: str) -> None:
    """Files that match their meta, but a capture hash that no longer matches its kept tensor."""
    rec = json.loads((copy / f"{uid}.json").read_text())
    first = next(iter(rec["capture"]["requests"].values()))
    pos = next(iter(first["logits"]))
    first["logits"][pos] = first["logits"][pos][:-4] + "0000"
    (copy / f"{uid}.json").write_text(json.dumps(rec))
    meta = json.loads((copy / f"{uid}.meta.json").read_text())
    meta["json"] = hashlib.sha256((copy / f"{uid}.json").read_bytes()).hexdigest()
    (copy / f"{uid}.meta.json").write_text(json.dumps(meta))


DAMAGE = {
    "truncated-json": lambda d, u: (d / f"{u}.json").write_bytes((d / f"{u}.json").read_bytes()[:-2]),
    "zeroed-tensor-bytes": lambda d, u: (d / f"{u}.safetensors").write_bytes(
        (d / f"{u}.safetensors").read_bytes()[:-8] + b"\0" * 8),
    "missing-tensors": lambda d, u: (d / f"{u}.safetensors").unlink(),
    "bad-meta": lambda d, u: (d / f"{u}.meta.json").write_text("{"),
    "hash-mismatch": _damage_tensor_hash,
}


def test_cache_entry_loads_when_intact(cached_entry):
    cache_dir, uid = cached_entry
    cache = CaptureCache(cache_dir)
    hit = cache.load(uid)
    assert hit is not None and cache.hits == [uid] and not cache.recomputed
    cap, _ = hit
    assert all(it.tensor is not None for rc in cap.requests.values() for it in rc.logits.values())


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_corrupt_cache_entry_is_recomputed_not_trusted(cached_entry, tmp_path, damage):
    cache_dir, uid = cached_entry
    copy = tmp_path / "copy"
    shutil.copytree(cache_dir, copy)
    DAMAGE[damage](copy, uid)
    cache = CaptureCache(copy)
    assert cache.load(uid) is None, f"a cache entry with {damage} was trusted"
    assert cache.recomputed == [uid] and not cache.hits


def test_reduction_order_change_fails_with_location(patched, tmp_path, capsys):
    """Negative control of the golden rule: one op summed in another order moves the reference's bits."""
    edit(patched, "optimized_stack/model/attn_res.py", REORDER_OLD, REORDER_NEW)
    code, report, out = diff(capsys, patched, tmp_path / "r", EXACT)
    assert code == 1, out
    summary = report["patch_diff"]["summary"]
    assert summary["reference_changed"] and "WITHOUT a golden update" in summary["line"], summary["line"]
    (logits,) = rows(report, REFERENCE, "base_diff.logits")
    assert logits["status"] == "fail" and logits["evidence"]["change"] == "changed"
    first = logits["first_divergence"]
    assert first["scenario"] == "single" and first["request"] == "r0" and isinstance(first["position"], int)
    (f,) = logits["findings"]
    assert f["max_ulp"] >= 1 and sum(n for label, n in f["ulp_histogram"] if label != "0") == f["n_bit_different"]
    assert "kl_max" in f and "argmax_flips" in f
    (golden,) = rows(report, REFERENCE, "base_diff.golden")
    assert golden["status"] == "fail" and "golden" in golden["reason"]
    # the exact toggle moved with the reference and still equals it: its contract ran and held
    contract = rows(report, "state_offload_roundtrip")
    assert any(r["check"].startswith("contract.") for r in contract)
    assert all(r["status"] == "pass" for r in contract), [r["reason"] for r in contract if r["status"] != "pass"]
    assert "state_offload_roundtrip (still exact)" in summary["line"], summary["line"]


def test_reduction_order_change_with_golden_rerecorded_passes(patched, tmp_path, capsys):
    edit(patched, "optimized_stack/model/attn_res.py", REORDER_OLD, REORDER_NEW)
    reason = "AttnRes mix sums newest snapshot first (test)"
    record = ("from k3verify.compare import golden as gh; from optimized_stack import load_model; "
              "gh.GOLDEN_SCENARIOS = (('single', 0.25),); "   # the same rule on a tenth of the compute
              f"gh.record(load_model(), {reason!r})")
    subprocess.run([sys.executable, "-P", "-c", record], cwd=patched, check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(patched)})
    code, report, out = diff(capsys, patched, tmp_path / "r", EXACT)
    assert code == 0, out
    line = report["patch_diff"]["summary"]["line"]
    assert "changes the reference: yes" in line and "re-recorded" in line and reason in line, line
    (golden,) = rows(report, REFERENCE, "base_diff.golden")
    assert golden["status"] == "pass" and golden["evidence"]["golden_check"]["status"] == "pass", golden


def test_approx_kernel_change_within_budget_passes_and_over_budget_fails(patched, tmp_path, capsys):
    rel = "optimized_stack/kernels/mla/absorbed.py"
    old = """    scores = (torch.einsum("thl,sl->ths", q_lat, lat)
              + torch.einsum("thr,sr->ths", q[..., n:], k_rope)) * (cfg.qk_head_dim ** -0.5 * _scale_mult)"""
    scale = "(cfg.qk_head_dim ** -0.5 * _scale_mult)"
    new = (f"""    scores = (torch.einsum("thl,sl->ths", q_lat, lat) * {scale}\n"""
           f"""              + torch.einsum("thr,sr->ths", q[..., n:], k_rope) * {scale})""")
    edit(patched, rel, old, new)            # the scale distributed over the two terms: rounding only
    code, report, out = diff(capsys, patched, tmp_path / "within", APPROX)
    assert code == 0, out
    line = report["patch_diff"]["summary"]["line"]
    assert "changes the reference: no" in line and "mla_absorbed (within budget)" in line, line
    moved = [r for r in rows(report, "mla_absorbed") if r["evidence"].get("change") == "changed"]
    assert moved and all(r["status"] == "pass" for r in moved)
    assert moved[0]["findings"][0]["max_ulp"] >= 1, "the report shows how far it moved against REV"
    assert all(r["evidence"]["change"] == "unchanged" for r in rows(report, REFERENCE))

    # negative control: the same kernel with a wrong softmax scale moves far outside the budget
    edit(patched, rel, "_scale_mult: float = 1.0", "_scale_mult: float = 1.5")
    code, report, out = diff(capsys, patched, tmp_path / "over", APPROX)
    assert code == 1, out
    assert "mla_absorbed (OVER BUDGET)" in report["patch_diff"]["summary"]["line"]
    drift = rows(report, "mla_absorbed", "contract.drift_budget")
    assert drift and drift[0]["status"] == "fail", drift


def test_patch_that_breaks_an_exact_toggle_fails(patched, tmp_path, capsys):
    """The state round trip drops the conv window: the toggle's bits move and it no longer equals the reference."""
    edit(patched, "k3verify/run/sequential.py", 'drop_conv = bool(opts.get("roundtrip_drops_conv"))',
         'drop_conv = bool(opts.get("state_roundtrip"))')
    code, report, out = diff(capsys, patched, tmp_path / "r", EXACT)
    assert code == 1, out
    summary = report["patch_diff"]["summary"]
    assert not summary["reference_changed"] and summary["broken_exact"] == ["state_offload_roundtrip"], summary
    assert "every exact contract still holds: NO (state_offload_roundtrip)" in summary["line"]
    failed = [r for r in rows(report, "state_offload_roundtrip") if r["status"] == "fail"]
    assert any(r["check"] == "base_diff.kda_state" for r in failed), [r["check"] for r in failed]


def test_changed_scenario_is_reported_not_compared(patched, tmp_path, capsys):
    edit(patched, "k3verify/scenarios/workloads.py", 'RequestSpec("r0", tuple(g.text(_n(100, scale))), 8)',
         'RequestSpec("r0", tuple(g.text(_n(104, scale))), 8)')
    code, report, out = diff(capsys, patched, tmp_path / "r", EXACT, base=("--base",))   # the merge base
    assert report["patch_diff"]["base"]["how"] == "merge base of HEAD with main"
    line = report["patch_diff"]["summary"]["line"]
    assert "not compared: single (scenario changed" in line, line
    assert all(r["status"] == "skip" and "scenario changed" in r["reason"] for r in report["results"])
    # nothing could be compared: not a green run (issue 29), its own verdict and exit 1
    assert report["summary"]["verdict"] == "nothing_verified" and code == 1, out


def test_bad_revision_and_missing_api_are_one_line_errors(patched, tmp_path, capsys):
    assert cli.main(["diff"]) == 2
    assert "diff needs --toggle NAME (or --base [REV]" in capsys.readouterr().err
    code = cli.main(["diff", "--base", "no-such-rev", "--repo", str(patched), *ARGS, "--toggle", EXACT])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("k3verify: error: --base 'no-such-rev': not a commit"), err

    git(patched, "checkout", "-q", "-b", "no-api")
    (patched / "k3verify" / "run" / "sequential.py").write_text('"""an old tree without the capture runner"""\n')
    git(patched, "commit", "-qam", "no runner")
    git(patched, "checkout", "-q", "main")
    before = git(patched, "worktree", "list")
    code = cli.main(["diff", "--base", "no-api", "--repo", str(patched), *ARGS, "--toggle", EXACT,
                     "--report-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "lacks the API `diff --base` needs:" in err[-1] and "run_scenario" in err[-1], err
    assert git(patched, "worktree", "list") == before, "REV's temporary worktree was left behind"
    git(patched, "branch", "-q", "-D", "no-api")


def test_all_base_adds_the_section(patched, tmp_path, capsys, monkeypatch):
    suite = tmp_path / "tiny.toml"
    suite.write_text('version = 2\ndescription = "one exact toggle, tiny"\n[[check]]\nkind = "diff"\n'
                     'toggles = ["state_offload_roundtrip"]\nscenarios = ["single"]\nscale = 0.25\n')
    monkeypatch.chdir(patched)
    code = cli.main(["all", "--suite", str(suite), "--base", "main", "--report-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "patch diff: this patch changes no bits" in out
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    section = [r for r in report["results"] if r.get("section") == "patch_diff"]
    assert section and all(r["toggle"] == "patch-diff" for r in section)
    assert {v["toggle"] for v in report["verdicts"]} == {"state_offload_roundtrip"}, "no verdict for the section"
    assert (tmp_path / "run" / "patch-diff" / "summary.md").is_file()


# ---- the pure parts: plan and golden rule (no subprocess) ---------------------------------

def _toggle(name, kind="exact", devices=("cpu", "cuda"), tags=(), exercised=()):
    return {"name": name, "kind": "optimization", "contract": kind, "contract_kind": kind, "devices": list(devices),
            "world_sizes": [1], "scenario_tags": list(tags), "exercised_by": list(exercised)}


def _describe(*toggles):
    scen = {"single": {"tags": ["basic"]}, "boundaries": {"tags": ["boundaries"]}, "eviction": {"tags": ["eviction"]}}
    return {"toggles": list(toggles), "scenarios": scen, "capabilities": {"force": True}}


def test_plan_names_added_removed_and_skipped_toggles_and_the_scenarios_that_exercise_them():
    from k3verify.patch.diff import Options, make_plan

    head = _describe(_toggle("kept", exercised=("eviction",)), _toggle("new"), _toggle("cuda_only", devices=("cuda",)),
                     _toggle("kernel", kind="approx"))
    base = _describe(_toggle("kept", exercised=("eviction",)), _toggle("gone"), _toggle("kernel", kind="approx"))
    plan = make_plan(head, base, Options(), {"short": "abc"})
    by = {lp["label"]: lp for lp in plan["labels"]}
    assert by["kept"]["status"] == "compare" and by["kept"]["scenarios"] == ["single", "eviction"]
    assert by["new"]["status"] == "added" and by["gone"]["status"] == "removed"
    assert "cuda_only" not in by, "a toggle that does not run here is not part of the default set"
    assert by["kernel"]["forced"] and not by["kept"]["forced"], "approx toggles are teacher-forced"
    assert by[REFERENCE]["scenarios"] == ["single"], "the reference: the golden scenarios and the forced ones"
    plan = make_plan(head, base, Options(toggles=["cuda_only"]), {"short": "abc"})
    assert {lp["label"]: lp["status"] for lp in plan["labels"]}["cuda_only"] == "skip"
    from k3verify.errors import UsageError
    with pytest.raises(UsageError, match="unknown toggle 'kep'; did you mean 'kept'"):
        make_plan(head, base, Options(toggles=["kep"]), {"short": "abc"})
    with pytest.raises(UsageError, match="unknown scenario 'singel'; did you mean 'single'"):
        make_plan(head, base, Options(scenarios=["singel"]), {"short": "abc"})


@pytest.mark.parametrize("case, allowed", [
    ("re-recorded", True), ("same file", False), ("no file", False), ("same reason", False),
    ("no entry for the model", False), ("empty reason", False), ("check fails", False)])
def test_golden_rule(case, allowed):
    from k3verify.patch.compare import golden_verdict

    def golden(reason, model="sha256:m", scenarios="x"):
        return json.dumps({"models": {model: {"reason": reason, "scenarios": scenarios}}})

    base, head, check = golden("old"), golden("new", scenarios="y"), {"status": "pass", "reason": "ok"}
    if case == "same file":
        head = base
    elif case == "no file":
        head = None
    elif case == "same reason":
        head = golden("old", scenarios="y")
    elif case == "no entry for the model":
        head = golden("new", model="sha256:other")
    elif case == "empty reason":
        head = golden("  ", scenarios="y")
    elif case == "check fails":
        check = {"status": "fail", "reason": "reference drifted from golden at ..."}
    v = golden_verdict(base, head, "sha256:m", "env", check)
    assert v["allowed"] is allowed, v["why"]
