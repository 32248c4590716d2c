"""KVV benchmark scores held against the published K3 vendor ranges.

A KVV run (inspect-ai OCRBench / MMMU-Pro Vision, the BEAM script, DeepSWE on Pier)
produces one score per benchmark as a fraction in [0, 1]. The ranges below are the
spread of the vendors' K3 submissions (thinking effort max), as recorded in
/work/shared/docs/anchors.md from MoonshotAI/Kimi-Vendor-Verifier's README. A score
inside its closed range passes, outside fails; a missing score ("TBD") is a skip.
"""

from __future__ import annotations

import csv
import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from optimized_stack import safe_load
from optimized_stack.errors import K3Error

RANGES_VERSION = 1


@dataclass(frozen=True)
class VendorRange:
    name: str
    low: float
    high: float
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= self.high <= 1.0:
            raise ValueError(f"{self.name}: need 0 <= low <= high <= 1, got [{self.low}, {self.high}]")


VENDOR_RANGES: tuple[VendorRange, ...] = (
    VendorRange("OCRBench", 0.878, 0.897, ("ocr_bench",)),
    VendorRange("MMMU-Pro Vision", 0.804, 0.820, ("mmmu", "mmmu_pro", "mmmu_pro_vision")),
    VendorRange("BEAM 1M", 0.291, 0.322, ("beam", "beam (1m)")),
    VendorRange("DeepSWE", 0.658, 0.695, ("deep_swe", "deep-swe")),
)


def _key(name: str) -> str:
    """Compare names without case, spaces or punctuation: 'MMMU Pro Vision' == 'mmmu_pro_vision'."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


_BY_KEY = {_key(n): r for r in VENDOR_RANGES for n in (r.name, *r.aliases)}
_NON_SCORE_COLUMNS = {"provider", "vendor", "model", "date", "thinkingeffort", "effort"}


def find_range(name: str) -> VendorRange:
    """Benchmark name (any spelling KVV uses) -> its range; unknown names get a did-you-mean."""
    if not isinstance(name, str) or _key(name) not in _BY_KEY:
        close = difflib.get_close_matches(_key(str(name)), list(_BY_KEY), n=1, cutoff=0.5)
        hint = f"; did you mean {_BY_KEY[close[0]].name!r}?" if close else ""
        known = ", ".join(r.name for r in VENDOR_RANGES)
        raise K3Error(f"unknown KVV benchmark {name!r}{hint} (known: {known})")
    return _BY_KEY[_key(name)]


def _score(value, name: str, source: str) -> float | None:
    """A score cell -> float in [0, 1], or None for 'TBD'/empty."""
    if isinstance(value, dict):
        for k in ("score", "accuracy", "value", "mean"):
            if k in value:
                return _score(value[k], name, source)
        raise K3Error(f"{source}: {name}: expected a number or an object with 'score', got keys {sorted(value)}")
    if value is None or (isinstance(value, str) and value.strip().upper() in ("", "TBD", "N/A", "NA", "-")):
        return None
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise K3Error(f"{source}: {name}: expected a score in [0, 1], got {value!r}") from None
    if isinstance(value, bool) or not 0.0 <= score <= 1.0:
        raise K3Error(f"{source}: {name}: expected a score as a fraction in [0, 1], got {value!r}"
                      + (" (a percentage? divide by 100)" if 1.0 < score <= 100.0 else ""))
    return score


def _pairs_from_json(data, source: str) -> list[tuple[str, object]]:
    if isinstance(data, dict) and isinstance(data.get("results"), (dict, list)):
        data = data["results"]
    if isinstance(data, dict):
        return list(data.items())
    if isinstance(data, list) and all(isinstance(row, dict) for row in data):
        out = []
        for row in data:
            name = row.get("benchmark", row.get("name"))
            if name is None or not any(k in row for k in ("score", "accuracy", "value")):
                raise K3Error(f"{source}: expected rows like {{'benchmark': ..., 'score': ...}}, got {row}")
            out.append((name, row))
        return out
    raise K3Error(f"{source}: expected a JSON object of benchmark -> score or a list of rows, got {type(data).__name__}")


def _pairs_from_csv(text: str, source: str) -> list[tuple[str, object]]:
    rows = list(csv.reader(text.splitlines()))
    rows = [r for r in rows if any(cell.strip() for cell in r)]
    if len(rows) < 2:
        raise K3Error(f"{source}: expected a CSV header and at least one row, got {len(rows)} line(s)")
    header = [h.strip() for h in rows[0]]
    keys = [_key(h) for h in header]
    if "benchmark" in keys and "score" in keys:  # long form: benchmark,score
        b, s = keys.index("benchmark"), keys.index("score")
        return [(r[b].strip(), r[s].strip() if s < len(r) else None) for r in rows[1:]]
    if len(rows) != 2:  # wide form, as in the KVV README table: one row of scores
        raise K3Error(f"{source}: a wide CSV (one column per benchmark) must have exactly one data row, "
                      f"got {len(rows) - 1}")
    return [(h, v.strip()) for h, k, v in zip(header, keys, rows[1]) if k not in _NON_SCORE_COLUMNS]


def import_kvv_results(path) -> dict:
    """Read a KVV results file (JSON or CSV) and hold each benchmark against its vendor range.

    Returns {"source", "ranges_version", "benchmarks": [{name, score, low, high, status, reason}],
    "summary": {pass, fail, skip}, "passed"}; bad files and unknown benchmarks raise K3Error.
    """
    p = Path(path)
    source = str(p)
    try:
        text = safe_load.decode_utf8(p.read_bytes(), source)
    except OSError as e:
        raise K3Error(f"{source}: cannot read KVV results ({type(e).__name__}: {e})") from None
    if p.suffix.lower() == ".json" or text.lstrip().startswith(("{", "[")):
        try:
            pairs = _pairs_from_json(safe_load.loads_json(text, source), source)   # bounded: depth, int size
        except json.JSONDecodeError as e:
            raise K3Error(f"{source}: expected JSON, parse error at line {e.lineno}: {e.msg}") from None
    else:
        pairs = _pairs_from_csv(text, source)
    if not pairs:
        raise K3Error(f"{source}: no benchmark scores found")
    seen: dict[str, str] = {}
    out = []
    for raw_name, raw_value in pairs:
        rng = find_range(str(raw_name))
        if rng.name in seen:
            raise K3Error(f"{source}: {rng.name} appears twice ({seen[rng.name]!r} and {raw_name!r})")
        seen[rng.name] = str(raw_name)
        score = _score(raw_value, rng.name, source)
        if score is None:
            status, reason = "skip", "no score in the file (TBD)"
        elif rng.low <= score <= rng.high:
            status, reason = "pass", f"{score:g} inside the vendor range [{rng.low:g}, {rng.high:g}]"
        else:
            side = "below" if score < rng.low else "above"
            status, reason = "fail", f"{score:g} {side} the vendor range [{rng.low:g}, {rng.high:g}]"
        out.append({"name": rng.name, "score": score, "low": rng.low, "high": rng.high,
                    "status": status, "reason": reason})
    summary = {s: sum(b["status"] == s for b in out) for s in ("pass", "fail", "skip")}
    return {"source": source, "ranges_version": RANGES_VERSION, "benchmarks": out,
            "summary": summary, "passed": summary["fail"] == 0}
