"""Check kind `patch_diff` (issue 21): what the working tree changes, bit for bit, against a git
revision (k3verify/patch/): the reference and the named toggles on both trees, compared per tensor
kind, judged by the patch rules (a changed reference needs re-recorded golden hashes with a reason;
a changed exact toggle must still equal the reference; a changed approx toggle must stay in budget).
`k3verify diff --base REV` runs it alone; a suite names it as a [[check]] (or `k3verify all --base`)."""
from __future__ import annotations

from k3verify.verdict.result import Result

from .base import CheckSpec, Context, OptionError, Unit, is_number

NAME = "patch_diff"
# base: a git revision ("@merge-base": the merge base with main); toggles: None = every toggle
# that runs here at world size 1; scenarios: None = the golden scenarios and each toggle's own
OPTIONS = {"base": "@merge-base", "toggles": None, "scenarios": None, "scale": 1.0}
PATCH_S = 110.0                   # measured: 1 m 46 s for every toggle at scale 1 (cached REV: 34 s)


def validate(o: dict) -> None:
    if not isinstance(o["base"], str) or not o["base"].strip():
        raise OptionError("base", f"must be a git revision, got {o['base']!r}")
    for key in ("toggles", "scenarios"):
        v = o[key]
        if v is not None and not (isinstance(v, list) and v and all(isinstance(x, str) for x in v)):
            raise OptionError(key, f"must be a non-empty list of names, got {v!r}")
    if not is_number(o["scale"]) or not 0 < o["scale"] <= 64:
        raise OptionError("scale", f"must be a number in (0, 64], got {o['scale']!r}")


def plan(spec: CheckSpec) -> list[Unit]:
    return [Unit(spec.kind, spec.name, spec.options, check_index=spec.index)]


def cost_s(unit: Unit) -> float:
    return PATCH_S * float(unit.options["scale"])


def label(unit: Unit) -> str:
    return f"patch diff against {unit.options['base']}"


def run(unit: Unit, ctx: Context) -> list[Result]:
    from k3verify.patch.diff import Options
    from k3verify.patch.diff import run as run_diff
    from k3verify.patch.report import write

    o = unit.options
    result = run_diff(Options(base=o["base"], toggles=o["toggles"], scenarios=o["scenarios"], scale=float(o["scale"]),
                              model=ctx.model_arg, progress=ctx.progress.note))
    rows = result["rows"]
    if ctx.run_dir is not None:            # its own report beside the suite's, as `all --base` writes it
        report, _ = write(ctx.run_dir / "patch-diff" / unit.id, f"patch-diff-{unit.id}", "k3verify patch_diff", result)
        rows = report["results"]
    return [Result.from_dict({**r, "toggle": "patch-diff", "check": f"{r['toggle']}/{r['check']}",
                              "kind": "optimization"}).tag(patch_summary=result["summary"]["line"]) for r in rows]
