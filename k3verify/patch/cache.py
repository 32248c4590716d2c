"""REV's captures on disk: one unit = <id>.json (Capture.to_json + prompt digest) and
<id>.safetensors (the kept tensors), as driver.write_unit leaves them; the cache keeps
them with a meta file of their sha256, and a unit is trusted only when the files match the
meta AND every tensor matches its capture hash. Anything else is recomputed."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..capture.capture import Capture
from ..compare.tensors import hash_like
from ..io import atomic_write_bytes, atomic_write_json
from .driver import PROTOCOL, tensor_key

CACHE_FORMAT, CACHE_VERSION = "k3verify.patch-cache", 1


class BadUnit(Exception):
    """A unit's files are missing, unreadable or do not match their hashes."""


def load_unit(directory: Path, uid: str) -> tuple[Capture | None, dict]:
    """(capture with its tensors attached, record) or (None, record) for a unit whose run failed."""
    from safetensors.torch import load_file
    try:
        rec = json.loads((directory / f"{uid}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadUnit(f"{uid}.json: {exc}") from None
    if "error" in rec:
        return None, rec
    try:
        cap = Capture.from_json(rec["capture"])
        tensors = load_file(str(directory / f"{uid}.safetensors"))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise BadUnit(f"{uid}: {type(exc).__name__}: {exc}") from None
    for rid, rc in cap.requests.items():
        items = [(tensor_key(rid, "logits", p), it) for p, it in rc.logits.items()]
        items += [(tensor_key(rid, "kda", n, layer, name), it) for n, pt in rc.kda.items()
                  for (layer, name), it in pt.items()]
        items += [(tensor_key(rid, "mla", layer), it) for layer, it in rc.mla.items()]
        for key, it in items:
            t = tensors.get(key)
            if t is None or hash_like(t, it.digest) != it.digest:
                raise BadUnit(f"{uid}: tensor {key} {'missing' if t is None else 'does not match its hash'}")
            it.tensor = t
    return cap, rec


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class CaptureCache:
    """REV's units under one key directory; a unit is valid only with a meta file whose hashes match."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.hits: list[str] = []
        self.recomputed: list[str] = []         # entries that were there but did not check out

    def describe(self) -> dict | None:
        try:
            d = json.loads((self.dir / "describe.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        ok = isinstance(d, dict) and d.get("format") == CACHE_FORMAT and d.get("version") == CACHE_VERSION
        desc = d.get("describe") if ok else None
        fits = isinstance(desc, dict) and desc.get("protocol") == PROTOCOL and "toggles" in desc
        return desc if fits else None

    def put_describe(self, desc: dict) -> None:
        atomic_write_json(self.dir / "describe.json", {"format": CACHE_FORMAT, "version": CACHE_VERSION,
                                                       "describe": desc})

    def load(self, uid: str) -> tuple[Capture, dict] | None:
        meta_path = self.dir / f"{uid}.meta.json"
        if not meta_path.exists():
            return None
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            if meta.get("format") != CACHE_FORMAT or meta.get("version") != CACHE_VERSION:
                raise BadUnit("meta format")
            for suffix in ("json", "safetensors"):
                if sha256_file(self.dir / f"{uid}.{suffix}") != meta[suffix]:
                    raise BadUnit(f"{uid}.{suffix} does not match its recorded sha256")
            cap, rec = load_unit(self.dir, uid)
            if cap is None:
                raise BadUnit("cached error")
        except (BadUnit, OSError, ValueError, KeyError):
            self.recomputed.append(uid)
            return None
        self.hits.append(uid)
        return cap, rec

    def store(self, src: Path, uid: str) -> None:
        for suffix in ("json", "safetensors"):
            atomic_write_bytes(self.dir / f"{uid}.{suffix}", (src / f"{uid}.{suffix}").read_bytes())
        atomic_write_json(self.dir / f"{uid}.meta.json",       # last: the entry exists once this does
                          {"format": CACHE_FORMAT, "version": CACHE_VERSION,
                           "json": sha256_file(src / f"{uid}.json"),
                           "safetensors": sha256_file(src / f"{uid}.safetensors")})
