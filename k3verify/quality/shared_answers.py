"""The reference side's answers to a quality gate's prompts, computed once per run and shared by
its processes through the run directory.

`k3verify all --jobs N` runs a suite's units in several worker processes (suites/run_all.py).
Every toggle's gsm8k unit answers the same prompts on the reference path, which is deterministic
for a given checkpoint and numerics environment, so one process computes those answers and the
others read them. Why: on the H200 release run 22 gsm8k units ran in 8-17 processes and each
process recomputed the reference for each model, ~40% of GSM8K's 3,750 s of unit work.

Where one call's answers come from, first hit wins:
    process   this process answered these prompts before (Context.reference_answers)
    run_dir   <run_dir>/reference_answers/<key>.json, written by a process of this run
    computed  answered here, then written to that file (atomically) for the others
<key> is the sha256 of everything that decides the answers: `identity` (the checkpoint, the
numerics environment, the kind's engine options) and the call's prompts, max_new_tokens and stop
strings; never an object id, which means nothing in another process. A process claims a key by
creating <key>.lock with O_EXCL (its pid and host inside) and removes the lock once the answers
are on file; another process polls for the file and takes over (computes and writes itself) when
the lock's pid is gone on this host or its wait passes `timeout_s`. A file that cannot be read or
does not match its key is never used: the answers are computed again and the file replaced. A
cache problem (an unwritable run directory) never fails the unit: it answers without sharing.

Only ever the reference side: a toggle's candidate wraps the plain generate_fn, so its answers
are always computed (tests/test_shared_reference.py and tests/test_engine_generate.py hold that).
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from k3verify.io import ReadError, atomic_write_json, read_json
from k3verify.quality.gate_run import GenerateFn

DIR = "reference_answers"
FORMAT = "k3verify.reference-answers"
VERSION = 1
# one call answers one lm-eval batch (8 or more questions); a holder still busy after an hour
# is taken to be hung
TIMEOUT_S = 3600.0
POLL_S = 0.5
# O_EXCL creates the lock before its holder's pid is written into it; a lock still empty after
# this long belongs to a process that died in between
EMPTY_LOCK_GRACE_S = 10.0
SOURCES = ("process", "run_dir", "computed")
HOST = socket.gethostname()


def answers_key(identity: dict, prompts: list[str], max_new_tokens: int, stop: list[str]) -> str:
    """sha256 of the canonical JSON of everything that decides one call's answers."""
    blob = json.dumps({"format": FORMAT, "version": VERSION, "identity": identity, "prompts": list(prompts),
                       "max_new_tokens": int(max_new_tokens), "stop": list(stop)},
                      sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def reference_identity(ctx, **options: Any) -> dict[str, Any]:
    """What decides a reference's answers besides the prompts: the checkpoint (the identity reports
    record, Context.model_id: the weights file's sha256, or the preset and seed), how the run names
    and loads it (model_arg also picks the tokenizer), the numerics environment (torch, device
    name, dtype, threads, BLAS branch: compare/golden.py) and the kind's `options`."""
    from k3verify.compare.golden import numerics_environment
    return {"model_id": ctx.model_id, "model_arg": None if ctx.model_arg is None else str(ctx.model_arg),
            "load_options": dict(sorted(ctx.load_options.items())), "numerics": numerics_environment(ctx.model),
            "options": options}


def for_context(generate_fn: GenerateFn, ctx, kind: str, **options: Any) -> "SharedAnswers":
    """A kind's reference side in a unit's Context: keyed in this process by the model object and
    `options`, across the run by reference_identity (checkpoint, numerics, `options`). The one
    constructor the quality kinds use (gsm8k, needle)."""
    memory_key = (kind, id(ctx.model), *sorted((k, repr(v)) for k, v in options.items()))
    return SharedAnswers(generate_fn, ctx.reference_answers, memory_key, run_dir=ctx.run_dir,
                         identity=lambda: reference_identity(ctx, kind=kind, **options))


class SharedAnswers:
    """A reference generate_fn answering from this process's memory, then from the run
    directory, then by computing (once per run per key); `calls` logs where each call's answers
    came from, `evidence()` sums it up for a unit's results.

    `memory_key` keys `memory` within this process (an id(model) is fine there); `identity` is
    called once, and only with a run_dir, since it may hash the weights file."""

    def __init__(self, generate_fn: GenerateFn, memory: dict, memory_key: tuple, *, run_dir=None,
                 identity: Callable[[], dict] | None = None, timeout_s: float = TIMEOUT_S, poll_s: float = POLL_S):
        if run_dir is not None and identity is None:
            raise ValueError("a run_dir needs an identity (what decides the answers) to key its files by")
        if not timeout_s >= 0 or not poll_s > 0:
            raise ValueError(f"timeout_s must be >= 0 and poll_s > 0, got {timeout_s!r} and {poll_s!r}")
        self.generate_fn, self.memory, self.memory_key = generate_fn, memory, memory_key
        self.run_dir = None if run_dir is None else Path(run_dir)
        self._identity_fn, self._identity = identity, None
        self.timeout_s, self.poll_s = float(timeout_s), float(poll_s)
        self.calls: list[dict[str, Any]] = []

    @property
    def identity(self) -> dict:
        if self._identity is None:
            self._identity = self._identity_fn()
        return self._identity

    def __call__(self, prompts: list[str], max_new_tokens: int, stop: list[str]) -> list[str]:
        k = (*self.memory_key, tuple(prompts), max_new_tokens, tuple(stop))
        if k in self.memory:
            self.calls.append({"source": "process"})
        elif self.run_dir is None:
            answers, seconds = self._compute(prompts, max_new_tokens, stop)
            self.memory[k] = answers
            self.calls.append({"source": "computed", "seconds": seconds})
        else:
            answers, call = self._through_run_dir(list(prompts), max_new_tokens, list(stop))
            self.memory[k] = answers
            self.calls.append(call)
        return list(self.memory[k])

    def evidence(self) -> dict[str, Any]:
        """{"source": one of SOURCES, or "mixed" when the calls differ, "calls": count per source,
        "computed_by": [{pid, host, seconds, calls}] for run_dir answers, "waited_s",
        "took_over", "not_shared" and "replaced" ([why] each); the keys after "calls" only when they
        have something to say."""
        counts = Counter(c["source"] for c in self.calls)
        out: dict[str, Any] = {"source": next(iter(counts)) if len(counts) == 1 else "mixed" if counts else None,
                               "calls": dict(counts)}
        by: dict[tuple, dict] = {}
        for c in self.calls:
            if c["source"] == "run_dir":
                row = by.setdefault((c.get("pid"), c.get("host")),
                                    {"pid": c.get("pid"), "host": c.get("host"), "seconds": 0.0, "calls": 0})
                row["seconds"] += c.get("seconds") or 0.0
                row["calls"] += 1
        if by:
            out["computed_by"] = [{**r, "seconds": round(r["seconds"], 3)} for r in by.values()]
        waited = sum(c.get("waited_s", 0.0) for c in self.calls)
        if waited:
            out["waited_s"] = round(waited, 3)
        for key in ("took_over", "not_shared", "replaced"):
            reasons = list(dict.fromkeys(c[key] for c in self.calls if c.get(key)))
            if reasons:
                out[key] = reasons
        return out

    def _compute(self, prompts, max_new_tokens, stop) -> tuple[list[str], float]:
        t0 = time.perf_counter()
        answers = list(self.generate_fn(prompts, max_new_tokens, stop))
        return answers, time.perf_counter() - t0

    def _through_run_dir(self, prompts: list[str], max_new_tokens: int, stop: list[str]
                         ) -> tuple[list[str], dict[str, Any]]:
        folder = self.run_dir / DIR
        try:
            key = answers_key(self.identity, prompts, max_new_tokens, stop)   # may read the weights file
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return self._computed(prompts, max_new_tokens, stop, None, None, not_shared=_why(exc, folder))
        path, lock = folder / f"{key}.json", folder / f"{key}.lock"
        started, polls = time.monotonic(), 0
        took_over, stale, unreadable = None, None, None

        def waited() -> float:                   # seconds spent polling, 0 when this process never waited
            return time.monotonic() - started if polls else 0.0
        while True:
            found, problem = read_answers(path, key, len(prompts))
            if found is not None:
                return found["answers"], _from_file(found, waited())
            unreadable = unreadable or problem      # replaced below, never used
            try:
                claimed = _claim(lock)
            except OSError as exc:               # not a held lock: a directory we cannot write in
                return self._computed(prompts, max_new_tokens, stop, None, key, not_shared=_why(exc, lock))
            if claimed:
                try:
                    # the holder may have written the file and released the lock since we looked
                    found, _ = read_answers(path, key, len(prompts))
                    if found is not None:
                        return found["answers"], _from_file(found, waited())
                    return self._computed(prompts, max_new_tokens, stop, path, key, replaced=unreadable,
                                          waited_s=waited())
                finally:
                    lock.unlink(missing_ok=True)
            took_over, stale = _dead_holder(lock)
            if took_over is None and time.monotonic() - started > self.timeout_s:
                took_over = f"waited {self.timeout_s:g} s for {_holder_text(lock)} to write {path.name}"
            if took_over is not None:
                break
            time.sleep(self.poll_s)
            polls += 1
        # Taking over leaves a live holder's lock alone (it removes its own); a dead holder's lock
        # goes once the answers are on file, and only if it is still the one judged dead.
        answers, call = self._computed(prompts, max_new_tokens, stop, path, key, replaced=unreadable,
                                       waited_s=waited(), took_over=took_over)
        if stale is not None:
            _unlink_if_unchanged(lock, stale)
        return answers, call

    def _computed(self, prompts, max_new_tokens, stop, path: Path | None, key: str | None, *,
                  replaced: str | None = None, waited_s: float = 0.0, took_over: str | None = None,
                  not_shared: str | None = None) -> tuple[list[str], dict[str, Any]]:
        """Answer here; with `path`, write the answers there for the run's other processes."""
        answers, seconds = self._compute(prompts, max_new_tokens, stop)
        call: dict[str, Any] = {"source": "computed", "seconds": seconds, **({"key": key} if key else {})}
        if path is not None:
            try:
                atomic_write_json(path, self._record(key, prompts, max_new_tokens, stop, answers, seconds),
                                  indent=None, allow_nan=False)
            except (OSError, TypeError, ValueError) as exc:   # unwritable, or answers that are not text
                not_shared = f"cannot write {path}: {exc}"
        extras = {"waited_s": waited_s, "took_over": took_over, "not_shared": not_shared,
                  "replaced": f"unusable answers file ({replaced})" if replaced else None}
        call.update({k: v for k, v in extras.items() if v})
        return answers, call

    def _record(self, key, prompts, max_new_tokens, stop, answers, seconds) -> dict[str, Any]:
        ident = self.identity
        numerics = ident.get("numerics") or {}
        inputs = {"model_id": ident.get("model_id"), "model_arg": ident.get("model_arg"),
                  "device": numerics.get("device"), "dtype": numerics.get("dtype"), "n_prompts": len(prompts),
                  "max_new_tokens": max_new_tokens, "stop": stop, "options": ident.get("options")}
        return {"format": FORMAT, "version": VERSION, "key": key, "inputs": inputs, "identity": ident,
                "seconds": round(seconds, 3), "pid": os.getpid(), "host": HOST,
                "written": datetime.now(timezone.utc).isoformat(timespec="seconds"), "answers": answers}


def read_answers(path: Path, key: str, n: int) -> tuple[dict | None, str | None]:
    """(the file's record, None) when it holds `n` text answers for `key`; (None, None) when there
    is no file; (None, why) when there is one that must not be used."""
    try:
        data = read_json(path)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, ReadError) as exc:      # cut short, not JSON, not UTF-8, too deep
        return None, f"unreadable: {type(exc).__name__}"
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        return None, f"not a {FORMAT} v{VERSION} file"
    if data.get("key") != key:
        return None, f"written for key {str(data.get('key'))[:12]}, not {key[:12]}"
    answers = data.get("answers")
    if not (isinstance(answers, list) and len(answers) == n and all(isinstance(a, str) for a in answers)):
        return None, f"expected {n} text answers"
    return data, None


def _from_file(record: dict, waited_s: float) -> dict[str, Any]:
    pid, host, seconds = record.get("pid"), record.get("host"), record.get("seconds")
    call = {"source": "run_dir", "key": record["key"], "pid": pid if isinstance(pid, int) else None,
            "host": host if isinstance(host, str) else None,
            "seconds": float(seconds) if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) else None}
    return {**call, "waited_s": waited_s} if waited_s else call


def _claim(lock: Path) -> bool:
    """True when this process created the lock (O_EXCL: one creator); False when it is held."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), "host": HOST, "created": time.time()}, f)
    return True


def _holder(raw: bytes) -> tuple[int, str] | None:
    try:
        data = json.loads(raw)
        pid, host = int(data["pid"]), str(data["host"])
    except (ValueError, KeyError, TypeError):
        return None
    return (pid, host) if pid > 0 else None       # os.kill(0, 0) would ask about our own group


def _dead_holder(lock: Path) -> tuple[str | None, bytes | None]:
    """(why the lock's holder is known to be gone, the lock's bytes), or (None, None) while it may
    be alive: running on this host, on another host (no way to ask), or the lock was just released."""
    try:
        raw = lock.read_bytes()
        age_s = time.time() - lock.stat().st_mtime
    except OSError:
        return None, None
    holder = _holder(raw)
    if holder is None:
        if age_s > EMPTY_LOCK_GRACE_S:
            return f"{lock.name} has named no holder for {age_s:.0f} s", raw
        return None, None
    pid, host = holder
    if host != HOST:
        return None, None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"pid {pid}, which held {lock.name}, is no longer running", raw
    except OSError:                               # PermissionError: alive, another user's
        pass
    return None, None


def _holder_text(lock: Path) -> str:
    try:
        holder = _holder(lock.read_bytes())
    except OSError:
        holder = None
    return "the lock's holder" if holder is None else f"pid {holder[0]} on {holder[1]}"


def _unlink_if_unchanged(lock: Path, raw: bytes) -> None:
    try:
        if lock.read_bytes() == raw:
            lock.unlink(missing_ok=True)
    except OSError:
        pass


def _why(exc: OSError, path: Path) -> str:
    return f"cannot write {path}: {exc.strerror or exc}"
