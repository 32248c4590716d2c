"""report.md: a summary table, then every failure with its evidence.

Also holds the small view helpers the HTML and JUnit renderers share (finding text,
key numbers per result), so all three views say the same thing about a result.
Renderers are defensive: report.json may come from an older gate or hold findings
with fields missing, and a report view must never be the thing that crashes a run.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterable, Mapping

from k3verify.verdict.result import STATUS

# Tuple-typed Finding fields that to_dict turned into lists.
_TUPLE_FIELDS = ("shape", "max_ulp_index", "max_abs_index", "max_rel_index", "first_index_tuple", "first_flip_tokens")
_FLOAT_FIELDS = ("atol", "rtol", "max_abs", "max_rel", "kl_max", "kl_mean", "top1_agreement")
_ULP_MAX = (1 << 63) - 1  # compare.ULP_MAX: NaN against a number


def num(value: Any) -> float | None:
    """A finite or non-finite float from a report value ("nan"/"inf" strings included); None if not numeric."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity"):
        return float(value.strip().lower().replace("infinity", "inf"))
    return None


def _finding_from_dict(d: Mapping[str, Any]) -> Any:
    from k3verify.compare.tensors import Finding, LogitFinding  # torch import only when a finding needs text

    cls = LogitFinding if "n_rows" in d else Finding
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key not in names:
            continue
        if key in _TUPLE_FIELDS and isinstance(value, list):
            value = tuple(value)
        elif key == "ulp_histogram" and isinstance(value, list):
            value = [tuple(pair) for pair in value]
        elif key in _FLOAT_FIELDS and isinstance(value, str):
            value = num(value)
        kwargs[key] = value
    return cls(**kwargs)


def finding_message(d: Mapping[str, Any]) -> str:
    """The comparator's own text for a finding dict; a field dump when it cannot be rebuilt."""
    if isinstance(d.get("message"), str) and d["message"]:
        return d["message"]
    try:
        return _finding_from_dict(d).message()
    except Exception:  # noqa: BLE001 - any malformed finding still gets rendered
        keys = ("what", "mode", "n_mismatched", "n_total", "max_ulp", "max_ulp_index", "max_abs",
                "max_abs_index", "first_index_tuple", "first_ref", "first_cand", "kl_max", "argmax_flips", "problem")
        shown = ", ".join(f"{k}={d[k]}" for k in keys if d.get(k) is not None)
        return f"finding: {shown or dict(d)}"


def finding_failed(d: Mapping[str, Any]) -> bool:
    return d.get("passed") is False or bool(d.get("problem"))


def _fmt_float(x: float | None, spec: str = ".2e") -> str:
    if x is None:
        return ""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return "0" if x == 0 else format(x, spec)


def key_numbers(findings: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Summary cells over a result's findings: counts are summed, worst values are maxima."""
    findings = [f for f in findings if isinstance(f, Mapping)]
    out = {"mismatched": "", "max_ulp": "", "max_abs": "", "kl": "", "flips": ""}
    totals = [(f.get("n_mismatched"), f.get("n_total")) for f in findings]
    totals = [(m, n) for m, n in totals if isinstance(m, int) and isinstance(n, int)]
    if totals:
        out["mismatched"] = f"{sum(m for m, _ in totals)} / {sum(n for _, n in totals)}"
    ulps = [f["max_ulp"] for f in findings if isinstance(f.get("max_ulp"), int) and not isinstance(f["max_ulp"], bool)]
    if ulps:
        worst = max(ulps)
        out["max_ulp"] = "NaN vs number" if worst >= _ULP_MAX else str(worst)
    abs_values = [v for v in (num(f.get("max_abs")) for f in findings) if v is not None]
    if abs_values:
        out["max_abs"] = _fmt_float(math.nan if any(math.isnan(v) for v in abs_values) else max(abs_values))
    kls = [v for v in (num(f.get("kl_max")) for f in findings) if v is not None]
    if kls:
        out["kl"] = _fmt_float(math.nan if any(math.isnan(v) for v in kls) else max(kls))
    flips = [(f.get("argmax_flips"), f.get("n_rows")) for f in findings if "n_rows" in f]
    flips = [(a, n) for a, n in flips if isinstance(a, int) and isinstance(n, int)]
    if flips:
        out["flips"] = f"{sum(a for a, _ in flips)} / {sum(n for _, n in flips)}"
    return out


def interval(d: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """An interval given as "ci": [lo, hi] or as "ci_low" / "ci_high"."""
    ci = d.get("ci")
    if isinstance(ci, (list, tuple)) and len(ci) == 2:
        return num(ci[0]), num(ci[1])
    return num(d.get("ci_low")), num(d.get("ci_high"))


def format_speedup(speedup: Mapping[str, Any] | None) -> str:
    """'1.23x [1.10, 1.35]' plus '(not counted)' when the gate withheld it."""
    if not isinstance(speedup, Mapping):
        return ""
    ratio = num(speedup.get("ratio", speedup.get("speedup")))
    text = f"{ratio:.2f}x" if ratio is not None and math.isfinite(ratio) else ""
    lo, hi = interval(speedup)
    if lo is not None and hi is not None:
        text += f" [{lo:.2f}, {hi:.2f}]"
    if speedup.get("counted") is False:
        text += " (not counted)"
    return text.strip() or ", ".join(f"{k}={v}" for k, v in speedup.items())


def format_mapping(d: Mapping[str, Any] | None) -> str:
    """'key=value, ...' for first_divergence / localization dicts, nested values inline."""
    if not isinstance(d, Mapping):
        return ""
    return ", ".join(f"{k}={v}" for k, v in d.items() if v is not None)


def summary_counts(summary: Mapping[str, Any]) -> str:
    """'3 passed, 0 failed, 1 skipped, 0 errors, 2 inconclusive, 1 not exercised' (the last two only
    when there are any)."""
    text = (f"{summary.get('passed', 0)} passed, {summary.get('failed', 0)} failed, "
            f"{summary.get('skipped', 0)} skipped, {summary.get('errors', 0)} errors")
    text += f", {summary['inconclusive']} inconclusive" if summary.get("inconclusive") else ""
    return text + (f", {summary['not_exercised']} not exercised" if summary.get("not_exercised") else "")


def failure_details(r: Mapping[str, Any]) -> tuple[list[tuple[str, str]], list[str]]:
    """What a failing result says beyond its reason: [(label, text)] for the first divergence and
    the localization, and the message of every failed finding (the Markdown and JUnit views)."""
    where = [(label, format_mapping(r[key])) for key, label in (("first_divergence", "first divergence"),
                                                                 ("localization", "localization")) if r.get(key)]
    messages = [finding_message(f) for f in r.get("findings", []) if isinstance(f, Mapping) and finding_failed(f)]
    return where, messages


def status_text(r: Mapping[str, Any]) -> str:
    """The status as the views show it ("not exercised"); a smoke test says so beside its status."""
    status = r.get("status", "?")
    shown = STATUS[status].label if status in STATUS else str(status)
    return shown + (" (smoke)" if r.get("role") == "smoke" else "")


def result_title(r: Mapping[str, Any]) -> str:
    scenario = r.get("scenario")
    return f"{r.get('toggle', '?')} / {r.get('check', '?')}" + (f" / {scenario}" if scenario else "")


def _cell(value: Any) -> str:
    text = "" if value is None else str(value)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _fence(text: str) -> str:
    # A fence longer than any backtick run inside, so an odd message cannot close the block early.
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}text\n{text}\n{ticks}"


def _caught(value: Any) -> str:
    return {True: "yes", False: "NO"}.get(value, "")


def events_cell(row: Mapping[str, Any]) -> str:
    """'3/3' (declared path events that fired on the row's scenario), '2/3 (no prefix_hit_block)',
    or '' for a row without path evidence (a gate, a skip)."""
    ev = row.get("evidence") if isinstance(row.get("evidence"), Mapping) else {}
    counts = ev.get("events") if isinstance(ev.get("events"), Mapping) else None
    if counts is None:
        return ""
    miss = list(ev.get("events_missing") or [])
    text = f"{len(counts) - len(miss)}/{len(counts)}"
    return text + (f" (no {', '.join(miss)})" if miss else "")


def events_detail(row: Mapping[str, Any]) -> str:
    """'prefix_hit_block=6, checkpoint_saved=4' (the declared events' counters)."""
    ev = row.get("evidence") if isinstance(row.get("evidence"), Mapping) else {}
    counts = ev.get("events") if isinstance(ev.get("events"), Mapping) else {}
    return ", ".join(f"{e}={n}" for e, n in counts.items())


def render_markdown(report: Mapping[str, Any]) -> str:
    results = [r for r in report.get("results", []) if isinstance(r, Mapping)]
    summary = report.get("summary", {})
    verdict = str(summary.get("verdict", "?")).upper()
    lines = [
        f"# k3verify report `{report.get('run_id', '?')}`",
        "",
        f"**Verdict: {verdict}** - {summary_counts(summary)}",
        "",
        *([f"> {_cell(summary['reason'])}", ""] if summary.get("reason") else []),
        f"- created: {report.get('created', '?')}",
        f"- command: `{report.get('command', '')}`",
        f"- schema version: {report.get('schema_version', '?')}",
        "",
        "## Results",
        "",
        "| toggle | kind | contract | check | scenario | status | events | mismatched | max ULP | max abs | KL max "
        "| argmax flips | caught | speedup | time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        k = key_numbers(r.get("findings", []))
        shown = status_text(r)
        if r.get("status") in ("fail", "error"):
            shown = f"**{shown.upper()}**"
        elif r.get("status") in ("inconclusive", "not_exercised"):
            shown = f"*{shown}*"
        duration = num(r.get("duration_s"))
        cells = [r.get("toggle"), r.get("kind"), r.get("contract"), r.get("check"), r.get("scenario") or "-", shown,
                 events_cell(r), k["mismatched"], k["max_ulp"], k["max_abs"], k["kl"], k["flips"], _caught(r.get("caught")),
                 format_speedup(r.get("speedup")), "" if duration is None else f"{duration:.2f}"]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")

    failures = [r for r in results if r.get("status") in ("fail", "error")]
    if failures:
        lines += ["", "## Failures"]
    for r in failures:
        lines += ["", f"### {str(r.get('status')).upper()}: {result_title(r)}", "",
                  f"- contract: {r.get('contract', '')}", f"- reason: {_cell(r.get('reason', ''))}"]
        where, messages = failure_details(r)
        lines += [f"- {label}: {_cell(text)}" for label, text in where]
        for message in messages:
            lines += ["", _fence(message)]

    undecided = [r for r in results if r.get("status") == "inconclusive"]
    if undecided:
        lines += ["", "## Inconclusive (not a pass)", ""]
        lines += [f"- {result_title(r)}: {_cell(r.get('reason', ''))}" for r in undecided]

    unexercised = [r for r in results if r.get("status") == "not_exercised"]
    if unexercised:
        lines += ["", "## Not exercised (not a pass: the toggle's code path never ran)", ""]
        lines += [f"- {result_title(r)}: {_cell(r.get('reason', ''))}" for r in unexercised]

    counted = [r for r in results if events_detail(r)]
    if counted:
        lines += ["", "## Path events (declared counters per row)", ""]
        lines += [f"- {result_title(r)}: {events_detail(r)}" for r in counted]

    skips = [r for r in results if r.get("status") == "skip"]
    if skips:
        lines += ["", "## Skipped", ""]
        lines += [f"- {result_title(r)}: {_cell(r.get('reason', ''))}" for r in skips]

    env = report.get("environment", {})
    if isinstance(env, Mapping) and env:
        git = env.get("git") if isinstance(env.get("git"), Mapping) else {}
        model = env.get("model") if isinstance(env.get("model"), Mapping) else {}
        cpu = env.get("cpu") if isinstance(env.get("cpu"), Mapping) else {}
        dirty = " (dirty)" if git.get("dirty") else ""
        lines += ["", "## Environment", "",
                  f"- python {env.get('python', '?')}, torch {env.get('torch', '?')}, numpy {env.get('numpy', '?')}",
                  f"- cpu: {cpu.get('model', '?')} ({cpu.get('capability', '?')}), "
                  f"threads {env.get('num_threads', '?')}",
                  f"- cuda device: {env.get('cuda_device') or 'none'}",
                  f"- git: {git.get('commit') or 'unknown'}{dirty}",
                  f"- model: {model.get('source') or 'unknown'}"
                  + (f" sha256 {model['sha256']}" if model.get("sha256") else ""),
                  f"- dtype: {env.get('dtype') or '?'}, seeds: {env.get('seeds')}"]
    return "\n".join(lines) + "\n"
