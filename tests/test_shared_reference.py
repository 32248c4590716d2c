"""The reference side's answers are computed once per run and shared through the run directory
(quality/shared_answers.py); the candidate's never are.

Most tests use a generate_fn that counts its calls on a one-layer stand-in model (a Context
needs parameters for its device and dtype): what is under test is the sharing, not the answers.
The last runs the real gsm8k kind on a tiny seeded checkpoint.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from k3verify.io import atomic_write_json
from k3verify.kinds import gsm8k as kind
from k3verify.kinds.base import Context, Unit
from k3verify.quality.shared_answers import DIR, FORMAT, HOST, VERSION, SharedAnswers, answers_key, read_answers
from optimized_stack.model import ops

from cli_helpers import cache  # noqa: F401  (autouse: lm-eval task files in a temp cache)
from test_quality_cli import DATA, tiny_model  # noqa: F401  (tiny_model: the seeded 2-layer checkpoint)

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["Question: 1 + 1?\nAnswer:", "Question: 2 + 3?\nAnswer:"]
STOP = ["\n\nQuestion:"]
OPTIONS = {"batch": 1, "stack": "reference"}


class Counting:
    """A generate_fn answering `tag:prompt:max_new_tokens`, counting its calls."""

    def __init__(self, tag: str = "ref"):
        self.tag, self.calls = tag, 0

    def __call__(self, prompts, max_new_tokens, stop):
        self.calls += 1
        return [f"{self.tag}:{p}:{max_new_tokens}" for p in prompts]


def checkpoint(folder: Path, weights: bytes = b"weights v1") -> Path:
    """A directory whose model.safetensors the checkpoint identity hashes (model_fingerprint)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def stand_in(source, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = torch.nn.Linear(1, 2).to(dtype)
    model.source = str(source)
    return model


def reference(gen, run_dir, *, source, dtype=torch.float32, model_arg="m", **options):
    """One process's reference generate_fn, as the gsm8k kind builds it."""
    ctx = Context(stand_in(source, dtype), model_arg=model_arg, run_dir=run_dir)
    return kind.remembered(gen, ctx, **{**OPTIONS, **options})


def answer_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / DIR).glob("*.json"))


# ---- one run, two processes ----------------------------------------------------------------------

def test_a_second_process_answers_from_the_first_ones_file(tmp_path):
    run_dir, model = tmp_path / "run", checkpoint(tmp_path / "ckpt")
    first, second = Counting(), Counting("never")
    a = reference(first, run_dir, source=model)
    b = reference(second, run_dir, source=model)
    assert a(PROMPTS, 16, STOP) == b(PROMPTS, 16, STOP) == [f"ref:{p}:16" for p in PROMPTS]
    assert (first.calls, second.calls) == (1, 0), "the second process recomputed the reference"
    assert a.evidence() == {"source": "computed", "calls": {"computed": 1}}
    ev = b.evidence()
    assert ev["source"] == "run_dir" and ev["calls"] == {"run_dir": 1}
    (by,) = ev["computed_by"]
    assert by["pid"] == os.getpid() and by["host"] == HOST and by["calls"] == 1 and by["seconds"] >= 0
    a(PROMPTS, 16, STOP)                                   # asked again in the first process: its memory
    assert first.calls == 1 and a.evidence()["source"] == "mixed"
    assert a.evidence()["calls"] == {"computed": 1, "process": 1}
    (f,) = answer_files(run_dir)
    record = json.loads(f.read_text())
    assert f.stem == record["key"] and not list((run_dir / DIR).glob("*.lock")), "the lock outlived the answers"
    inputs = record["inputs"]
    assert inputs["model_id"].startswith("sha256:") and inputs["device"] == "cpu" and inputs["dtype"] == "float32"
    assert (inputs["n_prompts"], inputs["max_new_tokens"], record["pid"]) == (2, 16, os.getpid())
    assert record["seconds"] >= 0 and record["answers"] == [f"ref:{p}:16" for p in PROMPTS]


def test_the_key_is_the_same_in_another_interpreter(tmp_path):
    """A real second process (its own hash seed, its own model object) computes, this one reads.
    The child runs on this process's torch thread count, as `all --jobs` workers share theirs:
    the thread count is part of the numerics environment, hence of the key (an earlier test in
    the same pytest process may have changed it; the CI run of 712df81 failed on that)."""
    run_dir, model = tmp_path / "run", checkpoint(tmp_path / "ckpt")
    script = textwrap.dedent(f"""
        import os, sys, torch
        torch.set_num_threads({torch.get_num_threads()})
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from test_shared_reference import Counting, reference, PROMPTS, STOP
        reference(Counting(), {str(run_dir)!r}, source={str(model)!r})(PROMPTS, 16, STOP)
        print(os.getpid())
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PYTHONHASHSEED": "123"}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    child = int(done.stdout.split()[-1])
    gen = Counting("never")
    here = reference(gen, run_dir, source=model)
    assert here(PROMPTS, 16, STOP) == [f"ref:{p}:16" for p in PROMPTS] and gen.calls == 0
    assert [by["pid"] for by in here.evidence()["computed_by"]] == [child] != [os.getpid()]


def _same(tmp_path):
    return {}


def _weights_changed(tmp_path):
    checkpoint(tmp_path / "ckpt", b"weights v2")          # the same path, other bytes
    return {}


CHANGES = {
    "same-inputs-reuse": (_same, {}, None),                # the control: nothing changed, nothing recomputed
    "other-checkpoint": (lambda p: {"source": checkpoint(p / "other", b"weights v2")}, {}, None),
    "weights-changed": (_weights_changed, {}, None),
    "preset-seed": (lambda p: {"source": "preset:k3-mini:seed1"}, {}, "preset:k3-mini:seed0"),
    "dtype-float64": (lambda p: {"dtype": torch.float64}, {}, None),
    "model-arg": (lambda p: {"model_arg": "other"}, {}, None),
    "batch-option": (lambda p: {"batch": 4}, {}, None),
    "stack-option": (lambda p: {"stack": "counted"}, {}, None),
    "prompts": (_same, {"prompts": PROMPTS[:1]}, None),
    "max-new-tokens": (_same, {"max_new_tokens": 17}, None),
    "stop-strings": (_same, {"stop": ["\n"]}, None),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_answers_are_reused_only_for_the_same_inputs(tmp_path, change):
    """Anything that can change the reference's answers is in the key: changing it recomputes."""
    edit, call_edit, base_source = CHANGES[change]
    run_dir = tmp_path / "run"
    base = {"source": base_source or checkpoint(tmp_path / "ckpt")}
    call = {"prompts": PROMPTS, "max_new_tokens": 16, "stop": STOP}
    first, second = Counting(), Counting("second")
    reference(first, run_dir, **base)(**call)
    second_fn = reference(second, run_dir, **{**base, **edit(tmp_path)})
    second_fn(**{**call, **call_edit})
    if change == "same-inputs-reuse":
        assert second.calls == 0 and second_fn.evidence()["source"] == "run_dir" and len(answer_files(run_dir)) == 1
    else:
        assert second.calls == 1, f"{change}: the answers of other inputs were reused"
        assert second_fn.evidence()["source"] == "computed" and len(answer_files(run_dir)) == 2


def test_without_a_run_dir_nothing_is_written_and_the_weights_are_not_hashed(tmp_path, monkeypatch):
    import k3verify.compare.golden as golden

    def no_hash(model):
        raise AssertionError("the weights were hashed for a run without a run directory")
    monkeypatch.setattr(golden, "model_id", no_hash)
    gen = Counting()
    fn = reference(gen, None, source=checkpoint(tmp_path / "ckpt"))
    assert fn(PROMPTS, 16, STOP) == fn(PROMPTS, 16, STOP) and gen.calls == 1     # this process's memory only
    assert fn.evidence()["calls"] == {"computed": 1, "process": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# ---- the lock ----------------------------------------------------------------------------------------

IDENTITY = {"model_id": "sha256:test"}
KEY = answers_key(IDENTITY, PROMPTS, 16, STOP)


def shared(gen, run_dir, **kw) -> SharedAnswers:
    return SharedAnswers(gen, {}, ("t",), run_dir=run_dir, identity=lambda: IDENTITY, poll_s=0.02, **kw)


def files(run_dir: Path) -> tuple[Path, Path]:
    return run_dir / DIR / f"{KEY}.json", run_dir / DIR / f"{KEY}.lock"


def hold(lock: Path, pid: int | None, host: str = HOST, age_s: float = 0.0) -> None:
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("" if pid is None else json.dumps({"pid": pid, "host": host}))
    if age_s:
        t = time.time() - age_s
        os.utime(lock, (t, t))


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def their_record(pid: int = 4242, seconds: float = 12.5) -> dict:
    return {"format": FORMAT, "version": VERSION, "key": KEY, "pid": pid, "host": HOST, "seconds": seconds,
            "answers": [f"theirs:{p}" for p in PROMPTS]}


def test_a_lock_of_a_dead_pid_is_taken_over(tmp_path):
    path, lock = files(tmp_path)
    pid = dead_pid()
    hold(lock, pid)
    gen = Counting()
    fn = shared(gen, tmp_path, timeout_s=60)
    t0 = time.monotonic()
    assert fn(PROMPTS, 16, STOP) == [f"ref:{p}:16" for p in PROMPTS] and gen.calls == 1
    assert time.monotonic() - t0 < 30, "waited for a dead holder instead of taking over"
    ev = fn.evidence()
    assert ev["source"] == "computed"
    assert ev["took_over"] == [f"pid {pid}, which held {lock.name}, is no longer running"]
    assert read_answers(path, KEY, 2)[0]["answers"] == [f"ref:{p}:16" for p in PROMPTS]
    assert not lock.exists(), "the dead holder's lock was left behind"


def test_a_lock_of_a_live_pid_waits_for_its_answers(tmp_path):
    path, lock = files(tmp_path)
    hold(lock, os.getpid())                                # alive: this very process
    writer = threading.Timer(0.3, lambda: atomic_write_json(path, their_record()))
    writer.start()
    gen = Counting()
    fn = shared(gen, tmp_path, timeout_s=60)
    try:
        out = fn(PROMPTS, 16, STOP)
    finally:
        writer.join()
    assert out == [f"theirs:{p}" for p in PROMPTS] and gen.calls == 0, "computed instead of waiting for the holder"
    ev = fn.evidence()
    assert ev["source"] == "run_dir" and ev["computed_by"] == [{"pid": 4242, "host": HOST, "seconds": 12.5,
                                                                "calls": 1}]
    assert ev["waited_s"] >= 0.2 and lock.exists(), "a live holder's lock is its own to remove"


@pytest.mark.parametrize("holder", ["live-pid", "dead-pid-on-another-host"])
def test_a_wait_past_the_timeout_takes_over(tmp_path, holder):
    """A pid on another host cannot be asked whether it lives: only the timeout ends that wait."""
    path, lock = files(tmp_path)
    if holder == "live-pid":
        hold(lock, os.getpid())
    else:
        hold(lock, dead_pid(), host="another-host")
    gen = Counting()
    fn = shared(gen, tmp_path, timeout_s=0.3)
    t0 = time.monotonic()
    fn(PROMPTS, 16, STOP)
    assert gen.calls == 1 and time.monotonic() - t0 >= 0.3
    (why,) = fn.evidence()["took_over"]
    assert why.startswith("waited 0.3 s for pid ")
    assert read_answers(path, KEY, 2)[0] is not None and lock.exists()


@pytest.mark.parametrize("age_s, reason", [(60.0, "has named no holder for 60 s"), (0.0, "waited 0.3 s")],
                         ids=["empty-lock-old", "empty-lock-fresh"])
def test_a_lock_that_names_no_holder(tmp_path, age_s, reason):
    """O_EXCL creates the lock before the pid is written: a fresh empty lock is a holder starting,
    an old one a holder that died in between."""
    _, lock = files(tmp_path)
    hold(lock, None, age_s=age_s)
    gen = Counting()
    fn = shared(gen, tmp_path, timeout_s=0.3)
    fn(PROMPTS, 16, STOP)
    (why,) = fn.evidence()["took_over"]
    assert gen.calls == 1 and reason in why


# ---- files that must not be used --------------------------------------------------------------------

CORRUPT = {
    "cut-short": b'{"format": "k3verify.reference-answers", "version": 1, "ans',
    "not-utf8": b"\xff\xfe\x00",
    "other-key": json.dumps({**their_record(), "key": "0" * 64}).encode(),
    "one-answer-missing": json.dumps({**their_record(), "answers": ["theirs"]}).encode(),
    "answers-not-text": json.dumps({**their_record(), "answers": [1, 2]}).encode(),
    "other-version": json.dumps({**their_record(), "version": VERSION + 1}).encode(),
}


@pytest.mark.parametrize("content", list(CORRUPT.values()), ids=list(CORRUPT))
def test_an_unusable_answers_file_is_recomputed_and_replaced(tmp_path, content):
    path, _ = files(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    gen = Counting()
    fn = shared(gen, tmp_path)
    assert fn(PROMPTS, 16, STOP) == [f"ref:{p}:16" for p in PROMPTS] and gen.calls == 1
    ev = fn.evidence()
    assert ev["source"] == "computed" and ev["replaced"][0].startswith("unusable answers file (")
    record, problem = read_answers(path, KEY, 2)
    assert problem is None and record["answers"] == [f"ref:{p}:16" for p in PROMPTS] and record["pid"] == os.getpid()
    # the control: the valid record of another process is read, not recomputed
    atomic_write_json(path, their_record())
    again = Counting()
    assert shared(again, tmp_path)(PROMPTS, 16, STOP) == [f"theirs:{p}" for p in PROMPTS] and again.calls == 0


def test_a_run_dir_that_cannot_be_written_answers_without_sharing(tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("a regular file where the run directory should be")
    gen = Counting()
    fn = shared(gen, blocker)
    assert fn(PROMPTS, 16, STOP) == [f"ref:{p}:16" for p in PROMPTS] and gen.calls == 1
    ev = fn.evidence()
    assert ev["source"] == "computed" and ev["not_shared"][0].startswith(f"cannot write {blocker / DIR}")


# ---- the gsm8k kind ---------------------------------------------------------------------------------

def _plain_ops() -> dict:
    return {f.name: getattr(ops.OPS, f.name) for f in fields(ops.OpTable)}


def test_gsm8k_units_in_two_processes_share_the_reference_never_the_candidate(monkeypatch, tmp_path):
    """Two toggles' units, each in its own Context (as two workers of `all --jobs`): the second
    reads the reference from the run directory and computes its own candidate, first. Negative
    control: its candidate answers wrongly and its gate fails, which it could not if the candidate
    were read from the reference's file."""
    import k3verify.quality.evals.gsm8k as ev
    from k3verify.quality.evals import gsm8k_synth as synth

    answers = {d["question"]: d["answer"].split("####")[-1].strip() for d in synth.generate("test", 40)}
    plain, calls = _plain_ops(), []

    def fake_greedy(model, tokenizer, add_bos=False):
        def generate(prompts, max_new_tokens, stop):
            side = "ref" if _plain_ops() == plain else "cand"          # a toggle swaps an op slot
            wrong = ops.OPS.moe_route is not None                      # mut_router_bias_in_weights' slot
            calls.append((model.tag, side, len(prompts)))
            return [" #### 0" if wrong else f" #### {answers[p.rsplit('Question: ', 1)[-1].split(chr(10))[0]]}"
                    for p in prompts]
        return generate

    monkeypatch.setattr(ev, "greedy_generate_fn", fake_greedy)
    run_dir, results = tmp_path / "run", {}
    opts = {**kind.OPTIONS, "limit": 40, "num_fewshot": 0}
    for worker, toggle in (("a", "gemm_per_shape"), ("b", "mut_router_bias_in_weights")):
        model = stand_in("preset:k3-mini:seed0")
        model.tag = worker
        results[worker] = kind.run(Unit("gsm8k", "g", opts, toggle), Context(model, run_dir=run_dir))
    assert [side for w, side, _ in calls if w == "a"][0] == "cand", "the candidate did not answer first"
    assert sum(n for w, side, n in calls if (w, side) == ("a", "ref")) == 40
    assert sum(n for w, side, n in calls if (w, side) == ("b", "ref")) == 0, "worker b recomputed the reference"
    assert sum(n for w, side, n in calls if (w, side) == ("b", "cand")) == 40, "worker b's candidate was not computed"
    assert {r["reference_source"] for r in results["a"]} == {"computed"}
    for r in results["b"]:
        assert r["reference_source"] == "run_dir" and r["reference_answers"]["computed_by"][0]["pid"] == os.getpid()
        assert r.status == "fail", "a wrong candidate passed: its answers were not its own"
    assert all(r.status != "fail" for r in results["a"]), "a right candidate failed: the pairing is broken"


def test_gsm8k_kind_on_a_real_model_reuses_the_reference_in_a_second_context(tmp_path, tiny_model):
    """The whole path on a tiny seeded checkpoint, each Context with its own loaded copy."""
    from optimized_stack import load_model

    run_dir = tmp_path / "run"
    opts = {**kind.OPTIONS, "dataset": "gsm8k", "data_dir": str(DATA), "limit": 2, "num_fewshot": 0,
            "max_new_tokens": 4}
    rows = []
    for _ in range(2):
        ctx = Context(load_model(tiny_model), model_arg=tiny_model, run_dir=run_dir)
        rows.append(kind.run(Unit("gsm8k", "g", opts, "kda_chunked"), ctx))
    first, second = rows
    assert [r["reference_source"] for r in first + second] == ["computed"] * 2 + ["run_dir"] * 2
    assert second[0]["reference_answers"]["calls"] == {"run_dir": 1}
    for a, b in zip(first, second):
        assert [q["ref_response"] for q in a["questions"]] == [q["ref_response"] for q in b["questions"]]
        assert all("cand_response" in q for q in b["questions"])
    (f,) = answer_files(run_dir)
    inputs = json.loads(f.read_text())["inputs"]
    assert inputs["model_id"].startswith("sha256:") and inputs["model_arg"] == tiny_model
    assert inputs["options"] == {"kind": "gsm8k", "batch": 1, "stack": "reference"}


def test_needle_units_in_two_processes_share_the_reference_never_the_candidate(monkeypatch, tmp_path):
    """As gsm8k's: two toggles' needle units in their own Contexts; the second reads the reference
    from the run directory and computes its own candidate. Negative control: the second toggle's
    candidate forgets the needle and its cell fails, which it could not if its answers were the
    reference's file."""
    import re

    from k3verify.kinds import needle as needle_kind
    from k3verify.quality import needle_gate

    plain, calls = _plain_ops(), []

    def fake_generate(model, tokenizer, prompt, max_new_tokens=needle_gate.NEEDLE_MAX_NEW_TOKENS, prefill_chunk=None):
        side = "ref" if _plain_ops() == plain else "cand"
        calls.append((model.tag, side, prefill_chunk))
        value = re.search(r"magic numbers for [a-z-]+ is: ([0-9]{7})", prompt).group(1)
        text = "0000000" if ops.OPS.moe_route is not None else value        # mut_router_bias_in_weights forgets
        return {"text": text, "prompt_tokens": len(prompt), "new_tokens": 7, "prefill_chunk": prefill_chunk,
                "prefill_s": 0.0, "decode_s": 0.0}

    monkeypatch.setattr(needle_gate, "needle_generate", fake_generate)
    import optimized_stack.tokenizer as tok_mod
    monkeypatch.setattr(tok_mod, "load_tokenizer", lambda arg: None)
    run_dir, results = tmp_path / "run", {}
    opts = {**needle_kind.OPTIONS, "lengths": [600], "depths": [0.2, 0.8]}
    for worker, toggle in (("a", "gemm_per_shape"), ("b", "mut_router_bias_in_weights")):
        model = stand_in("preset:k3-mini:seed0")
        model.tag = worker
        results[worker] = needle_kind.run(Unit("needle", "n", opts, toggle), Context(model, run_dir=run_dir))
    assert [(w, s) for w, s, _ in calls].count(("a", "ref")) == 2
    assert ("b", "ref") not in [(w, s) for w, s, _ in calls], "worker b recomputed the reference"
    assert [(w, s) for w, s, _ in calls].count(("b", "cand")) == 2, "worker b's candidate was not computed"
    assert {c for _, _, c in calls} == {512}                            # the CPU's chunk, both sides
    assert {r["reference_source"] for r in results["a"]} == {"computed"}
    assert {r["reference_source"] for r in results["b"]} == {"run_dir"}
    assert all(r.status == "fail" for r in results["b"]), "a forgetting candidate passed"
    assert all(r.status == "pass" for r in results["a"])
