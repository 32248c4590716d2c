"""report.html: one self-contained page (inline CSS, inline SVG plots, no scripts, no fetches).

Plots are drawn as SVG by hand rather than through matplotlib: the page needs no
optional dependency, renders the same on every machine, and stays small.
- ULP histogram per finding whose bits differ (log-scaled bars; counts on hover and in labels)
- divergence by step when a result has "per_step": [{step, max_abs, max_ulp, kl}, ...]
- accuracy with intervals when a result has "accuracy" (a stats.PairedResult dict, a list of
  {label, value, ci: [lo, hi]} rows, or a dict of either)
"""

from __future__ import annotations

import math
from html import escape
from typing import Any, Mapping, Optional, Sequence

from k3verify.report.render_md import (finding_failed, finding_message, format_mapping, format_speedup, interval,
                                       key_numbers, num, result_title, status_text, summary_counts)

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2rem;color:#1d2330;max-width:1200px}
h1{font-size:1.5rem} h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #d0d5dd}
h3{font-size:1rem;margin-bottom:.3rem}
table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0}
th,td{border:1px solid #d0d5dd;padding:.25rem .5rem;text-align:left;vertical-align:top}
th{background:#f2f4f7} td.num{text-align:right;font-variant-numeric:tabular-nums}
.pass{color:#067647;font-weight:600} .fail,.error{color:#b42318;font-weight:700} .skip{color:#93370d}
.inconclusive,.not_exercised{color:#b54708;font-weight:700;font-style:italic}
.verdict{display:inline-block;padding:.2rem .8rem;border-radius:.3rem;color:#fff;font-weight:700}
.verdict.pass{background:#067647;color:#fff} .verdict.fail{background:#b42318;color:#fff}
.verdict.inconclusive{background:#b54708;color:#fff;font-style:normal}
.verdict.nothing_verified{background:#b54708;color:#fff;font-style:normal}
pre{background:#f8f9fb;border:1px solid #e4e7ec;padding:.6rem;overflow-x:auto;font-size:.8rem}
.result{border:1px solid #e4e7ec;border-radius:.4rem;padding:.3rem 1rem 1rem;margin:1rem 0}
.plots{display:flex;flex-wrap:wrap;gap:1rem} svg{background:#fff;border:1px solid #e4e7ec}
svg text{font-family:inherit} .muted{color:#667085}
"""
_W, _H = 520, 220  # plot size, px
_M = dict(left=56, right=12, top=26, bottom=52)  # margins, px
_COLORS = ("#1570ef", "#d92d20", "#079455", "#dc6803")


def _fmt(x: float | None) -> str:
    if x is None:
        return ""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf"
    if x != 0 and (abs(x) >= 1e4 or abs(x) < 1e-2):
        return f"{x:.2e}"
    return f"{x:.3g}"


def _svg_open(title: str, width: int = _W, height: int = _H) -> list[str]:
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
            f"<title>{escape(title)}</title>",
            f'<text x="{width / 2:.0f}" y="16" text-anchor="middle" font-size="12" font-weight="600">'
            f"{escape(title)}</text>"]


def svg_bars(labels: Sequence[str], counts: Sequence[int], title: str) -> str:
    """Bar chart on a log10(1 + count) axis, so a few differing elements show next to millions of equal ones."""
    x0, y0 = _M["left"], _H - _M["bottom"]
    plot_w, plot_h = _W - _M["left"] - _M["right"], _H - _M["top"] - _M["bottom"]
    top = max((math.log10(1 + c) for c in counts), default=1.0) or 1.0
    bar_w = min(48.0, plot_w / max(1, len(counts)))
    out = _svg_open(title)
    out.append(f'<line x1="{x0}" y1="{y0}" x2="{x0 + plot_w}" y2="{y0}" stroke="#98a2b3"/>')
    out.append(f'<text x="12" y="{_M["top"] + plot_h / 2:.0f}" font-size="10" '
               f'transform="rotate(-90 12 {_M["top"] + plot_h / 2:.0f})" text-anchor="middle">count (log)</text>')
    for i, (label, count) in enumerate(zip(labels, counts)):
        h = plot_h * math.log10(1 + count) / top
        x = x0 + i * bar_w
        color = _COLORS[0] if label == "0" else _COLORS[1]
        out.append(f'<rect x="{x + 1:.1f}" y="{y0 - h:.1f}" width="{max(1.0, bar_w - 2):.1f}" height="{h:.1f}" '
                   f'fill="{color}"><title>{escape(str(label))} ULP: {count}</title></rect>')
        if count:
            out.append(f'<text x="{x + bar_w / 2:.1f}" y="{y0 - h - 3:.1f}" font-size="9" '
                       f'text-anchor="middle">{count}</text>')
        lx, ly = x + bar_w / 2, y0 + 10
        out.append(f'<text x="{lx:.1f}" y="{ly:.1f}" font-size="9" text-anchor="end" '
                   f'transform="rotate(-45 {lx:.1f} {ly:.1f})">{escape(str(label))}</text>')
    out.append("</svg>")
    return "\n".join(out)


def svg_lines(xs: Sequence[float], ys: Sequence[float | None], title: str, y_label: str, log_y: bool) -> str:
    """One series against step; log axis for ULP and KL, which span orders of magnitude."""
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y) and (y > 0 or not log_y)]
    hidden = sum(y is not None for y in ys) - len(pts)
    out = _svg_open(title)
    if hidden:
        out.append(f'<text x="{_W - 4}" y="{_H - 4}" font-size="9" text-anchor="end">'
                   f"{hidden} zero or non-finite value(s) not drawn</text>")
    x0, y0 = _M["left"], _H - _M["bottom"]
    plot_w, plot_h = _W - _M["left"] - _M["right"], _H - _M["top"] - _M["bottom"]
    if not pts:
        out.append(f'<text x="{_W / 2}" y="{_H / 2}" text-anchor="middle" font-size="11">no plottable values '
                   f'(all zero or missing)</text></svg>')
        return "\n".join(out)
    tf = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    lo_x, hi_x = min(p[0] for p in pts), max(p[0] for p in pts)
    lo_y, hi_y = min(tf(p[1]) for p in pts), max(tf(p[1]) for p in pts)
    if not log_y:
        lo_y = min(0.0, lo_y)
    span_x, span_y = (hi_x - lo_x) or 1.0, (hi_y - lo_y) or 1.0

    def px(x: float, y: float) -> tuple[float, float]:
        return x0 + plot_w * (x - lo_x) / span_x, y0 - plot_h * (tf(y) - lo_y) / span_y

    out.append(f'<line x1="{x0}" y1="{y0}" x2="{x0 + plot_w}" y2="{y0}" stroke="#98a2b3"/>')
    out.append(f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 - plot_h}" stroke="#98a2b3"/>')
    lo_text = _fmt(10 ** lo_y if log_y else lo_y)
    hi_text = _fmt(10 ** hi_y if log_y else hi_y)
    out.append(f'<text x="{x0 - 4}" y="{y0}" font-size="9" text-anchor="end">{lo_text}</text>')
    out.append(f'<text x="{x0 - 4}" y="{y0 - plot_h + 8}" font-size="9" text-anchor="end">{hi_text}</text>')
    out.append(f'<text x="{x0}" y="{y0 + 14}" font-size="9">{_fmt(lo_x)}</text>')
    out.append(f'<text x="{x0 + plot_w}" y="{y0 + 14}" font-size="9" text-anchor="end">{_fmt(hi_x)}</text>')
    out.append(f'<text x="{x0 + plot_w / 2}" y="{y0 + 30}" font-size="10" text-anchor="middle">step</text>')
    out.append(f'<text x="12" y="{_M["top"] + plot_h / 2:.0f}" font-size="10" text-anchor="middle" '
               f'transform="rotate(-90 12 {_M["top"] + plot_h / 2:.0f})">{escape(y_label)}'
               f'{" (log)" if log_y else ""}</text>')
    coords = [px(x, y) for x, y in pts]
    out.append('<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>'.format(
        _COLORS[0], " ".join(f"{a:.1f},{b:.1f}" for a, b in coords)))
    for (x, y), (a, b) in zip(pts, coords):
        out.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2.5" fill="{_COLORS[0]}">'
                   f"<title>step {_fmt(x)}: {_fmt(y)}</title></circle>")
    out.append("</svg>")
    return "\n".join(out)


def svg_intervals(rows: Sequence[tuple[str, float, float | None, float | None]], title: str,
                  ref_line: tuple[str, float] | None = None) -> str:
    """Dot per row with its interval as a whisker; optional vertical reference line (e.g. -margin)."""
    row_h = 28
    height = _M["top"] + row_h * len(rows) + 36
    left = 150
    plot_w = _W - left - _M["right"]
    values = [v for _, val, lo, hi in rows for v in (val, lo, hi) if v is not None and math.isfinite(v)]
    if ref_line is not None:
        values.append(ref_line[1])
    lo_v, hi_v = (min(values), max(values)) if values else (0.0, 1.0)
    pad = (hi_v - lo_v) * 0.08 or 0.05
    lo_v, hi_v = lo_v - pad, hi_v + pad

    def px(v: float) -> float:
        return left + plot_w * (v - lo_v) / (hi_v - lo_v)

    out = _svg_open(title, _W, height)
    bottom = _M["top"] + row_h * len(rows)
    out.append(f'<line x1="{left}" y1="{bottom}" x2="{left + plot_w}" y2="{bottom}" stroke="#98a2b3"/>')
    out.append(f'<text x="{left}" y="{bottom + 14}" font-size="9">{_fmt(lo_v)}</text>')
    out.append(f'<text x="{left + plot_w}" y="{bottom + 14}" font-size="9" text-anchor="end">{_fmt(hi_v)}</text>')
    if ref_line is not None:
        x = px(ref_line[1])
        out.append(f'<line x1="{x:.1f}" y1="{_M["top"]}" x2="{x:.1f}" y2="{bottom}" stroke="{_COLORS[1]}" '
                   f'stroke-dasharray="4 3"/>')
        out.append(f'<text x="{x:.1f}" y="{bottom + 28}" font-size="9" text-anchor="middle" fill="{_COLORS[1]}">'
                   f"{escape(ref_line[0])}</text>")
    for i, (label, value, lo, hi) in enumerate(rows):
        y = _M["top"] + row_h * i + row_h / 2
        out.append(f'<text x="{left - 8}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{escape(label)}</text>')
        if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
            out.append(f'<line x1="{px(lo):.1f}" y1="{y:.1f}" x2="{px(hi):.1f}" y2="{y:.1f}" stroke="#344054" '
                       f'stroke-width="1.5"/>')
        if math.isfinite(value):
            out.append(f'<circle cx="{px(value):.1f}" cy="{y:.1f}" r="4" fill="{_COLORS[0]}"><title>'
                       f"{escape(label)}: {_fmt(value)} [{_fmt(lo)}, {_fmt(hi)}]</title></circle>")
    out.append("</svg>")
    return "\n".join(out)


# (title, rows of (label, value, interval low, interval high), optional reference line (label, x))
Panel = tuple[str, list[tuple[str, float, Optional[float], Optional[float]]], Optional[tuple[str, float]]]


def accuracy_panels(accuracy: Any, name: str = "") -> list[Panel]:
    """Normalize the accepted accuracy shapes into plot panels.

    A paired result gives two panels, because accuracies (~0.8) and their paired
    difference (~0.01) on one axis would squash the difference to a dot.
    """
    prefix = f"{name}: " if name else ""
    if isinstance(accuracy, Mapping) and "acc_ref" in accuracy and "acc_cand" in accuracy:
        from k3verify.quality.stats import wilson_interval

        n, alpha = accuracy.get("n"), num(accuracy.get("alpha")) or 0.05
        rows = []
        for label, acc_key, count_key in (("reference", "acc_ref", "ref_correct"),
                                          ("candidate", "acc_cand", "cand_correct")):
            value = num(accuracy.get(acc_key))
            lo = hi = None
            if isinstance(n, int) and n > 0 and isinstance(accuracy.get(count_key), int):
                lo, hi = wilson_interval(accuracy[count_key], n, 2 * alpha)  # two-sided 1 - 2*alpha
            if value is not None:
                rows.append((label, value, lo, hi))
        panels = [(f"{prefix}accuracy, n={n}, Wilson {1 - 2 * alpha:.0%} interval", rows, None)] if rows else []
        d, bound, margin = num(accuracy.get("d")), num(accuracy.get("lower_bound")), num(accuracy.get("margin"))
        if d is not None:
            # Tango's score interval is not symmetric about d; older reports have no upper_bound.
            hi = num(accuracy.get("upper_bound"))
            if hi is None and bound is not None:
                hi = d + (d - bound)
            ref = None if margin is None else (f"-margin {margin:g}", -margin)
            panels.append((f"{prefix}paired difference (cand - ref), one-sided bound", [("cand - ref", d, bound, hi)],
                           ref))
        return panels
    if isinstance(accuracy, Mapping) and accuracy and all(isinstance(v, (Mapping, list)) for v in accuracy.values()):
        return [p for key, sub in accuracy.items() for p in accuracy_panels(sub, f"{prefix}{key}")]
    rows = []
    for item in accuracy if isinstance(accuracy, list) else []:
        if not isinstance(item, Mapping):
            continue
        value = num(item.get("value", item.get("accuracy")))
        lo, hi = interval(item)
        if value is not None:
            rows.append((str(item.get("label", item.get("name", "?"))), value, lo, hi))
    return [(f"{prefix}accuracy with intervals", rows, None)] if rows else []


def _ulp_plot(finding: Mapping[str, Any]) -> str | None:
    hist = finding.get("ulp_histogram")
    if not isinstance(hist, list) or not hist:
        return None
    pairs = [(str(p[0]), int(p[1])) for p in hist if isinstance(p, (list, tuple)) and len(p) == 2
             and isinstance(p[1], int)]
    differing = [i for i, (label, count) in enumerate(pairs) if count and label != "0"]
    if not differing:
        return None
    keep = pairs[: differing[-1] + 1]  # up to the last non-empty bin: the empty tail says nothing
    return svg_bars([p[0] for p in keep], [p[1] for p in keep], f"ULP distance: {finding.get('what', '?')}")


def _per_step_plots(per_step: Any) -> list[str]:
    if not isinstance(per_step, list):
        return []
    rows = [r for r in per_step if isinstance(r, Mapping) and num(r.get("step")) is not None]
    xs = [num(r["step"]) for r in rows]
    plots = []
    for key, label, log_y in (("max_ulp", "max ULP", True), ("max_abs", "max |diff|", True), ("kl", "KL", True)):
        ys = [num(r.get(key)) for r in rows]
        if any(y is not None for y in ys):
            plots.append(svg_lines(xs, ys, f"{label} by step", label, log_y))
    return plots


def _status(r: Mapping[str, Any]) -> str:
    s, shown = str(r.get("status")), status_text(r)
    return f'<span class="{escape(s)}">{escape(shown.upper() if s in ("fail", "error") else shown)}</span>'


def _summary_table(results: list[Mapping[str, Any]]) -> str:
    head = ("toggle", "kind", "contract", "check", "scenario", "status", "mismatched", "max ULP", "max abs",
            "KL max", "argmax flips", "caught", "speedup", "time (s)")
    out = ["<table><thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"]
    for i, r in enumerate(results):
        k = key_numbers(r.get("findings", []))
        duration = num(r.get("duration_s"))
        caught = {True: "yes", False: "NO"}.get(r.get("caught"), "")
        cells = [f'<a href="#r{i}">{escape(str(r.get("toggle", "")))}</a>', escape(str(r.get("kind", ""))),
                 escape(str(r.get("contract", ""))), escape(str(r.get("check", ""))),
                 escape(str(r.get("scenario") or "-")), _status(r)]
        nums = [k["mismatched"], k["max_ulp"], k["max_abs"], k["kl"], k["flips"], caught,
                format_speedup(r.get("speedup")), "" if duration is None else f"{duration:.2f}"]
        out.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells)
                   + "".join(f'<td class="num">{escape(c)}</td>' for c in nums) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def _result_section(i: int, r: Mapping[str, Any]) -> str:
    findings = [f for f in r.get("findings", []) if isinstance(f, Mapping)]
    out = [f'<div class="result" id="r{i}"><h3>{_status(r)} {escape(result_title(r))}</h3>',
           f'<p class="muted">contract {escape(str(r.get("contract", "")))} - '
           f'kind {escape(str(r.get("kind", "")))}</p>']
    if r.get("reason"):
        out.append(f"<p>{escape(str(r['reason']))}</p>")
    for key, label in (("first_divergence", "First divergence"), ("localization", "Localization")):
        if isinstance(r.get(key), Mapping) and r[key]:
            out.append(f"<p><b>{label}:</b> {escape(format_mapping(r[key]))}</p>")
    for f in findings:
        if finding_failed(f) or (f.get("mode") == "tolerance" and f.get("n_bit_different")):
            out.append(f"<pre>{escape(finding_message(f))}</pre>")
    plots = [p for p in (_ulp_plot(f) for f in findings) if p]
    plots += _per_step_plots(r.get("per_step"))
    for title, rows, ref in accuracy_panels(r.get("accuracy")):
        plots.append(svg_intervals(rows, title, ref))
    if plots:
        out.append('<div class="plots">' + "\n".join(plots) + "</div>")
    out.append("</div>")
    return "\n".join(out)


def _worth_a_section(r: Mapping[str, Any]) -> bool:
    if r.get("status") in ("fail", "error", "inconclusive") or r.get("per_step") or r.get("accuracy"):
        return True
    return any(isinstance(f, Mapping) and f.get("n_bit_different") for f in r.get("findings", []))


def _environment(env: Any) -> str:
    if not isinstance(env, Mapping) or not env:
        return ""
    rows = []
    for key, value in env.items():
        if isinstance(value, Mapping):
            value = format_mapping(value)
        rows.append(f"<tr><th>{escape(str(key))}</th><td>{escape(str(value))}</td></tr>")
    return "<h2>Environment</h2><table>" + "".join(rows) + "</table>"


def render_html(report: Mapping[str, Any]) -> str:
    results = [r for r in report.get("results", []) if isinstance(r, Mapping)]
    summary = report.get("summary", {}) if isinstance(report.get("summary"), Mapping) else {}
    verdict = str(summary.get("verdict", "?"))
    run_id = escape(str(report.get("run_id", "?")))
    details = [_result_section(i, r) for i, r in enumerate(results) if _worth_a_section(r)]
    skips = [r for r in results if r.get("status") == "skip"]
    undecided = [r for r in results if r.get("status") == "inconclusive"]
    unexercised = [r for r in results if r.get("status") == "not_exercised"]
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>k3verify report {run_id}</title>", f"<style>{_CSS}</style></head><body>",
        f"<h1>k3verify report <code>{run_id}</code></h1>",
        f'<p><span class="verdict {escape(verdict)}">{escape(verdict.upper())}</span> '
        f"{escape(summary_counts(summary))}</p>",
        f"<p><strong>{escape(str(summary['reason']))}</strong></p>" if summary.get("reason") else "",
        f"<p class=\"muted\">created {escape(str(report.get('created', '?')))} - "
        f"<code>{escape(str(report.get('command', '')))}</code> - "
        f"schema {escape(str(report.get('schema_version')))}</p>",
        "<h2>Results</h2>", _summary_table(results),
    ]
    if details:
        parts += ["<h2>Evidence</h2>", *details]
    if undecided:
        parts.append("<h2>Inconclusive (not a pass)</h2><ul>" + "".join(
            f"<li>{escape(result_title(r))}: {escape(str(r.get('reason', '')))}</li>" for r in undecided) + "</ul>")
    if unexercised:
        parts.append("<h2>Not exercised (not a pass)</h2><ul>" + "".join(
            f"<li>{escape(result_title(r))}: {escape(str(r.get('reason', '')))}</li>" for r in unexercised) + "</ul>")
    if skips:
        parts.append("<h2>Skipped</h2><ul>" + "".join(
            f"<li>{escape(result_title(r))}: {escape(str(r.get('reason', '')))}</li>" for r in skips) + "</ul>")
    parts += [_environment(report.get("environment")), "</body></html>"]
    return "\n".join(p for p in parts if p) + "\n"
